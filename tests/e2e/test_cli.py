"""fedctl against a real federation: tables, JSON, and one-line errors without tracebacks."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from federation.local import LocalFederation

from .conftest import fedctl

pytestmark = pytest.mark.xdist_group("e2e-cli")


def test_status_json_lists_sites(federation: LocalFederation) -> None:
    """`fedctl --json status` prints the sites, the lone leader, and marks declared devices."""
    result = fedctl(federation, "--json", "status")
    assert result.returncode == 0, result.stderr
    status = json.loads(result.stdout)
    names = {s["name"] for s in status["sites"]}
    assert names == {"edge-a", "dc-a", "cloud-a"}
    assert status["leader"] == federation.address
    assert [(c["address"], c["leader"]) for c in status["coordinators"]] == [
        (federation.address, True)
    ]
    table = fedctl(federation, "status")
    assert "(declared)" in table.stdout
    assert "CONNECTED" in table.stdout
    assert f"leader {federation.address}" in table.stdout


def test_submit_get_from_yaml(federation: LocalFederation, tmp_path: Path) -> None:
    """A YAML spec submitted with fedctl runs; `jobs get` shows where and how it ended."""
    spec = tmp_path / "job.yaml"
    spec.write_text(
        "name: from-cli\n"
        "tasks:\n"
        f"  - name: t\n    command: [{sys.executable}, -c, \"print('cli ok')\"]\n"
        "    resources: {accelerator: {kind: NPU, count: 1}}\n"
    )
    submitted = fedctl(federation, "--json", "jobs", "submit", str(spec))
    assert submitted.returncode == 0, submitted.stderr
    job_id = json.loads(submitted.stdout)[0]["id"]
    deadline = time.monotonic() + 30
    while True:  # poll the job through the CLI until it ends
        reply = json.loads(fedctl(federation, "--json", "jobs", "get", job_id).stdout)
        got = reply["job"]
        if got["state"] in ("JOB_STATE_SUCCEEDED", "JOB_STATE_FAILED") or (
            time.monotonic() > deadline
        ):
            break
        time.sleep(0.1)
    assert got["state"] == "JOB_STATE_SUCCEEDED"
    assert got["tasks"][0]["site"] == "edge-a"
    assert "cli ok" in got["tasks"][0]["output_tail"]
    states = [e["job_state"] for e in reply["events"]]
    assert states[0] == "JOB_STATE_PENDING"
    assert states[-1] == "JOB_STATE_SUCCEEDED"
    events = fedctl(federation, "--json", "jobs", "events", job_id, "--task", "t")
    assert events.returncode == 0, events.stderr
    assert json.loads(events.stdout) == reply["events"]
    lines = fedctl(federation, "jobs", "events", job_id).stdout.splitlines()
    assert len(lines) == len(reply["events"])
    assert f"{job_id} task t -> SUCCEEDED at edge-a: exited 0" in lines[-1]


def test_bad_spec_is_one_clear_error(federation: LocalFederation, tmp_path: Path) -> None:
    """An invalid spec gives exit 1 and a message naming the field, no traceback."""
    spec = tmp_path / "bad.yaml"
    spec.write_text("name: bad\ntasks:\n  - name: t\n    command: []\n")
    result = fedctl(federation, "jobs", "submit", str(spec))
    assert result.returncode == 1
    assert "spec.tasks[0].command" in result.stderr
    assert "Traceback" not in result.stderr


def test_unknown_kind_in_file_is_caught_locally(
    federation: LocalFederation, tmp_path: Path
) -> None:
    """An unknown accelerator kind in a spec file is reported with the file name."""
    spec = tmp_path / "tpu.yaml"
    spec.write_text(
        "name: x\ntasks:\n  - {name: t, command: [a], "
        "resources: {accelerator: {kind: TPU, count: 1}}}\n"
    )
    result = fedctl(federation, "jobs", "submit", str(spec))
    assert result.returncode == 1
    assert "tpu.yaml" in result.stderr
    assert "Traceback" not in result.stderr


def test_unreachable_coordinator_says_how_to_fix(tmp_path: Path) -> None:
    """With no credentials, fedctl explains what to pass instead of failing obscurely."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("FEDCTL_")}
    result = subprocess.run(
        [sys.executable, "-m", "federation.cli", "status"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        cwd=tmp_path,
    )
    assert result.returncode == 1
    assert "To fix" in result.stderr


def metric(text: str, name: str) -> float:
    """The value of an unlabelled sample in Prometheus text format."""
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"{name} not exported")


