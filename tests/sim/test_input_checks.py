"""Input that cannot mislead: every bad option, path or cell is refused before the replay runs.

Each refusal is one line naming the option or ``file:line[:column]``, with exit status 1.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from federation.cli.app import main
from federation.sim.engine import SimConfig
from federation.sim.fields import InputFileError
from federation.sim.replay import replay
from federation.sim.topology import load_topology
from federation.sim.trace import load_trace

from .conftest import write

TOPOLOGY = "sites: [{name: a, nodes: [{cpu: 4, memory_mib: 4096, devices: [{model: V100}]}]}]\n"
TRACE = "submit_s,duration_s\n0,10\n"


def fedctl(*argv: str | Path) -> int:
    """Run fedctl in this process; its exit status."""
    with pytest.raises(SystemExit) as done:
        main([str(a) for a in argv])
    return int(done.value.code or 0)


def sim(folder: Path, *argv: str | Path, trace: str = TRACE) -> list[str | Path]:
    """``fedctl sim`` arguments over a one-site topology and ``trace`` written in ``folder``."""
    topology = write(folder, "t.yaml", TOPOLOGY)
    path = write(folder, "trace.csv", trace)
    return ["sim", "--topology", topology, "--trace", path, "--policies", "greedy", *argv]


def refused(capsys: pytest.CaptureFixture[str], argv: list[str | Path]) -> str:
    """Run fedctl, expect a one-line refusal before any replay; the message."""
    assert fedctl(*argv) == 1
    out = capsys.readouterr()
    assert "Traceback" not in out.err
    assert "replay wall time" not in out.err  # refused before the replay ran
    assert out.out == ""
    lines = out.err.strip().splitlines()
    assert len(lines) == 1, out.err
    return lines[0]


@pytest.mark.timeout(10)  # --max-offers 0 used to retry forever
@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("--max-offers", "0"), "--max-offers: must be a whole number >= 1, got 0"),
        (("--offers-at-once", "0"), "--offers-at-once: must be a whole number >= 1, got 0"),
        (("--offers-at-once", "-1"), "--offers-at-once: must be a whole number >= 1, got -1"),
        (("--seed", "-1"), "--seed: must be a whole number >= 0, got -1"),
        (("--estimate-error", "nan"), "--estimate-error: must be a number >= 0, got nan"),
        (("--estimate-error", "inf"), "--estimate-error: must be a number >= 0, got inf"),
        (("--estimate-error", "-0.5"), "--estimate-error: must be a number >= 0, got -0.5"),
        (("--policies", ""), "--policies: name at least one of completion-time"),
        (("--policies", ","), "--policies: name at least one of completion-time"),
        (("--policies", "greedy,greedy"), "--policies: named more than once: greedy"),
    ],
)
def test_bad_options_are_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], args: tuple[str, ...], message: str
) -> None:
    """Numbers out of range and empty policy lists name the option."""
    assert message in refused(capsys, sim(tmp_path, *args))


@pytest.mark.parametrize(
    ("option", "target", "message"),
    [
        ("--plots", "file/plots", "--plots: cannot write {p}: {d}/file is not a folder"),
        ("--plots", "file", "--plots: {p} exists and is not a folder"),
        ("--plots", "nowhere/plots", "--plots: cannot write {p}: folder {d}/nowhere does not"),
        ("--records", "folder", "--records: {p} is a folder; give a file name"),
        ("--records", "file/r.csv", "--records: cannot write {p}: {d}/file is not a folder"),
        ("--records", "nowhere/r.csv", "--records: cannot write {p}: folder {d}/nowhere does"),
        ("--records", "trace.csv", "--records: {p} is an input file; it would be overwritten"),
    ],
)
def test_output_paths_are_checked_before_the_replay(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    option: str,
    target: str,
    message: str,
) -> None:
    """A path that could not be written is refused up front, not after the whole replay."""
    (tmp_path / "file").write_text("")
    (tmp_path / "folder").mkdir()
    path = tmp_path / target
    expected = message.format(p=path, d=tmp_path)
    assert expected in refused(capsys, sim(tmp_path, option, path))


def test_good_output_paths_are_written(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A new records file in an existing folder is fine."""
    records = tmp_path / "r.csv"
    assert fedctl(*sim(tmp_path, "--records", records, "--json")) == 0
    assert records.read_text().startswith("policy,")


