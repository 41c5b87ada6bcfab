"""One agent per state folder: a second agent started on a running agent's folder exits 2 with
one line naming the first, and the first keeps its session and its task; once the first is
SIGKILLed, a new start takes the folder."""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

import psutil
import pytest

from federation.agent.state_lock import LOCK_FILE
from federation.api.v1 import job_service_pb2, jobs_pb2
from federation.local import LocalFederation

from .conftest import SITES, jobs, python_task, read_marker, spec, until, wait_for_job

pytestmark = pytest.mark.xdist_group("e2e-state-lock")

SITE = SITES[0]


def coordinator_events(fed: LocalFederation, event: str) -> list[dict[str, object]]:
    lines = fed.log_path("coordinator").read_text(errors="replace").splitlines()
    entries = [json.loads(line) for line in lines if line.startswith("{")]
    return [e for e in entries if e.get("event") == event and e.get("site") == SITE.name]


async def test_a_second_agent_on_a_state_folder_exits_and_disturbs_nothing(
    tmp_path: Path,
) -> None:
    fed = LocalFederation(tmp_path / "fed", [SITE])
    starts, go = tmp_path / "starts", tmp_path / "go"
    code = (
        "import os, time\n"
        f"open({str(starts)!r}, 'a').write(f'{{os.getpid()}}\\n')\n"
        f"while not os.path.exists({str(go)!r}): time.sleep(0.05)\n"
    )
    task = python_task("t", code, resources={"accelerator": {"kind": "NPU", "count": 1}})
    home = fed.root / "sites" / SITE.name
    try:
        await fed.start()
        first = fed.processes[SITE.name]
        async with fed.operator().channel() as channel:
            request = job_service_pb2.SubmitJobRequest(spec=spec("held", [task]))
            job = (await jobs(channel).SubmitJob(request)).job
            running = await wait_for_job(channel, job.id, frozenset({jobs_pb2.JOB_STATE_RUNNING}))

            async def started() -> bool:
                return bool(read_marker(starts))

            await until(started, "the task to start", timeout_s=10)
            [pid] = (int(line) for line in read_marker(starts))

            second = await asyncio.create_subprocess_exec(
                sys.executable,
                "-m",
                "edge_agent",
                "--config",
                str(home / "agent.toml"),
                "--log-json",
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE,
            )
            try:
                out, err = await asyncio.wait_for(second.communicate(), 30)
            finally:
                if second.returncode is None:  # it runs on beside the first: the bug
                    second.kill()
                    await second.wait()
            assert second.returncode == 2
            plain = [
                line
                for line in (out + err).decode(errors="replace").splitlines()
                if not line.startswith("{")
            ]
            assert len(plain) == 1, plain
            assert plain[0].startswith(
                f"fed-edge-agent: another agent (pid {first.pid}) is already running on state "
                f"folder {home / 'state'}. "
            )

            assert first.poll() is None
            assert psutil.pid_exists(pid)
            assert len(coordinator_events(fed, "site_connected")) == 1
            assert not coordinator_events(fed, "site_session_replaced")
            go.touch()
            done = await wait_for_job(channel, job.id)
        assert done.state == jobs_pb2.JOB_STATE_SUCCEEDED, done.reason
        assert done.tasks[0].epoch == running.tasks[0].epoch
        assert done.tasks[0].moves == 0
        assert read_marker(starts) == [str(pid)], "the task started again"

        fed.kill(SITE.name)  # a crash: the kernel lets go of its lock
        await fed.start_site(SITE)
        await fed.wait_connected()
        restarted = fed.processes[SITE.name]
        assert restarted.poll() is None
        assert (home / "state" / LOCK_FILE).read_text() == f"{restarted.pid}\n"
    finally:
        go.touch()
        fed.stop()
