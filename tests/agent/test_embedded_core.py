"""The embedded core: negotiation, bin-packing and real task processes."""

from __future__ import annotations

import asyncio
import json
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil
import pytest

from federation.agent.core import LocalCore
from federation.agent.embedded_core import EmbeddedCore
from federation.api.v1 import resources_pb2, site_link_service_pb2

from .beacon import Beacon
from .cores import (
    CANCELLED,
    DUMP_ENV,
    FAILED,
    NPU,
    RUNNING,
    SUCCEEDED,
    Recorder,
    allocated,
    commit_for,
    node,
    offer,
    run,
)


def test_embedded_core_satisfies_local_core(make_core: Callable[..., EmbeddedCore]) -> None:
    """EmbeddedCore is a LocalCore named "embedded"."""
    core: LocalCore = make_core([node("n")])
    assert core.name == "embedded"


async def test_offer_accepted_reserves_capacity(
    make_core: Callable[..., EmbeddedCore], recorder: Recorder
) -> None:
    """An accepted offer holds devices, cpu and memory until released."""
    core = make_core([node("dc-gpu-1", devices=4, cpu=32, memory_mib=65536)])
    answer = await core.offer(offer(devices=2, cpu=4, memory_mib=1024, lease_s=30))
    assert answer.accepted
    assert len(answer.reservation_id) == 32
    assert (answer.expected_start_s, answer.lease_s) == (0, 30)
    (view,) = core.nodes()
    assert [d.index for d in view.devices if d.allocated] == [0, 1]
    assert (view.cpu_free, view.memory_free_mib) == (28, 64512)
    assert core.queue() == resources_pb2.QueueState(pending_tasks=1, running_tasks=0)
    assert recorder.changes == 1
    await core.release(answer.reservation_id)
    await core.release(answer.reservation_id)  # idempotent
    assert allocated(core) == {"dc-gpu-1": []}
    assert core.queue().pending_tasks == 0
    assert recorder.changes == 2


async def test_default_lease(make_core: Callable[..., EmbeddedCore]) -> None:
    """An offer without a lease gets a 10 s one."""
    answer = await make_core([node("n")]).offer(offer(lease_s=0))
    assert answer.lease_s == 10


@pytest.mark.parametrize(
    ("request_", "reason"),
    [
        (
            {"devices": 4, "kind": NPU, "vendor": "huawei"},
            "needs 4 NPU (huawei) per replica; best node edge-box-1 has 2 free",
        ),
        (
            {"devices": 1, "kind": NPU, "models": ["Ascend-910B"]},
            "needs 1 NPU (model Ascend-910B) per replica; best node edge-box-1 has 0 free",
        ),
        ({"cpu": 12}, "needs 12 CPU per replica; best node edge-box-1 has 8 free"),
        (
            {"memory_mib": 20000},
            "needs 20000 MiB memory per replica; best node edge-box-1 has 16384 MiB free",
        ),
        ({"command": []}, "task has no command"),
    ],
)
async def test_offer_declined_with_precise_reason(
    make_core: Callable[..., EmbeddedCore], request_: dict[str, Any], reason: str
) -> None:
    """A declined offer says what was needed and what the closest node has."""
    edge = node(
        "edge-box-1",
        devices=2,
        kind=NPU,
        vendor="huawei",
        model="Ascend-310P",
        cpu=8,
        memory_mib=16384,
    )
    core = make_core([edge])
    answer = await core.offer(offer(**request_))
    assert not answer.accepted
    assert answer.reason == reason
    assert core.queue().pending_tasks == 0


async def test_best_fit_fills_partly_used_node(make_core: Callable[..., EmbeddedCore]) -> None:
    """Two 1-GPU replicas land on the partly used node, not on the empty one."""
    core = make_core(
        [node("dc-gpu-1", devices=4, model="A100"), node("dc-gpu-2", devices=4, model="H100")]
    )
    first = await core.offer(offer("job-1", devices=1, models=["H100"]))
    assert first.accepted
    assert allocated(core) == {"dc-gpu-1": [], "dc-gpu-2": [0]}
    second = await core.offer(offer("job-2", replicas=2, devices=1))
    assert second.accepted
    assert allocated(core) == {"dc-gpu-1": [], "dc-gpu-2": [0, 1, 2]}