@pytest.mark.parametrize(
    ("name", "data", "message"),
    [
        ("trace.csv", b"submit_s,duration_s\n0,10\n1,1\xff0\n", "trace.csv:3:4: not UTF-8 text"),
        ("t.yaml", b"sites: [{name: \xe9, nodes: []}]\n", "t.yaml:1:16: not UTF-8 text"),
    ],
)
def test_files_that_are_not_utf8_are_refused_with_line_and_column(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], name: str, data: bytes, message: str
) -> None:
    """Bad bytes name the file, the line and the (byte) column instead of a traceback."""
    argv = sim(tmp_path)
    (tmp_path / name).write_bytes(data)
    line = refused(capsys, argv)
    assert f"{tmp_path / message}" in line
    assert "byte 0x" in line


def test_a_byte_order_mark_is_accepted(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Spreadsheets save UTF-8 with a BOM; it is not part of the first column's name."""
    path = tmp_path / "trace.csv"
    path.write_bytes(b"\xef\xbb\xbfjob_id,submit_s,duration_s\nj,0,10\n")
    assert [t.job_id for t in load_trace(path)] == ["j"]
    topology = tmp_path / "t.yaml"
    topology.write_bytes(b"\xef\xbb\xbf" + TOPOLOGY.encode())
    assert fedctl("sim", "--topology", topology, "--trace", path, "--policies", "greedy") == 0


def test_an_unknown_workload_class_is_refused(tmp_path: Path) -> None:
    """A typo no longer silently takes the training speeds."""
    path = write(tmp_path, "trace.csv", "submit_s,duration_s,workload_class\n0,1,\n0,1,trainnig\n")
    with pytest.raises(InputFileError) as err:
        load_trace(path)
    assert str(err.value) == (
        f"{path}:3: column 'workload_class': unknown class 'trainnig' (inference, training)"
    )


@pytest.mark.parametrize(
    ("models", "message"),
    [
        ("A100-80GB", "no site has A100-80GB (models in the topology: V100)"),
        ("V100|V10O", "V10O: not a known model and no site has it (models in the topology: V100)"),
    ],
)
def test_models_no_site_has_are_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], models: str, message: str
) -> None:
    """A task asking only for models the topology lacks would never run: refused by line."""
    header = "submit_s,duration_s,accelerator_count,accelerator_models"
    trace = f"{header}\n0,1,1,V100\n0,1,1,{models}\n"
    argv = sim(tmp_path, trace=trace)
    line = refused(capsys, argv)
    assert line == f"fedctl: {tmp_path / 'trace.csv'}:3: column 'accelerator_models': {message}"
    topology = load_topology(tmp_path / "t.yaml")
    with pytest.raises(InputFileError, match="column 'accelerator_models'"):
        replay(topology, load_trace(tmp_path / "trace.csv"), ["greedy"])


def test_models_listed_as_alternatives_may_be_missing(tmp_path: Path) -> None:
    """A known model another topology has may stand beside one this topology has."""
    trace = "submit_s,duration_s,accelerator_count,accelerator_models\n0,1,1,V100|A100-80GB\n"
    topology = load_topology(write(tmp_path, "t.yaml", TOPOLOGY))
    result = replay(topology, load_trace(write(tmp_path, "trace.csv", trace)), ["greedy"])
    assert result.summary["policies"]["greedy"]["jobs_completed"] == 1


def test_tasks_that_fit_nowhere_are_warned_about_in_the_tables(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A task bigger than any node never runs; the tables say so, not only the JSON."""
    argv = sim(tmp_path, trace="submit_s,duration_s,cpu\n0,10,64\n0,10,1\n")
    assert fedctl(*argv) == 0
    out = capsys.readouterr().out
    assert "warning: greedy: 1 of 2 task(s) fit nowhere" in out
    assert fedctl(*argv, "--json") == 0
    assert "warning: greedy: 1 of 2 task(s) fit nowhere" in capsys.readouterr().err


@pytest.mark.parametrize(
    "config",
    [{"max_offers_per_round": 0}, {"offers_at_once": 0}, {"seed": -1}],
)
def test_sim_config_refuses_settings_that_would_hang_or_crash(config: dict[str, int]) -> None:
    """The engine guards itself too: no offers per round would retry forever."""
    with pytest.raises(ValueError, match="must be >= "):
        SimConfig(**config)
