"""Tenants' tasks at one site run as different accounts and cannot reach each other.

These tests need root: they create two accounts on this machine and run real tasks as them.
"""

from __future__ import annotations

import asyncio
import os
import pwd
import stat
import subprocess
import tempfile
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import grpc
import pytest

from federation.agent.accounts import TaskAccounts, task_accounts
from federation.agent.embedded_core import EmbeddedCore
from federation.agent.process import ReplicaProcess
from federation.api.v1 import jobs_pb2
from federation.config import ConfigError

from .cores import CANCELLED, RUNNING, SUCCEEDED, Recorder, node, offer, run

pytestmark = [
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root: it creates accounts, runs as them"),
    pytest.mark.xdist_group("accounts"),  # useradd locks /etc/passwd
]

# Named per run, so that runs side by side on one machine do not remove each other's.
ACCOUNTS = (f"fedtest-{os.getpid()}-a", f"fedtest-{os.getpid()}-b")
A, B = ACCOUNTS


@pytest.fixture(scope="module")
def accounts() -> Iterator[dict[str, pwd.struct_passwd]]:
    """Two accounts made for this test, removed after it."""
    for name in ACCOUNTS:
        subprocess.run(
            ["useradd", "--system", "--no-create-home", "--shell", "/bin/sh", name], check=True
        )
    try:
        yield {name: pwd.getpwnam(name) for name in ACCOUNTS}
    finally:
        for name in ACCOUNTS:
            subprocess.run(["userdel", name], check=False)


@pytest.fixture
def site_dirs() -> Iterator[tuple[Path, Path]]:
    """A state folder private to the agent, holding a key, and a work folder beside it."""
    root = Path(tempfile.mkdtemp())
    root.chmod(0o755)  # like /var/lib: every account may pass through
    state = root / "state"
    state.mkdir(mode=0o700)
    (state / "site-key.pem").write_text("PRIVATE KEY")
    yield state, root / "work"
    subprocess.run(["rm", "-rf", str(root)], check=False)


@pytest.fixture
async def core(
    accounts: dict[str, pwd.struct_passwd], site_dirs: tuple[Path, Path], recorder: Recorder
) -> AsyncIterator[EmbeddedCore]:
    """An embedded core that runs tenant-a's tasks as account A and tenant-b's as B."""
    state, work = site_dirs
    chosen = task_accounts(
        accounts={"tenant-a": A, "tenant-b": B},
        uid_range="",
        shared_user="",
        as_agent=False,
        state_dir=state,
        work_dir=work,
    )
    built = EmbeddedCore(
        [node("n", cpu=8)],
        site="site-a",
        work_dir=work,
        on_status=recorder.on_status,
        on_change=recorder.on_change,
        kill_grace_s=0.5,
        accounts=chosen,
    )
    yield built
    await built.shutdown(grace_s=0.5)


def tenant_offer(job_id: str, tenant: str, script: str, env: dict[str, str] | None = None):  # type: ignore[no-untyped-def]
    o = offer(job_id, command=["/bin/sh", "-c", script], env=env)
    o.tenant = tenant
    return o


# Tenant A's attack: every way to reach tenant B that a shared account allowed.
ATTACK = r"""
b_file="$1/job-b/train/1/0/secret.txt"
cat "$b_file" 2>/dev/null && echo "READ-FILE"
for environ in /proc/[0-9]*/environ; do
  grep -q "B-SECRET" "$environ" 2>/dev/null && echo "READ-ENV $environ"
done
for pid in $(ps -o pid= -u "$3"); do
  kill -TERM "$pid" 2>/dev/null && echo "KILLED $pid"
done
ls "$1" 2>/dev/null && echo "LISTED-WORK"
cat "$2/site-key.pem" 2>/dev/null && echo "READ-KEY"
echo "uid $(id -u) groups $(id -G) umask $(umask)"
"""