def test_metrics_count_sites_and_jobs(federation: LocalFederation, tmp_path: Path) -> None:
    """/metrics reports the connected sites and counts a submitted job."""
    url = f"http://127.0.0.1:{federation.metrics_port}/metrics"
    before = urllib.request.urlopen(url, timeout=10).read().decode()
    assert metric(before, "federation_sites_connected") == 3
    spec = tmp_path / "job.yaml"
    spec.write_text(f"name: counted\ntasks:\n  - {{name: t, command: [{sys.executable}, -V]}}\n")
    assert fedctl(federation, "jobs", "submit", str(spec)).returncode == 0
    after = urllib.request.urlopen(url, timeout=10).read().decode()
    submitted = "federation_jobs_submitted_total"
    assert metric(after, submitted) == metric(before, submitted) + 1


# What a tenant can put in a job name (any string up to 63 characters) or its output: markup
# that crashes rich or makes a link, and raw escapes: window title, clear screen, OSC 8 link.
MARKUP_NAME = "[/x]"
ESCAPES_NAME = "\x1b]0;pwned\x07\x1b[2J\x1b]8;;https://evil.example/\x1b\\here\x1b]8;;\x1b\\"
EVIL_OUTPUT = f"{ESCAPES_NAME} [link=https://evil.example/]click[/link] [bold]loud :boom:"
SGR = re.compile(r"\x1b\[[0-9;]*m")


def without_styles(output: str) -> str:
    """``output`` less the SGR colour and weight sequences rich itself emits on a terminal."""
    return SGR.sub("", output)


def wait_until_ended(fed: LocalFederation, job_id: str) -> dict[str, object]:
    deadline = time.monotonic() + 30
    while True:
        reply = json.loads(fedctl(fed, "--json", "jobs", "get", job_id).stdout)
        if reply["job"]["state"] in ("JOB_STATE_SUCCEEDED", "JOB_STATE_FAILED"):
            return dict(reply)
        assert time.monotonic() < deadline, reply
        time.sleep(0.1)


@pytest.mark.parametrize("terminal", [False, True], ids=["pipe", "terminal"])
def test_tenant_strings_print_as_text(
    federation: LocalFederation, tmp_path: Path, terminal: bool
) -> None:
    """Names and output a tenant chose print literally, with no escape reaching the terminal.

    ``terminal``: rich styles its output as on a terminal, so the only escapes left must be its
    own SGR styles: no title, clear-screen or hyperlink.
    """
    code = f"import sys; print({EVIL_OUTPUT!r}); sys.exit(3)"
    jobs = [
        {"name": name, "tasks": [{"name": "t", "command": [sys.executable, "-c", code]}]}
        for name in (MARKUP_NAME, ESCAPES_NAME)
    ]
    spec = tmp_path / "jobs.json"
    spec.write_text(json.dumps(jobs))
    submitted = fedctl(federation, "--json", "jobs", "submit", str(spec))
    assert submitted.returncode == 0, submitted.stderr
    ids = [job["id"] for job in json.loads(submitted.stdout)]
    for job_id, name in zip(ids, (MARKUP_NAME, ESCAPES_NAME), strict=True):
        reply = wait_until_ended(federation, job_id)
        job = reply["job"]
        assert isinstance(job, dict)
        assert job["spec"]["name"] == name  # --json keeps the exact bytes
        assert EVIL_OUTPUT in job["tasks"][0]["output_tail"]

    # rich reads TTY_COMPATIBLE before FORCE_COLOR: the "pipe" run stays plain wherever it runs.
    env = {"TTY_COMPATIBLE": "1" if terminal else "0"}
    shown = {
        command: fedctl(federation, *command.split(), env=env)
        for command in ("jobs list", f"jobs get {ids[0]}", f"jobs get {ids[1]}")
    }
    for command, result in shown.items():
        assert result.returncode == 0, (command, result.stderr)
        assert "Traceback" not in result.stderr
        output = without_styles(result.stdout) if terminal else result.stdout
        assert "\x1b" not in output, (command, output)
        assert "\x07" not in output
        assert "\\x1b]0;pwned\\x07\\x1b[2J" in output, command  # visible, not acted on
    assert MARKUP_NAME in shown["jobs list"].stdout
    details = without_styles(shown[f"jobs get {ids[0]}"].stdout)
    assert f"│ {MARKUP_NAME} " in details  # the name cell holds the literal name
    assert "[link=https://evil.example/]click[/link] [bold]loud :boom:" in details


