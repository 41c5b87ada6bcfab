"""``fedctl sim``: generate a small trace, replay it, and write tables, JSON, records and plots."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest

from federation.cli.app import main
from federation.sim.report import PLOTS

from .conftest import write

ONE_SITE = "sites: [{name: a, nodes: [{cpu: 4, memory_mib: 4096}]}]\n"


def fedctl(*argv: str | Path) -> int:
    """Run fedctl in this process; its exit status."""
    with pytest.raises(SystemExit) as done:
        main([str(a) for a in argv])
    return int(done.value.code or 0)


def test_generate_then_replay_writes_json_records_and_plots(
    data_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The smoke path: files are generated, replayed under two policies and reported."""
    gen = tmp_path / "gen"
    assert (
        fedctl(
            "sim",
            "generate",
            "--out",
            gen,
            "--data",
            data_dir,
            "--jobs",
            120,
            "--nodes",
            30,
            "--sites",
            5,
            "--seed",
            2,
        )
        == 0
    )
    capsys.readouterr()
    plots, records = tmp_path / "plots", tmp_path / "records.csv"
    code = fedctl(
        "sim",
        "--topology",
        gen / "topology.yaml",
        "--trace",
        gen / "trace.csv",
        "--policies",
        "completion-time,greedy",
        "--seed",
        1,
        "--json",
        "--plots",
        plots,
        "--records",
        records,
    )
    assert code == 0
    out = capsys.readouterr()
    doc = json.loads(out.out)
    assert set(doc["policies"]) == {"completion-time", "greedy"}
    assert doc["trace"]["jobs"] == 120
    assert "replay wall time" in out.err
    for name in PLOTS:
        assert (plots / name).stat().st_size > 1000, name
        assert (plots / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with records.open() as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 2 * 120
    assert {r["state"] for r in rows} == {"SUCCEEDED"}


def test_tables_for_people(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Without --json the figures come as tables, one row per policy."""
    topology = write(tmp_path, "t.yaml", ONE_SITE)
    trace = write(tmp_path, "trace.csv", "submit_s,duration_s\n0,10\n")
    assert fedctl("sim", "--topology", topology, "--trace", trace, "--policies", "greedy") == 0
    out = capsys.readouterr().out
    assert "greedy" in out
    assert "JCT mean" in out


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("--topology", "t.yaml", "--trace", "trace.csv", "--policies", "fastest"), "fastest"),
        (("--topology", "t.yaml", "--trace", "missing.csv"), "missing.csv: cannot read"),
        (("--topology", "t.yaml"), "give --topology and --trace"),
    ],
)
def test_mistakes_are_reported_without_a_traceback(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], args: tuple[str, ...], message: str
) -> None:
    """Unknown policies and unreadable files end with a one-line message and status 1."""
    write(tmp_path, "t.yaml", ONE_SITE)
    write(tmp_path, "trace.csv", "submit_s,duration_s\n0,10\n")
    argv = [tmp_path / a if a.endswith((".yaml", ".csv")) else a for a in args]
    assert fedctl("sim", *argv) == 1
    err = capsys.readouterr().err
    assert message in err
    assert "Traceback" not in err


PREFER_B = """
import numpy as np

class PreferB:
    name = "PreferB"

    def score(self, req, snap, feasible):
        return np.array([100.0 if snap.site_ids[i] == "b" else 0.0 for i in feasible])
"""


def test_the_simulator_replays_a_coordinator_configs_profile_with_its_plugins(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """``--placement-config`` adds the config's profile as policy ``configured``, loading its
    plugins from outside the project as the coordinator does: here a scorer that sends every
    task to site b, where the default profile breaks the tie by name (a)."""
    write(tmp_path, "outside_sim_plugins.py", PREFER_B)
    monkeypatch.syspath_prepend(str(tmp_path))
    topology = write(
        tmp_path,
        "topology.yaml",
        "sites:\n"
        + "".join(
            f"  - {{name: {n}, nodes: [{{cpu: 8, memory_mib: 8192, "
            "devices: [{model: A100-80GB, count: 1}]}]}\n"
            for n in "ab"
        ),
    )
    trace = write(
        tmp_path,
        "trace.csv",
        "job_id,submit_s,duration_s,accelerator_count\nj0,0,60,1\nj1,600,60,1\n",
    )
    config = write(
        tmp_path,
        "coordinator.toml",
        '[placement_scores]\nCompletionTime = 1.0\n"outside_sim_plugins:PreferB" = 5.0\n',
    )
    records = tmp_path / "records.csv"
    argv = ["sim", "--topology", topology, "--trace", trace, "--policies", "completion-time"]
    code = fedctl(*argv, "--placement-config", config, "--json", "--records", records)
    assert code == 0, capsys.readouterr().err
    assert set(json.loads(capsys.readouterr().out)["policies"]) == {"completion-time", "configured"}
    with records.open() as f:
        sites = {(r["policy"], r["site"]) for r in csv.DictReader(f)}
    assert sites == {("completion-time", "a"), ("configured", "b")}
    bad = write(tmp_path, "bad.toml", 'placement_filters = ["SiteState", "nowhere:Filter"]\n')
    assert fedctl(*argv, "--placement-config", bad) == 1
    assert "--placement-config: filter plugin 'nowhere:Filter'" in capsys.readouterr().err