async def test_one_tenant_cannot_read_or_signal_anothers_task(
    core: EmbeddedCore,
    recorder: Recorder,
    accounts: dict[str, pwd.struct_passwd],
    site_dirs: tuple[Path, Path],
) -> None:
    """A's task cannot read B's file, B's environment or the site key, nor kill B's task."""
    state, work = site_dirs
    victim = "echo private > secret.txt; echo started; exec sleep 30"
    await run(core, tenant_offer("job-b", "tenant-b", victim, env={"TOKEN": "B-SECRET"}))
    secret = work / "job-b" / "train" / "1" / "0" / "secret.txt"
    deadline = time.monotonic() + 10
    while not (secret.exists() and secret.read_text() == "private\n"):  # B's file is written
        assert time.monotonic() < deadline, "tenant B's task never wrote its file"
        await asyncio.sleep(0.05)
    assert any(r.job_id == "job-b" and r.state == RUNNING for r in recorder.reports)
    attack = tenant_offer("job-a", "tenant-a", ATTACK)
    attack.spec.command.extend(["attack", str(work), str(state), B])
    await run(core, attack)
    report = await recorder.final("job-a")
    assert report.state == SUCCEEDED, report.reason
    out = report.output_tail
    a = accounts[A]
    assert f"uid {a.pw_uid} groups {a.pw_gid} umask 0077" in out
    for breach in ("READ-FILE", "READ-ENV", "KILLED", "LISTED-WORK", "READ-KEY", "PRIVATE"):
        assert breach not in out, out
    b_states = recorder.states("job-b")
    assert b_states[-1] == RUNNING  # B's task ran on, untouched
    replica = work / "job-b" / "train" / "1" / "0"
    info = replica.stat()
    assert (info.st_uid, stat.S_IMODE(info.st_mode)) == (accounts[B].pw_uid, 0o700)
    assert stat.S_IMODE((replica / "secret.txt").stat().st_mode) == 0o600  # umask 077
    await core.cancel("job-b", "train", 0, "test over")
    assert (await recorder.final("job-b")).state == CANCELLED


async def test_an_ended_task_folder_is_locked(
    core: EmbeddedCore, recorder: Recorder, site_dirs: tuple[Path, Path]
) -> None:
    """A task that opened its own folder to everyone while it ran leaves nothing readable
    once it has ended: only the agent may enter the ended task's folder."""
    _, work = site_dirs
    opened = "echo left > open.txt; chmod 644 open.txt; chmod 755 ."
    await run(core, tenant_offer("job-b", "tenant-b", opened))
    assert (await recorder.final("job-b")).state == SUCCEEDED
    epoch_dir = work / "job-b" / "train" / "1"
    assert stat.S_IMODE(epoch_dir.stat().st_mode) == 0o700
    read = f"cat {epoch_dir}/0/open.txt && echo READ-AFTER-END; true"
    await run(core, tenant_offer("job-a", "tenant-a", read))
    report = await recorder.final("job-a")
    assert report.state == SUCCEEDED, report.reason
    assert "READ-AFTER-END" not in report.output_tail


async def test_a_restart_reaches_its_checkpoint_in_a_locked_folder(
    core: EmbeddedCore, recorder: Recorder, site_dirs: tuple[Path, Path]
) -> None:
    """Epoch 1 saves a checkpoint and ends (its folder locked); epoch 2, restarting from it
    as the same account, reads it."""
    _, work = site_dirs
    save = 'echo step-3 > "$FEDERATION_CHECKPOINT_DIR/step-3"'
    first = tenant_offer("job-b", "tenant-b", save)
    first.spec.checkpoint.CopyFrom(jobs_pb2.Checkpoint())
    await run(core, first)
    assert (await recorder.final("job-b")).state == SUCCEEDED
    saved = work / "job-b" / "train" / "1" / "checkpoints" / "step-3"
    restart = tenant_offer("job-b", "tenant-b", 'cat "$FEDERATION_RESTORE_FROM"')
    restart.epoch = 2
    restart.spec.checkpoint.CopyFrom(jobs_pb2.Checkpoint())
    restart.restore.CopyFrom(jobs_pb2.CheckpointRecord(path=str(saved), bytes=7, site="site-a"))
    recorder.reports.clear()
    await run(core, restart)
    report = await recorder.final("job-b")
    assert report.state == SUCCEEDED, report.reason
    assert report.output_tail.strip() == "step-3"