def test_a_limited_listing_says_how_to_go_on(federation: LocalFederation, tmp_path: Path) -> None:
    """`jobs list --limit N` ends with the page token of the rest, on stderr."""
    spec = tmp_path / "jobs.json"
    job = {"name": "listed", "tasks": [{"name": "t", "command": ["true"]}]}
    spec.write_text(json.dumps([job, job, job]))
    assert fedctl(federation, "jobs", "submit", str(spec)).returncode == 0
    first = fedctl(federation, "--json", "jobs", "list", "--limit", "2")
    assert first.returncode == 0, first.stderr
    token = first.stderr.split("--page-token ")[1].strip()
    rest = fedctl(federation, "--json", "jobs", "list", "--limit", "1000", "--page-token", token)
    assert "--page-token" not in rest.stderr
    everything = fedctl(federation, "--json", "jobs", "list", "--limit", "1000")
    ids = [j["id"] for j in json.loads(first.stdout) + json.loads(rest.stdout)]
    assert ids == [j["id"] for j in json.loads(everything.stdout)]
    assert len(ids) >= 3


@pytest.mark.parametrize(
    ("code", "status", "state"),
    [("print('ok')", 0, "SUCCEEDED"), ("raise SystemExit(5)", 3, "FAILED")],
)
def test_submit_wait_ends_with_the_jobs_outcome(
    federation: LocalFederation, tmp_path: Path, code: str, status: int, state: str
) -> None:
    """`jobs submit --wait` streams the job's events and exits as it ended; `jobs wait` and
    `jobs watch ID` on the ended job end at once the same way."""
    spec = tmp_path / "job.json"
    job = {"name": "waited", "tasks": [{"name": "t", "command": [sys.executable, "-c", code]}]}
    spec.write_text(json.dumps(job))
    done = fedctl(federation, "jobs", "submit", str(spec), "--wait")
    assert done.returncode == status, done.stderr
    lines = done.stdout.splitlines()
    job_id = lines[0].split()[1]
    assert lines[0].startswith(f"submitted {job_id}")
    assert f"task t -> {state}" in lines[-1]
    assert fedctl(federation, "jobs", "wait", job_id).returncode == status
    watched = fedctl(federation, "jobs", "watch", job_id)
    assert watched.returncode == 0
    assert f"-> {state}" in watched.stdout


def test_an_operators_cancel_ends_a_wait_with_4(
    federation: LocalFederation, tmp_path: Path
) -> None:
    spec = tmp_path / "job.json"
    job = {"name": "held", "tasks": [{"name": "t", "command": ["sleep", "60"]}]}
    spec.write_text(json.dumps(job))
    job_id = json.loads(fedctl(federation, "--json", "jobs", "submit", str(spec)).stdout)[0]["id"]
    waiting = subprocess.Popen(
        [sys.executable, "-m", "federation.cli", "jobs", "wait", job_id],
        env={
            **os.environ,
            "FEDCTL_PKI_DIR": str(federation.pki.dir),
            "FEDCTL_COORDINATOR": federation.address,
        },
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert fedctl(federation, "jobs", "cancel", job_id).returncode == 0
        assert waiting.wait(30) == 4
    finally:
        waiting.kill()


def test_a_dry_run_says_where_a_job_would_go_and_stores_nothing(
    federation: LocalFederation, tmp_path: Path
) -> None:
    spec = tmp_path / "job.json"
    job = {
        "name": "dry",
        "tasks": [
            {
                "name": "t",
                "command": ["true"],
                "resources": {"accelerator": {"kind": "NPU", "count": 1}},
            }
        ],
    }
    spec.write_text(json.dumps(job))
    before = json.loads(fedctl(federation, "--json", "jobs", "list", "--limit", "1000").stdout)
    dry = fedctl(federation, "jobs", "submit", str(spec), "--dry-run")
    assert dry.returncode == 0, dry.stderr
    assert "dry: valid; not stored" in dry.stdout
    assert "edge-a" in dry.stdout  # the only site with NPUs
    data = json.loads(fedctl(federation, "--json", "jobs", "submit", str(spec), "--dry-run").stdout)
    (placement,) = data[0]["placement"]
    assert placement["task"] == "t"
    assert [s["site"] for s in placement["sites"] if s["feasible"]] == ["edge-a"]
    after = json.loads(fedctl(federation, "--json", "jobs", "list", "--limit", "1000").stdout)
    assert len(after) == len(before)
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"name": "dry", "tasks": [{"name": "t", "command": []}]}))
    refused = fedctl(federation, "jobs", "submit", str(bad), "--dry-run")
    assert refused.returncode == 1
    assert "spec.tasks[0].command" in refused.stderr