async def test_devices_prefer_a_group_that_holds_the_replica(
    make_core: Callable[..., EmbeddedCore],
) -> None:
    """A 2-GPU replica takes a whole NVLink group rather than spanning two."""
    gpus = node("dc-gpu-1", devices=4)
    for device in gpus.devices:
        device.interconnect_group = f"nvl-{device.index // 2}"
    core = make_core([gpus])
    assert (await core.offer(offer("job-1", devices=1))).accepted
    assert (await core.offer(offer("job-2", devices=2))).accepted
    assert allocated(core) == {"dc-gpu-1": [0, 2, 3]}
    assert (await core.offer(offer("job-3", devices=1))).accepted
    assert allocated(core) == {"dc-gpu-1": [0, 1, 2, 3]}


async def test_cpu_only_work_avoids_accelerator_nodes(
    make_core: Callable[..., EmbeddedCore],
) -> None:
    """A task without accelerators goes to the node without devices."""
    core = make_core([node("a-gpu", devices=2), node("b-cpu")])
    assert (await core.offer(offer(cpu=2))).accepted
    assert {n.name: n.cpu_free for n in core.nodes()} == {"a-gpu": 32, "b-cpu": 30}


async def test_gang_is_all_or_nothing(make_core: Callable[..., EmbeddedCore]) -> None:
    """A gang that fits only in part is declined and holds nothing."""
    core = make_core([node("dc-gpu-1", devices=2), node("dc-gpu-2", devices=2)])
    assert (await core.offer(offer("job-1", devices=1))).accepted
    before = allocated(core)
    answer = await core.offer(offer("job-2", replicas=2, devices=2))
    assert not answer.accepted
    assert answer.reason == (
        "only 1 of 2 replicas fit; needs 2 GPU per replica; best node dc-gpu-1 has 1 free"
    )
    assert allocated(core) == before
    assert core.queue().pending_tasks == 1


async def test_reservation_lapses_after_lease(
    make_core: Callable[..., EmbeddedCore], recorder: Recorder
) -> None:
    """Without a commit the reservation lapses after its lease and capacity comes back."""
    core = make_core([node("dc-gpu-1", devices=2)])
    o = offer(devices=2, lease_s=0.2)
    answer = await core.offer(o)
    assert answer.accepted
    recorder.changed.clear()
    await asyncio.wait_for(recorder.changed.wait(), 5)
    assert allocated(core) == {"dc-gpu-1": []}
    assert core.queue().pending_tasks == 0
    refused = await core.commit(commit_for(o, answer))
    assert not refused.started
    assert refused.reason == f"unknown reservation {answer.reservation_id!r} (lapsed or released)"


async def test_repeated_offer_and_stale_epoch(make_core: Callable[..., EmbeddedCore]) -> None:
    """A repeated offer gets the same reservation; an older epoch is declined."""
    core = make_core([node("dc-gpu-1", devices=4)])
    first = await core.offer(offer(epoch=2, devices=1))
    again = await core.offer(offer(epoch=2, devices=1))
    assert again.accepted
    assert again.reservation_id == first.reservation_id
    assert allocated(core) == {"dc-gpu-1": [0]}
    stale = await core.offer(offer(epoch=1, devices=1))
    assert not stale.accepted
    assert stale.reason == "stale epoch 1: this site holds epoch 2 of the task"


async def test_commit_checks_reservation(make_core: Callable[..., EmbeddedCore]) -> None:
    """A commit for another epoch or an unknown reservation is refused and starts nothing."""
    core = make_core([node("n")])
    o = offer(epoch=2)
    answer = await core.offer(o)
    wrong = commit_for(o, answer)
    wrong.epoch = 3
    refused = await core.commit(wrong)
    assert not refused.started
    assert refused.reason == (
        f"reservation {answer.reservation_id!r} is for job-1/train epoch 2, not job-1/train epoch 3"
    )
    unknown = await core.commit(site_link_service_pb2.Commit(reservation_id="nope"))
    assert not unknown.started
    assert unknown.reason == "unknown reservation 'nope' (lapsed or released)"
    assert core.queue() == resources_pb2.QueueState(pending_tasks=1)
    assert core.tasks() == []