async def test_a_planted_link_is_not_followed(
    core: EmbeddedCore, recorder: Recorder, site_dirs: tuple[Path, Path]
) -> None:
    """A task cannot make the agent hand it another folder: the folders above its own are the
    agent's, so a link planted there is refused."""
    _, work = site_dirs
    plant = "ln -s /etc ../2 && echo planted; ls -ld .. | cut -c1-10"
    await run(core, tenant_offer("job-a", "tenant-a", plant))
    report = await recorder.final("job-a")
    assert "planted" not in report.output_tail
    assert "drwx--x--x" in report.output_tail
    assert not (work / "job-a" / "train" / "2").exists()


def test_uids_are_allocated_per_tenant_and_kept(tmp_path: Path) -> None:
    """From a uid range, each tenant gets its own uid, the same one after a restart, never
    one an account on this machine already has."""
    taken = pwd.getpwall()
    low = 1000  # where the first accounts of a machine usually are
    state, work = tmp_path / "state", tmp_path / "work"
    state.mkdir()
    first = task_accounts(
        accounts={},
        uid_range=f"{low}-{low + 1000}",
        shared_user="",
        as_agent=False,
        state_dir=state,
        work_dir=work,
    )
    a, b = first.for_tenant("tenant-a"), first.for_tenant("tenant-b")
    assert a is not None
    assert b is not None
    assert a.uid != b.uid
    assert not {a.uid, b.uid} & {e.pw_uid for e in taken}
    again = TaskAccounts(
        accounts={}, uid_range=(low, low + 1000), shared_user="", as_agent=False, state_dir=state
    )
    assert again.for_tenant("tenant-b") == b
    assert stat.S_IMODE((state / "task_uids.json").stat().st_mode) == 0o600


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({}, "tasks need an account"),
        ({"shared_user": "root"}, "is root"),
        ({"shared_user": "no-such-account-x"}, "no such account"),
        ({"uid_range": "10-20"}, "must lie within"),
        ({"uid_range": "a-b"}, "is not a range"),
        ({"uid_range": "200000-200010", "in_state": True}, "lies in state_dir"),
    ],
)
def test_account_settings_are_checked(
    tmp_path: Path, settings: dict[str, object], message: str
) -> None:
    """Settings that would run tasks as root, as nobody, or out of reach are refused."""
    in_state = settings.pop("in_state", False)
    state = tmp_path / "state"
    values: dict[str, object] = {"accounts": {}, "uid_range": "", "shared_user": ""}
    values.update(settings)
    with pytest.raises(ConfigError, match=message):
        task_accounts(
            **values,  # type: ignore[arg-type]
            as_agent=False,
            state_dir=state,
            work_dir=state / "work" if in_state else tmp_path / "work",
        )


async def test_two_hundred_launches_as_another_account_all_start(
    accounts: dict[str, pwd.struct_passwd], site_dirs: tuple[Path, Path], tmp_path: Path
) -> None:
    """With gRPC's threads running in the agent, 200 launches as another account all start
    and exit 0 (forking the agent to switch user aborted about half of them)."""
    server = grpc.aio.server()
    server.add_insecure_port("127.0.0.1:0")
    await server.start()
    channel = grpc.aio.insecure_channel("127.0.0.1:1")  # a client's threads too
    shared = TaskAccounts(
        accounts={}, uid_range=None, shared_user=A, as_agent=False, state_dir=tmp_path
    ).for_tenant("anyone")
    cwd = site_dirs[0].parent  # a folder every account may enter
    try:
        codes: list[int] = []
        for round_ in range(10):
            batch = [
                ReplicaProcess.start(
                    ["/bin/sh", "-c", "test $(id -u) = $1", "sh", str(uid)],
                    cwd=cwd,
                    env={"PATH": "/usr/bin:/bin"},
                    run_dir=tmp_path / f"run-{round_}-{i}",
                    account=shared,
                )
                for i, uid in enumerate([accounts[A].pw_uid] * 20)
            ]
            started = await asyncio.gather(*batch)
            codes += await asyncio.gather(*(p.wait() for p in started))
        assert codes == [0] * 200
    finally:
        await channel.close()
        await server.stop(None)
