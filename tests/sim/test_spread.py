"""The simulator replays the parts of a divided task (``train/0``, ...) as tasks of their own;
it does not model the skew."""

from __future__ import annotations

from pathlib import Path

import pytest

from .conftest import write
from .test_cli import fedctl

TWO_SITES = (
    "sites:\n"
    "  - {name: a, nodes: [{cpu: 4, memory_mib: 4096}]}\n"
    "  - {name: b, nodes: [{cpu: 4, memory_mib: 4096}]}\n"
)


def test_parts_of_a_divided_task_replay(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    topology = write(tmp_path, "t.yaml", TWO_SITES)
    rows = [f"spread,train/{n},0,10,2" for n in range(3)]
    trace = write(
        tmp_path, "trace.csv", "job_id,task,submit_s,duration_s,replicas\n" + "\n".join(rows) + "\n"
    )
    records = tmp_path / "records.csv"
    code = fedctl(
        "sim",
        "--topology",
        topology,
        "--trace",
        trace,
        "--policies",
        "completion-time",
        "--records",
        records,
    )
    assert code == 0, capsys.readouterr().err
    lines = records.read_text().splitlines()
    assert len(lines) == 4
    assert all("SUCCEEDED" in line for line in lines[1:])