async def test_child_sees_its_devices(
    make_core: Callable[..., EmbeddedCore], recorder: Recorder, tmp_path: Path
) -> None:
    """Each replica's environment names its own GPUs, job, epoch and the task's env."""
    core = make_core([node("dc-gpu-1", devices=4, group="nvl-0")])
    o = offer(replicas=2, devices=2, epoch=7, code=DUMP_ENV, env={"MODE": "fast"})
    await run(core, o)
    report = await recorder.final()
    assert report.state == SUCCEEDED, report.reason
    assert list(report.devices) == [f"dc-gpu-1:GPU:{i}" for i in range(4)]
    for replica, indices in enumerate(["0,1", "2,3"]):
        env = json.loads((tmp_path / f"work/job-1/train/7/{replica}/env.json").read_text())
        assert env["CUDA_VISIBLE_DEVICES"] == indices
        assert env["FEDERATION_DEVICES"] == ",".join(
            f"dc-gpu-1:GPU:{i}" for i in indices.split(",")
        )
        assert env["FEDERATION_REPLICA"] == str(replica)
        assert env["FEDERATION_REPLICAS"] == "2"
        assert env["FEDERATION_JOB_ID"] == "job-1"
        assert env["FEDERATION_TASK"] == "train"
        assert env["FEDERATION_EPOCH"] == "7"
        assert env["FEDERATION_SITE"] == "site-a"
        assert env["MODE"] == "fast"
        assert "HIP_VISIBLE_DEVICES" not in env


