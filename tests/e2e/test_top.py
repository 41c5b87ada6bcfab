"""``fedctl top`` against a real federation: one snapshot piped, as JSON, and live under a pty."""

from __future__ import annotations

import asyncio
import fcntl
import json
import os
import select
import signal
import struct
import subprocess
import sys
import termios
import time
from collections.abc import Iterator

import pytest

from federation.api.v1 import job_service_pb2, jobs_pb2
from federation.local import LocalFederation

from .conftest import jobs, python_task, spec, wait_for_job

pytestmark = pytest.mark.xdist_group("e2e-top")


def fedctl_env(fed: LocalFederation, **extra: str) -> dict[str, str]:
    return {
        **os.environ,
        "FEDCTL_PKI_DIR": str(fed.pki.dir),
        "FEDCTL_COORDINATOR": fed.address,
        **extra,
    }


def fedctl(fed: LocalFederation, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "federation.cli", *args],
        env=fedctl_env(fed, COLUMNS="80"),
        capture_output=True,
        text=True,
        timeout=60,
    )


@pytest.fixture(scope="module")
def running_job(federation: LocalFederation) -> Iterator[str]:
    """The id of a job that runs on edge-a (the only NPUs) for the whole module."""

    async def submit() -> str:
        async with federation.operator().channel() as channel:
            task = python_task(
                "spin",
                "import time; time.sleep(300)",
                resources={"accelerator": {"kind": "NPU", "count": 1}},
            )
            request = job_service_pb2.SubmitJobRequest(spec=spec("top-sleeper", [task]))
            job = (await jobs(channel).SubmitJob(request)).job
            await wait_for_job(channel, job.id, frozenset({jobs_pb2.JOB_STATE_RUNNING}))
            return job.id

    async def cancel(job_id: str) -> None:
        async with federation.operator().channel() as channel:
            await jobs(channel).CancelJob(job_service_pb2.CancelJobRequest(job_id=job_id))

    job_id = asyncio.run(submit())
    try:
        yield job_id
    finally:
        asyncio.run(cancel(job_id))


def test_once_and_json_show_sites_devices_and_the_running_job(
    federation: LocalFederation, running_job: str
) -> None:
    """Piped, `top` prints one snapshot, whole at 80 columns; `-o json` the same as data."""
    deadline = time.monotonic() + 20
    while True:  # the site publishes the booked device shortly after the task starts
        result = fedctl(federation, "top", "-o", "json")
        assert result.returncode == 0, result.stderr
        snapshot = json.loads(result.stdout)
        booked = [d["device"] for d in snapshot["devices"] if d["booked"] == 1.0]
        if booked or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert {s["site"] for s in snapshot["sites"]} == {"edge-a", "dc-a", "cloud-a"}
    assert {s["state"] for s in snapshot["sites"]} == {"CONNECTED"}
    edge = next(s for s in snapshot["sites"] if s["site"] == "edge-a")
    assert edge["devices"] == {"NPU": {"booked": 1, "total": 2}}
    assert len(snapshot["devices"]) == 8
    assert booked
    assert booked[0].startswith("edge-box-npu")
    [job] = [j for j in snapshot["jobs"] if j["job"] == running_job]
    assert (job["site"], job["task"], job["nodes"]) == ("edge-a", "spin", ["edge-box"])
    assert job["running_s"] >= 0

    once = fedctl(federation, "top", "--once")
    assert once.returncode == 0, once.stderr
    assert "…" not in once.stdout  # whole tables, wider than COLUMNS=80
    for title in ("Sites", "Devices", "Running jobs"):
        assert title in once.stdout
    job_row = next(line for line in once.stdout.splitlines() if running_job in line)
    assert "edge-a" in job_row
    assert "edge-box:NPU:" in job_row
    assert "\x1b" not in once.stdout  # piped: no styles, no screen control


def read_until(master: int, needle: bytes, timeout_s: float) -> bytes:
    """Everything the pty printed until ``needle`` appeared; fails after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    seen = b""
    while needle not in seen:
        left = deadline - time.monotonic()
        assert left > 0, f"{needle!r} not shown in {timeout_s}s: {seen[-3000:]!r}"
        ready, _, _ = select.select([master], [], [], left)
        if ready:
            chunk = os.read(master, 65536)
            assert chunk, f"the pty closed before {needle!r}: {seen[-3000:]!r}"
            seen += chunk
    return seen


def wait_exit(proc: subprocess.Popen[bytes], master: int, timeout_s: float) -> bytes:
    """Drain the pty (so fedctl never blocks writing) until it exits; its last output."""
    deadline = time.monotonic() + timeout_s
    rest = b""
    while proc.poll() is None:
        assert time.monotonic() < deadline, f"fedctl top still running: {rest[-2000:]!r}"
        ready, _, _ = select.select([master], [], [], 0.05)
        if ready:
            rest += os.read(master, 65536)  # the test holds the slave end: never EIO
    return rest


@pytest.mark.parametrize("how", ["q", "SIGINT"])
def test_live_view_quits_and_restores_the_terminal(
    federation: LocalFederation, running_job: str, how: str
) -> None:
    """On a terminal `top` draws frames in the alternate screen; `q` (or Ctrl-C's SIGINT)
    ends it with status 0, the screen and the terminal's echo and line mode back."""
    master, slave = os.openpty()
    try:
        fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 60, 200, 0, 0))
        before = termios.tcgetattr(slave)
        env = fedctl_env(federation, TERM="xterm-256color")
        for name in ("COLUMNS", "LINES", "NO_COLOR", "TTY_COMPATIBLE", "FORCE_COLOR"):
            env.pop(name, None)
        proc = subprocess.Popen(
            [sys.executable, "-m", "federation.cli", "top", "--interval", "0.5"],
            stdin=slave,
            stdout=slave,
            stderr=slave,
            env=env,
            start_new_session=True,
        )
        try:
            shown = read_until(master, b"Running jobs", timeout_s=20)
            shown += read_until(master, running_job.encode(), timeout_s=10)
            assert b"fedctl top" in shown
            assert b"\x1b[?1049h" in shown  # the alternate screen
            mode = termios.tcgetattr(slave)
            assert not mode[3] & termios.ECHO  # cbreak: keys are read, not echoed
            assert not mode[3] & termios.ICANON
            if how == "q":
                os.write(master, b"q")
            else:
                proc.send_signal(signal.SIGINT)
            rest = wait_exit(proc, master, timeout_s=5)
            assert proc.returncode == 0, (shown + rest)[-2000:]
            assert b"\x1b[?1049l" in rest  # the main screen is back
            assert b"Traceback" not in rest
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        after = termios.tcgetattr(slave)
        assert after[3] & termios.ECHO
        assert after[3] & termios.ICANON
        assert after == before
    finally:
        os.close(master)
        os.close(slave)
