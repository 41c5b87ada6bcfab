"""``fedctl top``'s tables and JSON: booked beside measured, tenant strings as text, whole."""

from __future__ import annotations

import asyncio
import io
import json

from google.protobuf import timestamp_pb2
from rich.console import Console

from federation.api.v1 import admin_service_pb2, jobs_pb2, resources_pb2
from federation.cli.render import print_whole
from federation.cli.top import (
    Snapshot,
    devices_table,
    frame,
    jobs_table,
    sites_table,
    snapshot_record,
    until_stopped,
)
from federation.resources import booked_share

NOW = 1_700_000_100.0
ESCAPES = "evil\x1b]0;pwned\x07\x1b[2J[bold]x[/bold]"


def gpu(index: int, **fields: object) -> resources_pb2.Device:
    defaults: dict[str, object] = {
        "id": f"gpu{index}",
        "index": index,
        "kind": resources_pb2.DEVICE_KIND_GPU,
        "model": "H100-80GB",
        "memory_total_mib": 81920,
        "memory_free_mib": 81920,
        "health": resources_pb2.DEVICE_HEALTH_HEALTHY,
        "free_fraction": 1.0,
    }
    return resources_pb2.Device(**{**defaults, **fields})  # type: ignore[arg-type]


def snapshot() -> Snapshot:
    measured = gpu(
        0,
        allocated=True,
        memory_free_mib=0,
        power_watts=412.4,
        power_tdp_watts=700,
        temperature_c=71.2,
        measured=resources_pb2.MeasuredUse(
            measured_at=NOW - 3, compute=0.87, memory_used_mib=40960
        ),
    )
    shared = gpu(1, shareable=True, free_fraction=0.25)
    sick = gpu(
        2, health=resources_pb2.DEVICE_HEALTH_UNHEALTHY, health_reason="XID 79: fell off the bus"
    )
    node = resources_pb2.Node(
        name="node-1",
        devices=[measured, shared, sick],
        measured=resources_pb2.MeasuredUse(measured_at=NOW - 3, compute=0.5),
    )
    site = admin_service_pb2.Site(
        name="dc-x",
        domain=resources_pb2.DOMAIN_DATACENTER,
        state=admin_service_pb2.SITE_STATE_CONNECTED,
        heartbeat_age_s=0.4,
        view=resources_pb2.SiteView(nodes=[node]),
    )
    job = jobs_pb2.Job(
        id="j-1",
        spec=jobs_pb2.JobSpec(name=ESCAPES, tenant="team-a"),
        state=jobs_pb2.JOB_STATE_RUNNING,
        tasks=[
            jobs_pb2.TaskStatus(
                name="train",
                state=jobs_pb2.JOB_STATE_RUNNING,
                site="dc-x",
                nodes=["node-1"],
                devices=["node-1:GPU:0"],
                started_at=timestamp_pb2.Timestamp(seconds=int(NOW - 125)),
            ),
            jobs_pb2.TaskStatus(name="done", state=jobs_pb2.JOB_STATE_SUCCEEDED, site="dc-x"),
        ],
    )
    return Snapshot(sites=[site], jobs=[job], more_jobs=False, taken_at=NOW)


def lines(*renderables: object, width: int = 200) -> list[str]:
    console = Console(width=width, record=True, file=io.StringIO())
    for renderable in renderables:
        console.print(renderable)
    return console.export_text().splitlines()


def row(table_lines: list[str], needle: str) -> list[str]:
    line = next(line for line in table_lines if needle in line)
    return [cell.strip() for cell in line.split("│")[1:-1]]


def test_booked_share_counts_whole_devices_shares_and_slots() -> None:
    assert booked_share(gpu(0, allocated=True)) == 1.0
    assert booked_share(gpu(0, shareable=True, free_fraction=0.25)) == 0.75
    assert booked_share(gpu(0)) == 0.0
    mig = gpu(0, partitions=[resources_pb2.PartitionProfile(profile="1g.10gb", total=7, free=5)])
    assert booked_share(mig) == 2 / 7


