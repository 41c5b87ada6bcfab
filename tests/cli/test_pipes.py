"""fedctl as a process at the end of a real pipe: whole tables for ``| cat``, and a quiet end
when the reader goes away (``| head -1``), against a real coordinator on loopback."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from federation import __version__
from federation.local import LocalFederation

JOB_NAME = "nightly-retraining-of-the-vision-model-for-every-camera"
TENANT = "team-vision-with-a-long-tenant-name"
TASK = "the-training-step-of-the-nightly-run"


@pytest.fixture(scope="module")
def coordinator(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalFederation]:
    """A coordinator process alone (no site is needed to list jobs or ask for the status)."""
    fed = LocalFederation(tmp_path_factory.mktemp("fed"), [])
    try:
        asyncio.run(fed.start_coordinator())
        yield fed
    finally:
        fed.stop()


def environment(fed: LocalFederation | None, columns: int = 40) -> dict[str, str]:
    """fedctl's environment: this federation's operator, and a COLUMNS narrower than any table."""
    env = {**os.environ, "COLUMNS": str(columns)}
    for name in ("FORCE_COLOR", "TTY_COMPATIBLE", "FEDCTL_PKI_DIR", "FEDCTL_COORDINATOR"):
        env.pop(name, None)
    if fed is not None:
        env.update(FEDCTL_PKI_DIR=str(fed.pki.dir), FEDCTL_COORDINATOR=fed.address)
    return env


def fedctl(fed: LocalFederation | None, *args: str) -> subprocess.CompletedProcess[str]:
    """Run fedctl with its stdout a pipe this test reads to the end."""
    return subprocess.run(
        [sys.executable, "-m", "federation.cli", *args],
        env=environment(fed),
        capture_output=True,
        text=True,
        timeout=60,
    )


def into_closed_pipe(fed: LocalFederation | None, *args: str) -> subprocess.CompletedProcess[str]:
    """Run fedctl with its stdout a pipe whose reader has already gone: every write fails."""
    read, write = os.pipe()
    os.close(read)
    try:
        return subprocess.run(
            [sys.executable, "-m", "federation.cli", *args],
            env=environment(fed),
            stdout=write,
            stderr=subprocess.PIPE,
            text=True,
            timeout=60,
        )
    finally:
        os.close(write)


@pytest.fixture(scope="module")
def submitted(coordinator: LocalFederation, tmp_path_factory: pytest.TempPathFactory) -> str:
    """A job with long names, waiting (there is no site); its id."""
    spec = tmp_path_factory.mktemp("spec") / "job.yaml"
    spec.write_text(
        f"name: {JOB_NAME}\ntenant: {TENANT}\n"
        f"tasks:\n  - name: {TASK}\n    command: ['true']\n"
        "    resources: {accelerator: {kind: GPU, count: 1}}\n"
    )
    result = fedctl(coordinator, "--json", "jobs", "submit", str(spec))
    assert result.returncode == 0, result.stderr
    return str(json.loads(result.stdout)[0]["id"])


def test_jobs_list_piped_prints_every_name_whole(
    coordinator: LocalFederation, submitted: str
) -> None:
    """``fedctl jobs list | cat`` with COLUMNS=40 keeps each cell whole on the job's one line."""
    result = fedctl(coordinator, "jobs", "list")
    assert result.returncode == 0, result.stderr
    assert "…" not in result.stdout
    (line,) = [line for line in result.stdout.splitlines() if submitted in line]
    cells = [cell.strip() for cell in line.split("│")[1:-1]]
    assert cells[:5] == [submitted, JOB_NAME, TENANT, "PENDING", f"{TASK}: - PENDING"]


@pytest.mark.parametrize(
    ("option", "load"), [(("-o", "yaml"), "yaml"), (("--json",), "json"), (("-o", "json"), "json")]
)
def test_jobs_list_takes_the_format_after_the_subcommand(
    coordinator: LocalFederation, submitted: str, option: tuple[str, ...], load: str
) -> None:
    """``fedctl jobs list --json`` (refused before) and ``-o yaml`` print the jobs as data."""
    result = fedctl(coordinator, "jobs", "list", *option)
    assert result.returncode == 0, result.stderr
    jobs = json.loads(result.stdout) if load == "json" else yaml.safe_load(result.stdout)
    assert [job["id"] for job in jobs] == [submitted]
    assert jobs[0]["spec"]["tenant"] == TENANT


@pytest.mark.parametrize(
    "args",
    [
        ("--json", "status"),
        ("status",),
        ("status", "-o", "yaml"),
        ("jobs", "list"),
        ("jobs", "list", "-o", "wide"),
    ],
)
def test_a_closed_pipe_ends_quietly(coordinator: LocalFederation, args: tuple[str, ...]) -> None:
    """Writing to a pipe whose reader is gone ends with status 0 and nothing on stderr, from
    JSON, YAML and rich's tables alike."""
    result = into_closed_pipe(coordinator, *args)
    assert (result.returncode, result.stderr) == (0, "")


@pytest.mark.parametrize("args", [("--version",), ("--help",), ("pki", "init", "--dir", "{tmp}")])
def test_a_closed_pipe_ends_quietly_without_a_coordinator(
    tmp_path: Path, args: tuple[str, ...]
) -> None:
    """Commands that print while parsing (``--version``, ``--help``) or offline end quietly too."""
    argv = [a.format(tmp=tmp_path / "pki") for a in args]
    result = into_closed_pipe(None, *argv)
    assert (result.returncode, result.stderr) == (0, "")


@pytest.mark.skipif(shutil.which("head") is None, reason="needs head(1)")
def test_status_into_head_ends_quietly(coordinator: LocalFederation) -> None:
    """The shell's own ``fedctl --json status | head -1`` under pipefail: one line, status 0."""
    command = f"set -o pipefail; {sys.executable} -m federation.cli --json status | head -1"
    result = subprocess.run(
        ["bash", "-c", command],
        env=environment(coordinator),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert (result.returncode, result.stdout, result.stderr) == (0, "{\n", "")


def test_version_from_a_process() -> None:
    """``fedctl --version`` prints the package's version and exits 0."""
    result = fedctl(None, "--version")
    assert (result.returncode, result.stdout) == (0, f"fedctl {__version__}\n")


def test_the_cli_loads_no_matplotlib() -> None:
    """fedctl's commands load without matplotlib (the ``sim`` extra) until a plot is drawn."""
    probe = "import sys; import federation.cli.app; sys.exit('matplotlib' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", probe], timeout=60).returncode == 0
