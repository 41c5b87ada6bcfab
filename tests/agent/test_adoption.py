"""An embedded core adopts the tasks the agent before it left running on the same state_dir.

The first agent is a process of its own (as after an agent restart): it commits a task, then
stops on purpose (its core closed) or crashes. The core under test then adopts what it left.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import psutil

from federation.agent.embedded_core import EmbeddedCore

from .cores import CANCELLED, FAILED, RUNNING, SUCCEEDED, Recorder, allocated, node, offer

TESTS = Path(__file__).parents[1]

FIRST_AGENT = """
import asyncio, os, sys, time
from pathlib import Path
sys.path.insert(0, sys.argv[1])
from agent.cores import node, offer, run
from federation.agent.embedded_core import EmbeddedCore

async def main():
    state, work, how, code = Path(sys.argv[2]), Path(sys.argv[3]), sys.argv[4], sys.argv[5]
    core = EmbeddedCore(
        [node("n", devices=2)], site="site-a", work_dir=work, on_status=lambda _: None,
        on_change=lambda: None, state_dir=state,
    )
    await core.adopt()
    await run(core, offer(epoch=7, devices=1, code=code))
    while not (Path(sys.argv[6]) / "pid").exists():  # the replica runs
        await asyncio.sleep(0.05)
    if how == "crash":
        os._exit(1)
    if how == "crash-after-end":
        # The replica ends and its supervisor records how, while the core, its loop blocked,
        # cannot notice: the agent dies with the end unreported.
        (Path(sys.argv[6]) / "go").touch()
        exit_file = work / "job-1" / "train" / "7.run" / "0" / "exit"
        while not exit_file.exists():
            time.sleep(0.02)
        os._exit(1)
    if how == "stop":
        await core.shutdown(0.5)
    await core.close()