def test_a_share_of_a_device_that_also_has_slots_is_that_share() -> None:
    """A 0.25 share closes the device's MIG slots (one mode at a time): 25 % booked, not 100."""
    closed = [resources_pb2.PartitionProfile(profile="1g.10gb", total=7, free=0)]
    device = gpu(0, shareable=True, free_fraction=0.75, partitions=closed)
    assert booked_share(device) == 0.25


def test_devices_show_booked_beside_measured() -> None:
    """A measured device shows its use, memory, power and temperature; a declared one dashes."""
    shown = lines(devices_table(snapshot()))
    assert row(shown, "gpu0") == [
        "dc-x",
        "node-1",
        "gpu0",
        "GPU H100-80GB",
        "whole",
        "87%",
        "40.0/80.0",
        "412/700",
        "71",
        "3s",
        "HEALTHY",
    ]
    assert row(shown, "gpu1")[4:11] == ["75%", "-", "-/80.0", "-", "-", "never", "HEALTHY"]
    assert row(shown, "gpu2")[-1] == "UNHEALTHY: XID 79: fell off the bus"


def test_sites_count_booked_devices_and_average_measured_use() -> None:
    cells = row(lines(sites_table(snapshot())), "dc-x")
    assert cells == ["dc-x", "datacenter", "CONNECTED", "1", "GPU 2/3", "87%", "50%", "0.4s"]


def test_running_jobs_show_their_running_tasks_and_tenant_strings_as_text() -> None:
    shown = "\n".join(lines(jobs_table(snapshot())))
    assert "\x1b" not in shown
    assert "\x07" not in shown
    assert "evil\\x1b]0;pwned\\x07\\x1b[2J[bold]x[/bold]" in shown  # visible, not acted on
    cells = row(shown.splitlines(), "j-1")
    assert cells[2:] == ["team-a", "train", "dc-x", "node-1:GPU:0", "2m 05s"]
    assert "done" not in shown  # only running tasks


def test_the_live_frame_has_its_header_and_tables() -> None:
    shown = "\n".join(lines(frame(snapshot(), "coord:7070", 2.0, "UNAVAILABLE: gone")))
    assert shown.startswith("fedctl top  coord:7070")
    assert "q to quit" in shown
    assert "refresh failed, retrying: UNAVAILABLE: gone" in shown
    for title in ("Sites", "Devices", "Running jobs"):
        assert title in shown


def test_once_prints_tables_whole_on_a_narrow_console() -> None:
    """Piped output is not cut to 40 columns: every cell comes out whole, on one line."""
    out = io.StringIO()
    console = Console(width=40, file=out, color_system=None)
    snap = snapshot()
    print_whole(console, [sites_table(snap), devices_table(snap), jobs_table(snap)])
    shown = out.getvalue()
    assert "…" not in shown
    assert "UNHEALTHY: XID 79: fell off the bus" in shown
    assert "node-1:GPU:0" in shown
    assert console.width == 40


def test_json_snapshot_is_plain_data() -> None:
    record = json.loads(json.dumps(snapshot_record(snapshot())))
    assert record["sites"][0]["devices"] == {"GPU": {"booked": 2, "total": 3}}
    assert record["devices"][0]["measured"]["compute"] == 0.87
    assert record["devices"][1]["measured"] is None
    assert record["jobs"] == [
        {
            "job": "j-1",
            "name": ESCAPES,  # JSON keeps the exact value
            "tenant": "team-a",
            "task": "train",
            "site": "dc-x",
            "nodes": ["node-1"],
            "devices": ["node-1:GPU:0"],
            "running_s": 125.0,
        }
    ]


async def test_quitting_does_not_wait_for_a_slow_refresh() -> None:
    """q during a refresh that hangs returns at once and cancels the refresh."""
    stop = asyncio.Event()
    hung = asyncio.get_running_loop().create_future()
    asyncio.get_running_loop().call_later(0.01, stop.set)
    assert await asyncio.wait_for(until_stopped(hung, stop), 5) is None
    assert hung.cancelled()
    assert await until_stopped(asyncio.sleep(0, "fresh"), asyncio.Event()) == "fresh"
