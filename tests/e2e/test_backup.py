"""Backup and restore of the embedded store over a real federation: a copy taken while the
coordinator serves, put back into its stopped coordinator's data folder, resumes every job."""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Iterator
from pathlib import Path

import pytest

from federation.api.v1 import job_service_pb2, jobs_pb2
from federation.coordinator.config import STORE_FILE
from federation.local import LocalFederation

from .conftest import gpu_site, jobs, python_task, running, spec, until, wait_for_job
from .test_cli import fedctl

pytestmark = pytest.mark.xdist_group("e2e-backup")

RUNNING = jobs_pb2.JOB_STATE_RUNNING


@pytest.fixture
def federation(tmp_path: Path) -> Iterator[LocalFederation]:
    with running(tmp_path / "fed", [gpu_site("dc-backup", 2)]) as fed:
        yield fed


def waits_for(go: Path, pid_file: Path) -> str:
    """Code that writes its pid, then runs until ``go`` exists."""
    return (
        "import os, pathlib, time\n"
        f"pathlib.Path({str(pid_file)!r}).write_text(str(os.getpid()))\n"
        f"while not os.path.exists({str(go)!r}): time.sleep(0.05)\n"
    )


async def test_a_restored_store_resumes_every_job(federation: LocalFederation, tmp_path: Path):
    """A job's first task runs and its second waits for it when the backup is taken; the
    store is then lost. Restored from the backup, the coordinator finds the job, its running
    task still running (the same process), and the job runs to its end."""
    go, pid_file = tmp_path / "go", tmp_path / "pid"
    pipeline = spec(
        "pipeline",
        [
            python_task("first", waits_for(go, pid_file)),
            python_task("second", "print('after first')", depends_on=["first"]),
        ],
    )
    async with federation.operator().channel() as channel:
        reply = await jobs(channel).SubmitJob(job_service_pb2.SubmitJobRequest(spec=pipeline))
        job_id = reply.job.id

        async def first_runs() -> bool:
            job = (await jobs(channel).GetJob(job_service_pb2.GetJobRequest(job_id=job_id))).job
            return job.tasks[0].state == RUNNING and pid_file.exists()

        await until(first_runs, "the first task running")
    pid = pid_file.read_text()
    backup = tmp_path / "store.backup"
    made = fedctl(federation, "-o", "json", "store", "backup", str(backup))
    assert made.returncode == 0, made.stderr
    summary = json.loads(made.stdout)
    assert summary["jobs"] == 1
    assert summary["revision"] > 0
    assert backup.stat().st_mode & 0o777 == 0o600
    again = fedctl(federation, "store", "backup", str(backup))
    assert again.returncode != 0
    assert "exists: a backup goes to a new file" in again.stderr

    data_dir = federation.root / "coordinator"
    store = data_dir / STORE_FILE
    busy = fedctl(federation, "store", "restore", str(backup), "--data-dir", str(data_dir))
    assert busy.returncode != 0
    assert "a coordinator is running on it" in busy.stderr  # nothing replaced under it

    assert federation.terminate("coordinator")
    for leftover in data_dir.iterdir():  # the store is lost
        leftover.unlink()
    blank = sqlite3.connect(store)  # a fresh, empty store in its place
    blank.execute("CREATE TABLE unrelated (x)")
    blank.close()
    refused = fedctl(federation, "store", "restore", str(backup), "--data-dir", str(data_dir))
    assert refused.returncode != 0
    assert "holds something else" in refused.stderr
    assert "To fix: --force replaces it" in refused.stderr
    restored = fedctl(
        federation, "store", "restore", str(backup), "--data-dir", str(data_dir), "--force"
    )
    assert restored.returncode == 0, restored.stderr
    assert f"restored {store}: revision {summary['revision']}, 1 job(s)" in restored.stdout

    await federation.start_coordinator(port=federation.port, join_port=federation.join_port)
    await federation.wait_connected()
    async with federation.operator().channel() as channel:
        job = (await jobs(channel).GetJob(job_service_pb2.GetJobRequest(job_id=job_id))).job
        assert job.tasks[0].state == RUNNING
        assert job.tasks[1].state == jobs_pb2.JOB_STATE_PENDING
        go.touch()
        done = await wait_for_job(channel, job_id)
    assert done.state == jobs_pb2.JOB_STATE_SUCCEEDED
    assert pid_file.read_text() == pid  # the same process ran on: never started again


@pytest.mark.parametrize(
    ("content", "words"),
    [(b"", "not a federation store"), (b"not sqlite at all" * 100, "not a federation store")],
    ids=["empty", "garbage"],
)
def test_a_file_that_is_no_backup_is_refused_and_nothing_changes(
    tmp_path: Path, content: bytes, words: str
) -> None:
    bad = tmp_path / "bad.backup"
    bad.write_bytes(content)
    data_dir = tmp_path / "data"
    env_free = LocalFederation(tmp_path / "unused", [])
    result = fedctl(env_free, "store", "restore", str(bad), "--data-dir", str(data_dir))
    assert result.returncode != 0
    assert words in result.stderr
    assert "Traceback" not in result.stderr
    assert not data_dir.exists()
