"""``-o table|wide|json|yaml`` and ``--json`` on every command, whole tables when piped, and
``--version``: parsed and printed in this process, no coordinator needed."""

from __future__ import annotations

import argparse
import io
import json
import sys
import tomllib
from pathlib import Path

import pytest
import yaml
from google.protobuf import timestamp_pb2

from federation import __version__
from federation.api.v1 import admin_service_pb2, jobs_pb2, resources_pb2
from federation.cli import output
from federation.cli.app import build_parser, main
from federation.cli.output import FORMATS, Output, output_of, show
from federation.cli.render import (
    JOB_WIDE_COLUMNS,
    SITE_WIDE_COLUMNS,
    FedctlConsole,
    jobs_table,
    sites_table,
)

ROOT = Path(__file__).resolve().parents[2]
LONG_SITE = "datacenter-frankfurt-rack-seventeen-behind-the-slow-link"
LONG_NAME = "nightly-retraining-of-the-vision-model-for-every-camera"


def fedctl(*argv: str | Path) -> int:
    """Run fedctl in this process; its exit status."""
    with pytest.raises(SystemExit) as done:
        main([str(a) for a in argv])
    return int(done.value.code or 0)


def every_parser(parser: argparse.ArgumentParser) -> list[tuple[str, argparse.ArgumentParser]]:
    """Every parser in fedctl's tree with its command words, depth first."""
    found = [(parser.prog, parser)]
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                found += every_parser(sub)
    return found


def test_every_command_takes_o_and_json() -> None:
    """Every parser, down to ``fedctl sim generate``, has ``-o`` with all four formats and
    ``--json``."""
    parsers = every_parser(build_parser())
    assert len(parsers) > 20
    for prog, parser in parsers:
        options = {o: a for a in parser._actions for o in a.option_strings}
        assert options["-o"].choices == FORMATS, prog
        assert "--output" in options, prog
        assert "--json" in options, prog


@pytest.mark.parametrize(
    ("argv", "shown"),
    [
        (["status"], "table"),
        (["--json", "status"], "json"),
        (["status", "--json"], "json"),
        (["jobs", "list", "--json"], "json"),
        (["jobs", "list", "-o", "json"], "json"),
        (["-o", "yaml", "jobs", "list"], "yaml"),
        (["status", "-o", "yaml"], "yaml"),
        (["jobs", "list", "-o", "wide"], "wide"),
        (["jobs", "explain", "j-1", "-o", "json"], "json"),
        (["top", "--once", "-o", "yaml"], "yaml"),
        (["sites", "links", "--output", "json"], "json"),
        (["queues", "list", "-o", "wide"], "wide"),
        (["sim", "--json"], "json"),
        (["sim", "generate", "--out", "x", "-o", "yaml"], "yaml"),
        (["pki", "init", "--dir", "x", "-o", "json"], "json"),
    ],
)
def test_the_format_is_read_before_or_after_the_subcommand(argv: list[str], shown: str) -> None:
    """``-o`` and ``--json`` work anywhere; a subcommand's parser never undoes the top's."""
    assert output_of(build_parser().parse_args(argv)).format == shown


