"""The report of ``fedctl sim`` on the shipped example (``examples/sim/``) is pinned: a change to
the scheduling parts that the simulator shares with the coordinator which alters any decision
alters a figure here. A change meant to alter decisions rewrites these files
(``fedctl sim ... -o json > tests/sim/data/sharing-report-POLICY.json``, and
``elastic-report.json`` likewise) and says why."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from .test_input_checks import fedctl

ROOT = Path(__file__).resolve().parents[2]
PINNED = Path(__file__).resolve().parent / "data"


@pytest.mark.parametrize("policy", ["completion-time", "greedy", "round-robin"])
def test_the_shipped_example_reports_what_it_reported(
    policy: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(ROOT)  # the report names its inputs as given, relative to the checkout
    argv = ["sim", "--topology", "examples/sim/sharing-topology.yaml"]
    argv += ["--trace", "examples/sim/sharing-trace.csv", "--policies", policy, "--seed", "1"]
    assert fedctl(*argv, "-o", "json") == 0
    report = json.loads(capsys.readouterr().out)
    pinned = json.loads((PINNED / f"sharing-report-{policy}.json").read_text())
    assert report == pinned
    # A task preempted and placed again holds its devices once: no more than there are.
    assert report["policies"][policy]["utilisation"]["all"] <= 1.0


def test_the_elastic_example_reports_what_it_reported(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """``examples/sim/elastic-*`` (node types, no spot), pinned byte for byte: capacity that
    is never taken back replays as it always did."""
    monkeypatch.chdir(ROOT)
    argv = ["sim", "--topology", "examples/sim/elastic-topology.yaml"]
    argv += ["--trace", "examples/sim/elastic-trace.csv"]
    argv += ["--policies", "completion-time,round-robin,greedy", "--seed", "1", "-o", "json"]
    assert fedctl(*argv) == 0
    assert capsys.readouterr().out == (PINNED / "elastic-report.json").read_text()