async def test_child_does_not_inherit_the_agents_secrets(
    make_core: Callable[..., EmbeddedCore],
    recorder: Recorder,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A task gets PATH from the agent's environment but not the agent's other variables."""
    monkeypatch.setenv("AGENT_SECRET", "hunter2")
    core = make_core([node("n1", devices=1)])
    await run(core, offer(devices=1, code=DUMP_ENV))
    assert (await recorder.final()).state == SUCCEEDED
    env = json.loads((tmp_path / "work/job-1/train/1/0/env.json").read_text())
    assert "AGENT_SECRET" not in env
    assert env["PATH"] == os.environ["PATH"]


async def test_child_sees_its_npus(
    make_core: Callable[..., EmbeddedCore], recorder: Recorder, tmp_path: Path
) -> None:
    """A Huawei NPU replica gets ASCEND_RT_VISIBLE_DEVICES, and the task env cannot widen it."""
    edge = node("edge-box-1", devices=2, kind=NPU, vendor="huawei", model="Ascend-310P")
    core = make_core([edge])
    assert (await core.offer(offer("job-0", devices=1, kind=NPU))).accepted
    env_override = {"ASCEND_RT_VISIBLE_DEVICES": "0,1"}
    await run(core, offer(devices=1, kind=NPU, code=DUMP_ENV, env=env_override))
    assert (await recorder.final()).state == SUCCEEDED
    env = json.loads((tmp_path / "work/job-1/train/1/0/env.json").read_text())
    assert env["ASCEND_RT_VISIBLE_DEVICES"] == "1"
    assert env["FEDERATION_DEVICES"] == "edge-box-1:NPU:1"


async def test_success_reports_running_then_succeeded(
    make_core: Callable[..., EmbeddedCore], recorder: Recorder
) -> None:
    """A task whose replicas exit 0 is RUNNING, then SUCCEEDED with replica 0's output."""
    core = make_core([node("n", cpu=4)])
    code = "import os; print('hello from', os.environ['FEDERATION_REPLICA'])"
    await run(core, offer(replicas=2, cpu=2, code=code))
    report = await recorder.final()
    assert recorder.states() == [RUNNING, SUCCEEDED]
    assert (report.exit_code, report.reason) == (0, "")
    assert report.output_tail.strip() == "hello from 0"
    (known,) = core.tasks()
    assert known == report
    core.forget("job-1", "train", 1)
    assert core.tasks() == []


async def test_failing_replica_fails_the_task(
    make_core: Callable[..., EmbeddedCore], recorder: Recorder
) -> None:
    """A replica exiting non-zero stops its siblings; the task fails with its code and output."""
    code = (
        "import os, sys, time\n"
        "if os.environ['FEDERATION_REPLICA'] == '1':\n"
        "    print('boom: disk full')\n"
        "    sys.exit(3)\n"
        "time.sleep(60)\n"
    )
    core = make_core([node("n")])
    started = time.monotonic()
    await run(core, offer(replicas=2, code=code))
    report = await recorder.final()
    assert time.monotonic() - started < 30
    assert report.state == FAILED
    assert report.exit_code == 3
    assert report.reason == "replica 1 exited with 3"
    assert "boom: disk full" in report.output_tail


async def test_output_tail_is_at_most_2000_chars(
    make_core: Callable[..., EmbeddedCore], recorder: Recorder
) -> None:
    """The reported output tail is the last 2000 characters."""
    core = make_core([node("n")])
    await run(core, offer(code="print('x' * 5000 + 'END', end='')"))
    report = await recorder.final()
    assert len(report.output_tail) == 2000
    assert report.output_tail.endswith("xEND")


async def test_timeout_fails_the_task(
    make_core: Callable[..., EmbeddedCore], recorder: Recorder
) -> None:
    """A task running past timeout_s is stopped and fails."""
    core = make_core([node("n")])
    await run(core, offer(code="import time; time.sleep(60)", timeout_s=0.3))
    report = await recorder.final()
    assert report.state == FAILED
    assert report.reason == "timed out after 0.3s"


async def test_cancel_sends_sigterm(
    make_core: Callable[..., EmbeddedCore], recorder: Recorder, beacon: Beacon
) -> None:
    """Cancel delivers SIGTERM to the replica and ends the task CANCELLED with the reason."""
    body = (
        "import signal, sys, time\n"
        "def on_term(*_):\n"
        "    send('term')\n"
        "    sys.exit(0)\n"
        "signal.signal(signal.SIGTERM, on_term)\n"
        "send('ready')\n"
        "time.sleep(60)\n"
    )
    core = make_core([node("n")])
    await run(core, offer(code=beacon.child(body)))
    await beacon.expect("ready")
    await asyncio.wait_for(core.cancel("job-1", "train", 0, "user asked"), 10)
    assert "term" in beacon.lines
    report = await recorder.final()
    assert (report.state, report.reason) == (CANCELLED, "user asked")
    assert core.queue().running_tasks == 0


async def test_a_task_that_ended_by_itself_before_the_stop_succeeded(
    make_core: Callable[..., EmbeddedCore], recorder: Recorder, beacon: Beacon
) -> None:
    """A stop (a preemption, say) that comes once every replica has exited 0 by itself, but
    before the core has seen it (a detached child still holds the output open), finds the
    work done: SUCCEEDED, so the coordinator does not run it again."""
    body = (
        "import os, subprocess, sys\n"
        "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(1.5)'],\n"
        "                 start_new_session=True)\n"
        "send(f'done {os.getpid()}')\n"
    )
    core = make_core([node("n")])
    await run(core, offer(code=beacon.child(body)))
    pid = int((await beacon.expect("done")).split()[1])
    for _ in range(1000):  # until the leader has exited (a zombie until the core reaps it)
        if not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
            break
        await asyncio.sleep(0.01)
    await asyncio.wait_for(core.cancel("job-1", "train", 0, "preempted"), 10)
    report = await recorder.final()
    assert (report.state, report.exit_code) == (SUCCEEDED, 0)


async def test_cancel_kills_a_child_ignoring_sigterm(
    make_core: Callable[..., EmbeddedCore], recorder: Recorder, beacon: Beacon
) -> None:
    """A replica that ignores SIGTERM is SIGKILLed after kill_grace_s."""
    body = (
        "import os, signal, time\n"
        "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
        "send(f'ready {os.getpid()}')\n"
        "time.sleep(60)\n"
    )
    core = make_core([node("n")], kill_grace_s=0.3)
    await run(core, offer(code=beacon.child(body)))
    pid = int((await beacon.expect("ready")).split()[1])
    started = time.monotonic()
    await asyncio.wait_for(core.cancel("job-1", "train", 1, "preempted"), 10)
    assert time.monotonic() - started >= 0.3
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    assert (await recorder.final()).state == CANCELLED


async def test_cancel_of_unknown_or_other_epoch_is_a_noop(
    make_core: Callable[..., EmbeddedCore], recorder: Recorder
) -> None:
    """Cancelling an unknown task or another epoch leaves the running task alone."""
    core = make_core([node("n")])
    await run(core, offer(epoch=2, code="import time; time.sleep(60)"))
    await core.cancel("job-1", "train", 3, "wrong epoch")
    await core.cancel("job-9", "train", 0, "unknown job")
    assert [r.state for r in core.tasks()] == [RUNNING]
    await asyncio.wait_for(core.cancel("job-1", "train", 2, "right epoch"), 10)
    assert (await recorder.final()).reason == "right epoch"


async def test_cancel_drops_an_uncommitted_reservation(
    make_core: Callable[..., EmbeddedCore],
) -> None:
    """Cancelling a task that is only reserved frees the reservation."""
    core = make_core([node("dc-gpu-1", devices=1)])
    assert (await core.offer(offer(devices=1))).accepted
    await core.cancel("job-1", "train", 0, "job cancelled")
    assert allocated(core) == {"dc-gpu-1": []}
    assert core.queue().pending_tasks == 0


async def test_capacity_returned_after_task_ends(
    make_core: Callable[..., EmbeddedCore], recorder: Recorder
) -> None:
    """A running task holds its capacity until it ends; then it is free again."""
    core = make_core([node("dc-gpu-1", devices=2, cpu=8)])
    await run(core, offer(devices=2, cpu=8, code="pass"))
    await recorder.final()
    (view,) = core.nodes()
    assert view.cpu_free == 8
    assert not any(d.allocated for d in view.devices)
    assert core.queue() == resources_pb2.QueueState()
    assert (await core.offer(offer("job-2", devices=2, cpu=8))).accepted


async def test_running_task_holds_capacity(
    make_core: Callable[..., EmbeddedCore], beacon: Beacon
) -> None:
    """While a task runs its devices stay allocated and a second one is declined."""
    core = make_core([node("dc-gpu-1", devices=2)])
    await run(
        core, offer(devices=2, code=beacon.child("import time\nsend('ready')\ntime.sleep(60)"))
    )
    await beacon.expect("ready")
    assert allocated(core) == {"dc-gpu-1": [0, 1]}
    assert core.queue() == resources_pb2.QueueState(running_tasks=1)
    assert not (await core.offer(offer("job-2", devices=1))).accepted


async def test_missing_program_fails_the_task(
    make_core: Callable[..., EmbeddedCore], recorder: Recorder
) -> None:
    """A command that does not exist is a FAILED task with the reason, not an exception."""
    core = make_core([node("dc-gpu-1", devices=1)])
    await run(core, offer(devices=1, command=["definitely-not-a-program-xyz", "--help"]))
    report = await recorder.final()
    assert report.state == FAILED
    assert report.reason == "command not found: definitely-not-a-program-xyz"
    assert report.exit_code == 127
    assert allocated(core) == {"dc-gpu-1": []}


async def test_unusable_work_dir_fails_the_task(
    make_core: Callable[..., EmbeddedCore], recorder: Recorder, tmp_path: Path
) -> None:
    """A working directory that cannot be created fails the task instead of the commit."""
    (tmp_path / "work").write_text("a file where the work directory should be")
    core = make_core([node("n")])
    await run(core, offer())
    report = await recorder.final()
    assert report.state == FAILED
    assert report.reason.startswith("cannot create working directory:")
    assert core.queue() == resources_pb2.QueueState()


async def test_close_keeps_tasks_and_shutdown_stops_them(
    make_core: Callable[..., EmbeddedCore], recorder: Recorder, beacon: Beacon
) -> None:
    """close() leaves running tasks alone; shutdown() cancels them."""
    core = make_core([node("n", cpu=4)])
    await run(core, offer(code=beacon.child("import time\nsend('ready')\ntime.sleep(60)")))
    assert (await core.offer(offer("job-2"))).accepted
    await beacon.expect("ready")
    await core.close()
    assert core.queue() == resources_pb2.QueueState(running_tasks=1)
    await asyncio.wait_for(core.shutdown(grace_s=0.5), 10)
    report = await recorder.final()
    assert (report.state, report.reason) == (CANCELLED, "agent shutting down")


async def test_unsafe_names_are_declined(make_core: Callable[..., EmbeddedCore]) -> None:
    """Job ids and task names that would escape the work directory are declined."""
    core = make_core([node("n")])
    assert not (await core.offer(offer("../etc"))).accepted
    assert not (await core.offer(offer(task=".."))).accepted