def test_json_and_another_o_are_refused_before_any_work(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """``--json -o yaml`` ends with one line naming both, before credentials are looked for."""
    assert fedctl("--json", "status", "-o", "yaml") == 1
    err = capsys.readouterr().err
    assert err == "fedctl: --json and -o yaml ask for different output. To fix: give one\n"


def test_a_namespace_made_in_code_prints_tables() -> None:
    """A command called with a bare Namespace (``fedctl demo`` calls ``cmd_status``) gets tables."""
    assert output_of(argparse.Namespace()) == Output("table")
    assert output_of(argparse.Namespace(json=False)) == Output("table")


def job() -> jobs_pb2.Job:
    return jobs_pb2.Job(
        id="j-1",
        spec=jobs_pb2.JobSpec(
            name=LONG_NAME, tenant="team-a", queue="vision", priority=900, priority_class="urgent"
        ),
        state=jobs_pb2.JOB_STATE_RUNNING,
        submitted_by="tenant:team-a",
        created_at=timestamp_pb2.Timestamp(seconds=1_700_000_000),
        tasks=[jobs_pb2.TaskStatus(name="train", site=LONG_SITE, state=jobs_pb2.JOB_STATE_RUNNING)],
    )


def site() -> admin_service_pb2.Site:
    view = resources_pb2.SiteView(
        region="eu-central",
        scheduler="slurm",
        agent_version="0.1.0",
        price_per_device_hour=2.5,
    )
    return admin_service_pb2.Site(
        name=LONG_SITE,
        domain=resources_pb2.DOMAIN_DATACENTER,
        state=admin_service_pb2.SITE_STATE_UNREACHABLE,
        unreachable_s=75,
        joined_at=timestamp_pb2.Timestamp(seconds=1_700_000_000),
        view=view,
    )


def piped(monkeypatch: pytest.MonkeyPatch, *renderables: object, width: int = 40) -> str:
    """What ``show`` prints to a pipe whose COLUMNS is ``width``."""
    out = io.StringIO()
    monkeypatch.setattr(output, "console", FedctlConsole(file=out, width=width))
    show(*renderables)  # type: ignore[arg-type]
    return out.getvalue()


def cells(shown: str, key: str) -> list[str]:
    """The cells of the one line that holds ``key``."""
    (line,) = [line for line in shown.splitlines() if key in line]
    return [cell.strip() for cell in line.split("│")[1:-1]]


def test_piped_tables_print_whole(monkeypatch: pytest.MonkeyPatch) -> None:
    """Piped into a 40-column COLUMNS, the jobs and sites tables keep every name whole on one
    line: nothing cut with an ellipsis, nothing wrapped."""
    shown = piped(monkeypatch, jobs_table([job()]), sites_table([site()]))
    assert "…" not in shown
    assert cells(shown, "j-1") == [
        "j-1",
        LONG_NAME,
        "team-a",
        "RUNNING",
        f"train: {LONG_SITE} RUNNING",
        "",
    ]
    assert cells(shown, "UNREACHABLE")[:3] == [LONG_SITE, "datacenter", "UNREACHABLE"]


def test_wide_adds_columns(monkeypatch: pytest.MonkeyPatch) -> None:
    """``-o wide`` adds queue, priority, submitter and creation time to jobs, and region,
    scheduler, agent version, price and join time to sites."""
    shown = piped(monkeypatch, jobs_table([job()], wide=True), sites_table([site()], wide=True))
    for column in (*JOB_WIDE_COLUMNS, *SITE_WIDE_COLUMNS):
        assert column in shown
    assert cells(shown, "j-1")[-4:] == [
        "vision",
        "900 (urgent)",
        "tenant:team-a",
        "2023-11-14 22:13:20",
    ]
    assert cells(shown, "UNREACHABLE")[-2:] == ["0.0", "-"]  # arrivals/h, mean run
    assert cells(shown, "UNREACHABLE")[-7:-2] == [
        "eu-central",
        "slurm",
        "0.1.0",
        "2.5",
        "2023-11-14 22:13:20",
    ]
    narrow = piped(monkeypatch, jobs_table([job()]), sites_table([site()]))
    assert not any(column in narrow for column in (*JOB_WIDE_COLUMNS, *SITE_WIDE_COLUMNS))


@pytest.mark.parametrize("fmt", ["json", "yaml"])
def test_data_formats_carry_the_same_message(fmt: str, capsys: pytest.CaptureFixture[str]) -> None:
    """JSON and YAML hold the same document, with the .proto field names."""
    Output(fmt).messages([job()])
    printed = capsys.readouterr().out
    doc = json.loads(printed) if fmt == "json" else yaml.safe_load(printed)
    assert doc[0]["spec"]["priority_class"] == "urgent"
    assert doc[0]["tasks"][0]["site"] == LONG_SITE
    assert doc[0]["created_at"] == "2023-11-14T22:13:20Z"


def test_yaml_keeps_control_characters_escaped(capsys: pytest.CaptureFixture[str]) -> None:
    """A tenant's escape sequence reaches a terminal as an escape in quotes, never raw."""
    evil = "x\x1b]0;pwned\x07\u202e"
    Output("yaml").data({"name": evil})
    printed = capsys.readouterr().out
    assert "\x1b" not in printed
    assert "\u202e" not in printed
    assert yaml.safe_load(printed) == {"name": evil}


def test_a_yaml_stream_marks_each_document(capsys: pytest.CaptureFixture[str]) -> None:
    """``jobs watch -o yaml`` starts every event with ``---``, so a reader can split them."""
    for seq in (1, 2):
        Output("yaml").messages(jobs_pb2.JobEvent(job_id="j-1", sequence=seq), stream=True)
    events = list(yaml.safe_load_all(capsys.readouterr().out))
    assert [e["sequence"] for e in events] == [1, 2]  # 64-bit integers are numbers


def test_version_is_written_once(capsys: pytest.CaptureFixture[str]) -> None:
    """``fedctl --version`` prints ``federation.__version__``, which pyproject.toml reads."""
    assert fedctl("--version") == 0
    assert capsys.readouterr().out == f"fedctl {__version__}\n"
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert "version" not in pyproject["project"]
    assert "version" in pyproject["project"]["dynamic"]
    version = pyproject["tool"]["setuptools"]["dynamic"]["version"]
    assert version == {"attr": "federation.__version__"}


def test_plots_without_matplotlib_say_which_extra(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Without the ``sim`` extra, ``fedctl sim --plots`` names it in one line, before replaying."""
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib: ImportError
    topology = tmp_path / "t.yaml"
    topology.write_text("sites: [{name: a, nodes: [{cpu: 4, memory_mib: 4096}]}]\n")
    trace = tmp_path / "trace.csv"
    trace.write_text("submit_s,duration_s\n0,10\n")
    argv = ("sim", "--topology", topology, "--trace", trace, "--plots", tmp_path / "plots")
    assert fedctl(*argv) == 1
    out = capsys.readouterr()
    assert out.err == (
        "fedctl: --plots draws with matplotlib, which this install lacks. "
        "To fix: pip install 'fedplane[sim]'\n"
    )
    assert out.out == ""


def test_json_has_zero_values_and_64_bit_numbers(capsys: pytest.CaptureFixture[str]) -> None:
    """A script reads ``"exit_code": 0`` rather than guessing from an absent key, and an
    epoch past 2**53 as the number it is, not a string."""
    job = jobs_pb2.Job(id="j-1")
    job.tasks.add(name="t", epoch=2**60 + 1, exit_code=0)
    job.spec.tasks.add(name="t", output_bytes=7, speed={"H100": 2.5})
    Output("json").messages(job)
    data = json.loads(capsys.readouterr().out)
    assert data["tasks"][0]["epoch"] == 2**60 + 1
    assert data["tasks"][0]["exit_code"] == 0
    assert data["spec"]["tasks"][0]["output_bytes"] == 7
    assert data["spec"]["tasks"][0]["speed"] == {"H100": 2.5}
    assert data["state"] == "JOB_STATE_UNSPECIFIED"
