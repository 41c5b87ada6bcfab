"""The replay counts how often gangs over several nodes straddled a topology level that the
topology's node labels declare (``rack``, ``block``)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from .conftest import write
from .test_cli import fedctl

NODE = "{cpu: 8, memory_mib: 8192, count: 2, devices: [{kind: GPU, model: A100-80GB, count: 1}]"
RACKS = (
    "sites:\n"
    "  - name: dc\n"
    "    nodes:\n"
    f"      - {NODE}, labels: {{rack: r1, block: b1}}}}\n"
    f"      - {NODE}, labels: {{rack: r2, block: b1}}}}\n"
    f"      - {NODE}, labels: {{rack: r3, block: b2}}}}\n"
    f"      - {NODE}, labels: {{rack: r4, block: b2}}}}\n"
)


def replay(tmp_path: Path, rows: list[str], capsys: pytest.CaptureFixture[str]) -> dict:
    topology = write(tmp_path, "t.yaml", RACKS)
    header = "job_id,submit_s,duration_s,replicas,accelerator_count\n"
    trace = write(tmp_path, "trace.csv", header + "\n".join(rows) + "\n")
    code = fedctl(
        "sim", "--topology", topology, "--trace", trace, "--policies", "completion-time", "--json"
    )
    out = capsys.readouterr()
    assert code == 0, out.err
    return json.loads(out.out)["policies"]["completion-time"]


def test_gangs_of_four_straddle_racks_and_of_eight_blocks(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """8 one-GPU nodes, 2 per rack, 4 per block. A 4-replica gang cannot sit in one rack (2
    nodes): it straddles racks always, and blocks only when it finds no whole block; an
    8-replica gang takes every node: it straddles both levels. A lone replica is no gang."""
    rows = ["four,0,100,4,1", "eight,200,100,8,1", "one,400,100,1,1"]
    m = replay(tmp_path, rows, capsys)
    levels = m["gangs_straddling"]
    assert levels["rack"] == {"gangs": 2, "straddled": 2, "share": 1.0}
    assert levels["block"]["gangs"] == 2
    assert levels["block"]["straddled"] >= 1  # the 8-replica gang, whatever the packer chose


def test_without_labels_there_is_no_straddle_figure(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    topology = write(tmp_path, "t.yaml", f"sites:\n  - name: dc\n    nodes:\n      - {NODE}}}\n")
    trace = write(
        tmp_path, "trace.csv", "submit_s,duration_s,replicas,accelerator_count\n0,10,2,1\n"
    )
    code = fedctl("sim", "--topology", topology, "--trace", trace, "--json")
    out = capsys.readouterr()
    assert code == 0, out.err
    for m in json.loads(out.out)["policies"].values():
        assert "gangs_straddling" not in m


def test_a_label_that_is_not_text_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    topology = write(
        tmp_path,
        "t.yaml",
        f"sites:\n  - name: dc\n    nodes:\n      - {NODE}, labels: {{rack: [1]}}}}\n",
    )
    trace = write(tmp_path, "trace.csv", "submit_s,duration_s\n0,10\n")
    code = fedctl("sim", "--topology", topology, "--trace", trace)
    assert code != 0
    assert "labels" in capsys.readouterr().err
