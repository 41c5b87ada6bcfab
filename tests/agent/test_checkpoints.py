"""Checkpoints: the completion rule, the embedded core's environment and its reports."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from federation.agent.checkpoints import (
    DEFAULT_DIR,
    CheckpointScanner,
    TaskCheckpoints,
    checkpoint_dir,
    interval_s,
)
from federation.agent.embedded_core import EmbeddedCore
from federation.api.v1 import jobs_pb2

from .cores import RUNNING, SUCCEEDED, Recorder, node, offer, run


def complete(folder: Path, name: str, data: bytes = b"x", *, mtime_ns: int | None = None) -> None:
    """Write checkpoint ``name`` as the rule asks: the data, then its marker."""
    (folder / name).write_bytes(data)
    marker = folder / f"{name}.done"
    marker.touch()
    if mtime_ns is not None:
        os.utime(marker, ns=(mtime_ns, mtime_ns))


def test_a_checkpoint_counts_once_its_marker_exists(tmp_path: Path) -> None:
    """Data without a marker is not reported; with one it is, once, with path and size."""
    scanner = CheckpointScanner(tmp_path, 0.0, time.time())
    (tmp_path / "step-1").write_bytes(b"12345")
    assert scanner.scan() == []
    (tmp_path / "step-1.done").touch()
    (found,) = scanner.scan()
    assert found.path == str(tmp_path / "step-1")
    assert found.bytes == 5
    assert abs(found.time.ToNanoseconds() - (tmp_path / "step-1.done").stat().st_mtime_ns) == 0
    assert scanner.scan() == []


def test_a_marker_without_its_data_waits(tmp_path: Path) -> None:
    """A marker whose checkpoint is missing is skipped until the checkpoint appears."""
    scanner = CheckpointScanner(tmp_path, 0.0, time.time())
    (tmp_path / "early.done").touch()
    assert scanner.scan() == []
    (tmp_path / "early").write_bytes(b"ab")
    assert [c.bytes for c in scanner.scan()] == [2]


def test_touching_the_marker_again_reports_again_and_order_is_by_time(tmp_path: Path) -> None:
    """A rewritten checkpoint counts again, and new ones come oldest first."""
    scanner = CheckpointScanner(tmp_path, 0.0, time.time())
    complete(tmp_path, "b", mtime_ns=2_000_000_000_000_000_000)
    complete(tmp_path, "a", mtime_ns=1_000_000_000_000_000_000)
    assert [Path(c.path).name for c in scanner.scan()] == ["a", "b"]
    complete(tmp_path, "a", b"longer", mtime_ns=3_000_000_000_000_000_000)
    (again,) = scanner.scan()
    assert (Path(again.path).name, again.bytes) == ("a", 6)


def test_a_folder_checkpoint_counts_every_file(tmp_path: Path) -> None:
    """A checkpoint that is a folder reports the total size of the files under it."""
    scanner = CheckpointScanner(tmp_path, 0.0, time.time())
    (tmp_path / "ckpt" / "shards").mkdir(parents=True)
    (tmp_path / "ckpt" / "meta").write_bytes(b"abc")
    (tmp_path / "ckpt" / "shards" / "0").write_bytes(b"0123456789")
    (tmp_path / "ckpt.done").touch()
    assert [c.bytes for c in scanner.scan()] == [13]


def test_progress_adds_the_restored_checkpoints_work(tmp_path: Path) -> None:
    """Progress is the restored checkpoint's plus the run time here until the marker."""
    started = 1_700_000_000.0
    scanner = CheckpointScanner(tmp_path, 40.0, started)
    complete(tmp_path, "c", mtime_ns=int((started + 12.5) * 1e9))
    (found,) = scanner.scan()
    assert found.progress_s == pytest.approx(52.5)


def test_a_missing_folder_has_no_checkpoints(tmp_path: Path) -> None:
    """Scanning a folder the task never created finds nothing and does not fail."""
    assert CheckpointScanner(tmp_path / "absent", 0.0, 0.0).scan() == []


def test_policy_defaults(tmp_path: Path) -> None:
    """An empty policy means the 'checkpoints' folder and a 60 s interval, at least 0.1 s."""
    assert checkpoint_dir(tmp_path, jobs_pb2.Checkpoint()) == tmp_path / DEFAULT_DIR
    assert checkpoint_dir(tmp_path, jobs_pb2.Checkpoint(dir="a/b")) == tmp_path / "a" / "b"
    assert interval_s(jobs_pb2.Checkpoint()) == 60.0
    assert interval_s(jobs_pb2.Checkpoint(interval_s=0.001)) == 0.1


# The task dumps its env, then completes two checkpoints and exits.
CHECKPOINTING = (
    "import json, os, time\n"
    "json.dump(dict(os.environ), open('env.json', 'w'))\n"
    "d = os.environ['FEDERATION_CHECKPOINT_DIR']\n"
    "for i in range(2):\n"
    "    open(os.path.join(d, f'step-{i}'), 'w').write('x' * (i + 1))\n"
    "    open(os.path.join(d, f'step-{i}.done'), 'w').close()\n"
    "    time.sleep(0.3)\n"
)


