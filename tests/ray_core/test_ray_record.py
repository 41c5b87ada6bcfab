"""The record a Ray task's folder keeps for an agent that adopts its job (no Ray needed)."""

from __future__ import annotations

from pathlib import Path

from datacenter_agent.ray_cluster.record import RECORD_FILE, TaskRecord, read_record, save_record
from federation.agent.usage import Slot
from federation.api.v1 import jobs_pb2


def test_a_record_reads_back_as_written_and_private_to_the_agent(tmp_path: Path) -> None:
    """What the task's data needs comes back (nothing else of its spec), the file is 0600,
    and a slot on a launched node takes the name its Ray node has now, or goes if it is gone."""
    spec = jobs_pb2.TaskSpec(command=["train"], replicas=3, env={"SECRET": "x"})
    spec.outputs.add(name="model", path="out")
    spec.checkpoint.CopyFrom(jobs_pb2.Checkpoint(dir="ckpt", interval_s=5, keep=3))
    restore = jobs_pb2.CheckpointRecord(path="/w/j/t/1/.restore/step-3", progress_s=42.5)
    restore.stored.name = "step-3"
    slots = (
        Slot("10.0.0.5", 1.0, 512, ()),
        Slot("a100x2-1", 2.0, 0, (0, 1)),
        Slot("a100x2-0", 2, 0, (1,)),
    )
    save_record(
        tmp_path, TaskRecord("vision", spec, restore, 30.0, slots, ("", "ray-b", "ray-gone"))
    )
    assert (tmp_path / RECORD_FILE).stat().st_mode & 0o777 == 0o600
    assert [p.name for p in tmp_path.iterdir()] == [RECORD_FILE]  # no partial file left
    record = read_record(tmp_path)
    assert record is not None
    assert (record.tenant, record.restore, record.stop_after_s) == ("vision", restore, 30.0)
    assert list(record.spec.outputs) == list(spec.outputs)
    assert (record.spec.checkpoint, record.spec.replicas) == (spec.checkpoint, 3)
    assert not record.spec.command
    assert not record.spec.env
    assert record.slots == slots
    assert record.slots_now({"ray-b": "a100x2-0"}) == (
        Slot("10.0.0.5", 1.0, 512, ()),
        Slot("a100x2-0", 2.0, 0, (0, 1)),
    )


def test_no_record_or_an_unreadable_one_is_none(tmp_path: Path) -> None:
    assert read_record(tmp_path) is None
    (tmp_path / RECORD_FILE).write_text("{not json")
    assert read_record(tmp_path) is None
