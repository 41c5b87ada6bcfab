"""The agent journal keeps unacknowledged final statuses across restarts."""

from __future__ import annotations

import asyncio
import sqlite3
from pathlib import Path

from structlog.testing import capture_logs

from federation.agent.config import AgentConfig
from federation.agent.embedded_core import EmbeddedCore
from federation.agent.enroll import credential_paths
from federation.agent.journal import Journal, merge
from federation.agent.runtime import AgentRuntime
from federation.api.v1 import jobs_pb2, resources_pb2
from federation.api.v1 import site_link_service_pb2 as pb

DONE = jobs_pb2.JOB_STATE_SUCCEEDED
RUNNING = jobs_pb2.JOB_STATE_RUNNING


def report(job: str, state: int = DONE, epoch: int = 1) -> pb.TaskReport:
    return pb.TaskReport(job_id=job, task="t", epoch=epoch, state=state, exit_code=0)  # type: ignore[arg-type]


def runtime_with(tmp_path: Path, journal: Journal) -> AgentRuntime:
    """An agent runtime over an idle embedded core, journaling into ``journal``."""
    config = AgentConfig(
        site="edge-1",
        domain="edge",
        coordinator="127.0.0.1:1",
        ca=tmp_path / "ca.pem",
        state_dir=tmp_path,
    )
    core = EmbeddedCore(
        [resources_pb2.Node(name="n1", cpu_cores=4, memory_mib=1024, schedulable=True)],
        site="edge-1",
        work_dir=tmp_path / "work",
        on_status=lambda r: None,
        on_change=lambda: None,
    )
    return AgentRuntime(config, credential_paths(tmp_path), core, journal=journal)


def test_only_final_reports_are_kept_until_acknowledged(tmp_path: Path) -> None:
    """Final reports survive a reopen; running ones are not kept; an ack drops a report."""
    journal = Journal(tmp_path / "j.db")
    journal.record(report("a"))
    journal.record(report("b", RUNNING))
    journal.record(report("c"))
    journal.forget("c", "t", 1)
    journal.close()
    reopened = Journal(tmp_path / "j.db")
    assert [r.job_id for r in reopened.pending()] == ["a"]


def test_corrupted_entry_is_dropped_and_logged(tmp_path: Path) -> None:
    """An entry that does not parse, or does not match its key, is logged and removed."""
    journal = Journal(tmp_path / "j.db")
    journal.record(report("good"))
    conn = sqlite3.connect(tmp_path / "j.db")
    conn.execute("INSERT INTO reports VALUES ('bad', 't', 1, x'ffffff')")
    conn.execute(
        "INSERT INTO reports VALUES ('other', 't', 1, ?)",
        (report("not-other").SerializeToString(),),
    )
    conn.commit()
    conn.close()
    with capture_logs() as logs:
        assert [r.job_id for r in journal.pending()] == ["good"]
    assert {e["job"] for e in logs if e["event"] == "journal_entry_dropped"} == {"bad", "other"}
    assert [r.job_id for r in journal.pending()] == ["good"]


def test_merge_prefers_what_the_core_knows() -> None:
    """A task the core still holds is reported once, as the core has it."""
    live = [report("a", RUNNING)]
    merged = merge(live, [report("a"), report("b")])
    assert [(r.job_id, r.state) for r in merged] == [("a", RUNNING), ("b", DONE)]


def test_restarted_agent_says_hello_with_journaled_results(tmp_path: Path) -> None:
    """After a restart, the hello carries a result that finished while unacknowledged."""
    journal = Journal(tmp_path / "journal.db")
    journal.record(report("finished-in-partition"))
    runtime = runtime_with(tmp_path, journal)
    assert [r.job_id for r in runtime.hello_tasks()] == ["finished-in-partition"]


def test_acknowledgement_clears_the_journal(tmp_path: Path) -> None:
    """A status the agent sent is journaled first and dropped once the coordinator acks it."""
    journal = Journal(tmp_path / "journal.db")
    runtime = runtime_with(tmp_path, journal)
    runtime.on_status(report("j1"))
    assert [r.job_id for r in journal.pending()] == ["j1"]
    ack = pb.CoordinatorMessage(ack=pb.TaskStatusAck(job_id="j1", task="t", epoch=1))
    runtime._dispatch(ack, asyncio.Queue())
    assert journal.pending() == []