asyncio.run(main())
"""


def task_code(folder: Path) -> str:
    """Writes its pid, waits for a ``go`` file, says it is done; exits 0."""
    return (
        "import os, pathlib, time\n"
        f"d = pathlib.Path({str(folder)!r})\n"
        "(d / 'pid.tmp').write_text(str(os.getpid())); (d / 'pid.tmp').rename(d / 'pid')\n"
        "while not (d / 'go').exists(): time.sleep(0.05)\n"
        "print('done', os.getpid(), flush=True)\n"
    )


async def first_agent(tmp_path: Path, how: str) -> int:
    """Runs the first agent until it has left (or crashed); the pid of its task's replica."""
    done = await asyncio.to_thread(
        subprocess.run,
        [
            sys.executable,
            "-c",
            FIRST_AGENT,
            str(TESTS),
            str(tmp_path / "state"),
            str(tmp_path / "work"),
            how,
            task_code(tmp_path),
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == (1 if how.startswith("crash") else 0), done.stdout + done.stderr
    return int((tmp_path / "pid").read_text())


def alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def records(tmp_path: Path) -> list[Path]:
    return sorted((tmp_path / "state" / "tasks").glob("*.json"))


async def test_a_restarted_agent_adopts_a_running_task(
    make_core: Callable[..., EmbeddedCore], recorder: Recorder, tmp_path: Path
) -> None:
    """The task left running is adopted: the same process, reported RUNNING with its epoch and
    device, holding that device, then SUCCEEDED once with its output."""
    pid = await first_agent(tmp_path, "leave")
    assert alive(pid)
    core = make_core([node("n", devices=2)], state_dir=tmp_path / "state")
    await core.adopt()
    [report] = core.tasks()
    assert (report.job_id, report.epoch, report.state) == ("job-1", 7, RUNNING)
    assert list(report.devices) == ["n:GPU:0"]
    assert allocated(core) == {"n": [0]}
    refused = await core.offer(offer("job-2", devices=2))
    assert not refused.accepted, "a device held by the adopted task was offered again"
    (tmp_path / "go").touch()
    final = await recorder.final()
    assert (final.state, final.epoch, final.exit_code) == (SUCCEEDED, 7, 0)
    assert final.output_tail == f"done {pid}\n"
    assert [r.state for r in recorder.reports] == [SUCCEEDED]
    assert allocated(core) == {"n": []}
    assert records(tmp_path), "the final report is kept until acknowledged"
    core.forget("job-1", "train", 7)
    assert not records(tmp_path)


async def test_an_adopted_task_is_still_stopped_when_told(
    make_core: Callable[..., EmbeddedCore], recorder: Recorder, tmp_path: Path
) -> None:
    """A cancel (the coordinator's, or its fencing of a stale epoch) stops an adopted task."""
    pid = await first_agent(tmp_path, "leave")
    core = make_core([node("n", devices=2)], state_dir=tmp_path / "state", kill_grace_s=0.5)
    await core.adopt()
    await asyncio.wait_for(core.cancel("job-1", "train", 7, "stale epoch"), 10)
    final = await recorder.final()
    assert (final.state, final.reason) == (CANCELLED, "stale epoch")
    assert not alive(pid)


async def test_a_task_that_ended_while_no_agent_ran_is_reported(
    make_core: Callable[..., EmbeddedCore], recorder: Recorder, tmp_path: Path
) -> None:
    """A task that ended between two agents is reported with how it ended, from its files."""
    pid = await first_agent(tmp_path, "leave")
    (tmp_path / "go").touch()
    for _ in range(1200):  # up to 60 s: a loaded machine may be slow to run it to its end
        if not alive(pid):
            break
        await asyncio.sleep(0.05)
    # The supervisor writes the replica's exit once its output has drained, a moment after
    # the replica itself is gone.
    exit_files: list[Path] = []
    for _ in range(1200):
        if exit_files := list((tmp_path / "work").glob("job-1/train/7.run/0/exit")):
            break
        await asyncio.sleep(0.05)
    assert len(exit_files) == 1, "the supervisor wrote no exit file"
    core = make_core([node("n", devices=2)], state_dir=tmp_path / "state")
    await core.adopt()
    final = await recorder.final()
    assert (final.state, final.epoch, final.output_tail) == (SUCCEEDED, 7, f"done {pid}\n")
    assert [r.state for r in core.tasks()] == [SUCCEEDED]


async def test_the_tasks_of_a_crashed_agent_are_not_adopted(
    make_core: Callable[..., EmbeddedCore], recorder: Recorder, tmp_path: Path
) -> None:
    """A crashed agent's task dies with it and the next agent forgets it (the coordinator
    places it again): nothing reported, nothing held."""
    pid = await first_agent(tmp_path, "crash")
    core = make_core([node("n", devices=2)], state_dir=tmp_path / "state")
    await core.adopt()
    assert not alive(pid)
    assert core.tasks() == []
    assert recorder.reports == []
    assert allocated(core) == {"n": []}
    assert not records(tmp_path)


async def test_a_task_that_ended_just_before_its_agent_crashed_is_reported_not_rerun(
    make_core: Callable[..., EmbeddedCore], recorder: Recorder, tmp_path: Path
) -> None:
    """A crashed agent's task whose every replica had ended by itself (its supervisor recorded
    how) is reported as it ended: placed again, it would run twice."""
    pid = await first_agent(tmp_path, "crash-after-end")
    core = make_core([node("n", devices=2)], state_dir=tmp_path / "state")
    await core.adopt()
    final = await recorder.final()
    assert (final.state, final.epoch, final.output_tail) == (SUCCEEDED, 7, f"done {pid}\n")
    assert allocated(core) == {"n": []}


async def test_tasks_stopped_with_their_agent_are_not_reported_again(
    make_core: Callable[..., EmbeddedCore], recorder: Recorder, tmp_path: Path
) -> None:
    """With stop_tasks_on_exit the agent stops its tasks as it goes; the next one does not
    report that stop (the coordinator would take it for a cancel): it places them again."""
    pid = await first_agent(tmp_path, "stop")
    assert not alive(pid)
    core = make_core([node("n", devices=2)], state_dir=tmp_path / "state")
    await core.adopt()
    assert core.tasks() == []
    assert recorder.reports == []
    assert not records(tmp_path)


async def test_a_supervisor_whose_start_time_differs_is_not_adopted(
    make_core: Callable[..., EmbeddedCore], recorder: Recorder, tmp_path: Path
) -> None:
    """A recorded pid whose process started at another time is not the supervisor recorded:
    it is left alone, and the task is reported FAILED, its supervisor lost."""
    pid = await first_agent(tmp_path, "leave")
    [path] = records(tmp_path)
    record = json.loads(path.read_text())
    [[supervisor, start]] = record["replicas"]
    record["replicas"] = [[supervisor, start + 1]]
    path.write_text(json.dumps(record))
    try:
        core = make_core([node("n", devices=2)], state_dir=tmp_path / "state")
        await core.adopt()
        final = await recorder.final()
        assert (final.state, final.epoch) == (FAILED, 7)
        assert f"its supervisor (pid {supervisor}) ended without recording" in final.reason
        assert alive(supervisor)
        assert alive(pid)
    finally:
        os.kill(supervisor, signal.SIGKILL)  # its replica dies with it
