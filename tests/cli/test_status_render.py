"""``fedctl status`` and ``jobs get``: how long a site is unreachable, checkpoints and moves."""

from __future__ import annotations

import re

import pytest
from google.protobuf import timestamp_pb2
from rich.console import Console
from rich.table import Table

from federation.api.v1 import admin_service_pb2, job_service_pb2, jobs_pb2
from federation.cli.render import (
    checkpoint_line,
    event_line,
    format_duration,
    job_details,
    sites_table,
)


def text(table: Table) -> list[str]:
    console = Console(width=200, record=True)
    console.print(table)
    return console.export_text().splitlines()


@pytest.mark.parametrize(
    ("seconds", "shown"),
    [(0.4, "0s"), (42.9, "42s"), (63, "1m 03s"), (3600 * 2 + 600, "2h 10m"), (-1, "0s")],
)
def test_durations_read_at_a_glance(seconds: float, shown: str) -> None:
    """Seconds under a minute, minutes and seconds, then hours and minutes."""
    assert format_duration(seconds) == shown


def test_the_sites_table_shows_how_long_a_site_is_unreachable() -> None:
    """An UNREACHABLE site shows its duration; connected and disconnected ones show '-'."""
    sites = [
        admin_service_pb2.Site(
            name="edge-p",
            state=admin_service_pb2.SITE_STATE_UNREACHABLE,
            unreachable_s=63.2,
            heartbeat_age_s=64.0,
        ),
        admin_service_pb2.Site(
            name="edge-q", state=admin_service_pb2.SITE_STATE_CONNECTED, heartbeat_age_s=0.4
        ),
        admin_service_pb2.Site(
            name="gone", state=admin_service_pb2.SITE_STATE_DISCONNECTED, heartbeat_age_s=-1
        ),
    ]
    lines = text(sites_table(sites))
    header = next(line for line in lines if "unreachable for" in line)
    column = header.index("unreachable for")
    rows = {line.split("│")[1].strip(): line for line in lines if "edge-" in line or "gone" in line}
    assert "UNREACHABLE" in rows["edge-p"]
    assert rows["edge-p"][column:].split("│")[0].strip() == "1m 03s"
    assert rows["edge-q"][column:].split("│")[0].strip() == "-"
    assert rows["gone"][column:].split("│")[0].strip() == "-"


def test_a_move_reads_as_one() -> None:
    """An event that moved a task names the site it left; others name where it is."""
    time = timestamp_pb2.Timestamp(seconds=1_700_000_000)
    moved = jobs_pb2.JobEvent(
        job_id="j",
        task="t",
        time=time,
        site="edge-p",
        moved_from="edge-p",
        state=jobs_pb2.JOB_STATE_PENDING,
        reason="site edge-p unreachable for 63s; placing again from checkpoint /ck/s-7",
        job_state=jobs_pb2.JOB_STATE_PENDING,
    )
    assert " -> PENDING moved from edge-p: site edge-p unreachable for 63s" in event_line(moved)
    moved.moved_from = ""
    assert " -> PENDING at edge-p: " in event_line(moved)


def test_a_checkpoint_line_says_where_what_and_whose() -> None:
    """Path, size, site, epoch and the work it holds."""
    line = checkpoint_line(
        jobs_pb2.CheckpointRecord(
            path="/ck/s-7",
            bytes=4096,
            site="edge-p",
            epoch=1,
            progress_s=12.4,
            time=timestamp_pb2.Timestamp(seconds=1_700_000_000),
        )
    )
    assert line.startswith("/ck/s-7 (4096 bytes) at edge-p epoch 1, ")
    assert line.endswith(", 12s of work")


def test_the_sites_table_shows_when_room_frees() -> None:
    """Tasks there (and those waiting for it) and when the first should end; with ``wide``,
    the arrivals per hour and the mean run time from history."""
    busy = admin_service_pb2.Site(name="dc-fast", heartbeat_age_s=0.1)
    busy.forecast.tasks = 3
    busy.forecast.waiting = 2
    busy.forecast.next_free_s = 75.0
    busy.forecast.arrivals_per_hour = 12.25
    busy.forecast.mean_run_s = 3900.0
    idle = admin_service_pb2.Site(name="dc-idle", heartbeat_age_s=0.1)
    idle.forecast.next_free_s = -1.0

    def cells(lines: list[str], name: str) -> list[str]:
        (row,) = [line for line in lines if name in line]
        return [cell.strip() for cell in re.split("[│┃]", row)[1:-1]]

    lines = text(sites_table([busy, idle]))
    header = cells(lines, "next free")
    assert cells(lines, "dc-fast")[header.index("tasks")] == "3 (+2 waiting)"
    assert cells(lines, "dc-fast")[header.index("next free")] == "1m 15s"
    assert cells(lines, "dc-idle")[header.index("next free")] == "-"
    wide = Console(width=400, record=True)
    wide.print(sites_table([busy], wide=True))
    lines = wide.export_text().splitlines()
    header = cells(lines, "mean run")
    assert cells(lines, "dc-fast")[header.index("arrivals/h")] == "12.2"
    assert cells(lines, "dc-fast")[header.index("mean run")] == "1h 05m"


def test_a_task_shows_its_failed_attempts_and_when_the_next_may_start() -> None:
    job = jobs_pb2.Job(id="j")
    job.spec.tasks.add(name="t").retry.max_attempts = 3
    job.tasks.add(
        name="t",
        state=jobs_pb2.JOB_STATE_PENDING,
        failed_attempts=1,
        retry_at=timestamp_pb2.Timestamp(seconds=1_700_000_000),
    )
    out = Console(width=200, record=True)
    for renderable in job_details(job_service_pb2.GetJobResponse(job=job)):
        out.print(renderable)
    assert "failed attempts: 1 of 3, next not before 2023-11-14 22:13:20" in out.export_text()