async def test_core_exports_the_folder_and_reports_each_checkpoint(
    make_core: Callable[..., EmbeddedCore], recorder: Recorder, tmp_path: Path
) -> None:
    """A checkpointing task gets its folder under the work folder; each checkpoint is reported."""
    core = make_core([node("n")])
    o = offer(epoch=3, code=CHECKPOINTING)
    o.spec.checkpoint.CopyFrom(jobs_pb2.Checkpoint(dir="ckpt", interval_s=0.1))
    await run(core, o)
    final = await recorder.final()
    assert final.state == SUCCEEDED, final.output_tail
    folder = tmp_path / "work/job-1/train/3/ckpt"
    env = json.loads((tmp_path / "work/job-1/train/3/0/env.json").read_text())
    assert env["FEDERATION_CHECKPOINT_DIR"] == str(folder)
    assert "FEDERATION_RESTORE_FROM" not in env
    reported = [r.checkpoint for r in recorder.reports if r.state == RUNNING and r.checkpoint.path]
    assert [(Path(c.path).name, c.bytes) for c in reported] == [("step-0", 1), ("step-1", 2)]
    assert final.checkpoint.path == str(folder / "step-1")
    assert core.tasks()[0].checkpoint.path == str(folder / "step-1")


async def test_a_restart_sees_where_to_restore_from(
    make_core: Callable[..., EmbeddedCore], recorder: Recorder, tmp_path: Path
) -> None:
    """An offer carrying a checkpoint starts the task with FEDERATION_RESTORE_FROM set to it."""
    saved = tmp_path / "elsewhere" / "step-9"
    saved.parent.mkdir()
    saved.write_text("9")
    core = make_core([node("n")])
    o = offer(code="import json, os; json.dump(dict(os.environ), open('env.json', 'w'))")
    o.spec.checkpoint.CopyFrom(jobs_pb2.Checkpoint())
    o.restore.CopyFrom(jobs_pb2.CheckpointRecord(path=str(saved), bytes=1, site="other"))
    await run(core, o)
    assert (await recorder.final()).state == SUCCEEDED
    env = json.loads((tmp_path / "work/job-1/train/1/0/env.json").read_text())
    assert env["FEDERATION_RESTORE_FROM"] == str(saved)
    assert env["FEDERATION_CHECKPOINT_DIR"] == str(tmp_path / "work/job-1/train/1/checkpoints")


async def test_no_policy_no_checkpoint_env(
    make_core: Callable[..., EmbeddedCore], recorder: Recorder, tmp_path: Path
) -> None:
    """A task without a checkpoint policy gets neither variable and no folder."""
    core = make_core([node("n")])
    await run(
        core, offer(code="import json, os; json.dump(dict(os.environ), open('env.json', 'w'))")
    )
    assert (await recorder.final()).state == SUCCEEDED
    env = json.loads((tmp_path / "work/job-1/train/1/0/env.json").read_text())
    assert "FEDERATION_CHECKPOINT_DIR" not in env
    assert not (tmp_path / "work/job-1/train/1/checkpoints").exists()


def test_the_checkpoint_env_is_absolute_for_a_relative_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A relative work folder (a relative state_dir) still gives tasks absolute paths."""
    monkeypatch.chdir(tmp_path)
    restore = jobs_pb2.CheckpointRecord(path="state/work/job-1/train/1/checkpoints/step-1")
    checkpoints = TaskCheckpoints(
        jobs_pb2.Checkpoint(), Path("state/work/job-1/train/2"), restore, lambda _: None
    )
    env = checkpoints.env()
    assert env["FEDERATION_CHECKPOINT_DIR"] == str(
        tmp_path / "state/work/job-1/train/2/checkpoints"
    )
    assert env["FEDERATION_RESTORE_FROM"] == str(tmp_path / restore.path)


async def test_a_task_of_a_relative_work_folder_checkpoints(
    recorder: Recorder, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A core given a relative work folder runs tasks (in their own folder) that checkpoint."""
    monkeypatch.chdir(tmp_path)
    core = EmbeddedCore(
        [node("n")],
        site="site-a",
        work_dir=Path("state/work"),
        on_status=recorder.on_status,
        on_change=recorder.on_change,
        kill_grace_s=2.0,
    )
    try:
        o = offer(code=CHECKPOINTING)
        o.spec.checkpoint.CopyFrom(jobs_pb2.Checkpoint(interval_s=0.1))
        await run(core, o)
        final = await recorder.final()
    finally:
        await core.shutdown(grace_s=0.5)
    assert final.state == SUCCEEDED, final.output_tail
    folder = tmp_path / "state/work/job-1/train/1/checkpoints"
    env = json.loads((folder.parent / "0" / "env.json").read_text())
    assert env["FEDERATION_CHECKPOINT_DIR"] == str(folder)
    assert final.checkpoint.path == str(folder / "step-1")
