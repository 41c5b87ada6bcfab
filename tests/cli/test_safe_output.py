"""Strings tenants and sites choose print as text: never markup, no escape reaches the terminal."""

from __future__ import annotations

import io
import re

import grpc
import pytest
from google.protobuf import timestamp_pb2
from rich.console import Console, RenderableType

from federation.api.v1 import admin_service_pb2, job_service_pb2, jobs_pb2, resources_pb2
from federation.cli.connection import describe_rpc_error
from federation.cli.demo import results_table
from federation.cli.explain import explanation_table
from federation.cli.render import (
    coordinators_table,
    job_details,
    jobs_table,
    links_matrix,
    sites_table,
    text,
)

# Markup that crashes rich ([/x]) or makes a link, then a window title (OSC 0), a clear screen
# (CSI 2J), a raw hyperlink (OSC 8), a C1 CSI, DEL, a newline and a tab.
EVIL = (
    "[/x] [link=https://evil.example/]click[/link] :boom: "
    "\x1b]0;pwned\x07\x1b[2J\x1b]8;;https://evil.example/\x1b\\here\x1b]8;;\x1b\\"
    "\x9b2J\x7f\nrow\tcell"
)
SHOWN = (
    "[/x] [link=https://evil.example/]click[/link] :boom: "
    "\\x1b]0;pwned\\x07\\x1b[2J\\x1b]8;;https://evil.example/\\x1b\\here\\x1b]8;;\\x1b\\"
    "\\x9b2J\\x7f\\nrow\\tcell"
)
SGR = re.compile(r"\x1b\[[0-9;]*m")


def printed(renderable: RenderableType, *, terminal: bool, width: int = 200) -> str:
    """What a console writes; on a terminal, less rich's own SGR styles."""
    out = io.StringIO()
    colors = "truecolor" if terminal else None
    Console(file=out, width=width, force_terminal=terminal, color_system=colors).print(renderable)
    return SGR.sub("", out.getvalue()) if terminal else out.getvalue()


def assert_safe(output: str) -> None:
    unsafe = {c for c in output if (ord(c) < 0x20 and c != "\n") or 0x7F <= ord(c) <= 0x9F}
    assert not unsafe, output
    assert "\x1b" not in output


def test_text_shows_control_characters_and_keeps_markup_literal() -> None:
    """Each unsafe character reads as its escape; brackets and emoji codes stay as typed."""
    assert text(EVIL).plain == SHOWN
    assert text("a\u202eb\u2028c\x00").plain == "a\\u202eb\\u2028c\\x00"
    assert text("plain: ünïcode, 数据, C:\\path").plain == "plain: ünïcode, 数据, C:\\path"
    assert str(text("leader", "bold").style) == "bold"  # fedctl's own styles still apply


def evil_job() -> job_service_pb2.GetJobResponse:
    when = timestamp_pb2.Timestamp(seconds=1_700_000_000)
    task = jobs_pb2.TaskStatus(
        name=EVIL,
        state=jobs_pb2.JOB_STATE_FAILED,
        reason=EVIL,
        site=EVIL,
        exit_code=3,
        output_tail=f"first\r\n{EVIL}\nlast\n",
        devices=[EVIL],
        nodes=[EVIL],
        verdicts=[jobs_pb2.SiteVerdict(site=EVIL, stage=EVIL, reason=EVIL)],
        checkpoint=jobs_pb2.CheckpointRecord(path=EVIL, site=EVIL, time=when),
        displaced=jobs_pb2.DisplacedCopy(site=EVIL),
    )
    event = jobs_pb2.JobEvent(
        job_id="j-1", task=EVIL, time=when, site=EVIL, moved_from=EVIL, reason=EVIL
    )
    job = jobs_pb2.Job(
        id="j-1",
        spec=jobs_pb2.JobSpec(name=EVIL, tenant=EVIL),
        state=jobs_pb2.JOB_STATE_FAILED,
        reason=EVIL,
        tasks=[task],
    )
    return job_service_pb2.GetJobResponse(job=job, events=[event])


def evil_sites() -> list[admin_service_pb2.Site]:
    link = resources_pb2.Link(peer_site=EVIL, bandwidth_mbps=100, rtt_ms=1, declared=True)
    node = resources_pb2.Node(name=EVIL, cpu_cores=8, labels={EVIL: EVIL})
    view = resources_pb2.SiteView(nodes=[node], links=[link])
    return [admin_service_pb2.Site(name=EVIL, view=view)]


def explanation() -> jobs_pb2.TaskExplanation:
    return jobs_pb2.TaskExplanation(
        task=EVIL,
        site=EVIL,
        note=EVIL,
        sites=[
            jobs_pb2.SiteExplanation(site=EVIL, feasible=True, rank=1, scores={EVIL: 1.0}),
            jobs_pb2.SiteExplanation(site=EVIL, plugin=EVIL, reason=EVIL),
        ],
    )


def renderables() -> dict[str, list[RenderableType]]:
    status = admin_service_pb2.GetFederationStatusResponse(
        leader=EVIL,
        coordinators=[admin_service_pb2.Coordinator(address=EVIL, join_address=EVIL, leader=True)],
    )
    return {
        "jobs list": [jobs_table([evil_job().job])],
        "jobs get": list(job_details(evil_job())),
        "status": [coordinators_table(status), sites_table(evil_sites())],
        "sites links": [links_matrix(evil_sites(), now=0.0)],
        "jobs explain": [explanation_table(explanation())],
        "demo": [results_table([evil_job().job])],
    }


@pytest.mark.parametrize("terminal", [False, True], ids=["pipe", "terminal"])
@pytest.mark.parametrize("command", list(renderables()))
def test_every_view_prints_tenant_and_site_strings_as_text(command: str, terminal: bool) -> None:
    """No markup error, no escape but rich's own styles, and the strings shown as typed."""
    output = "".join(printed(r, terminal=terminal) for r in renderables()[command])
    assert_safe(output)
    assert "[/x]" in output
    assert "[link=" in output  # markup shown as typed, not turned into an OSC 8 link


def test_jobs_get_shows_every_string_whole() -> None:
    """Each line keeps the whole value; output keeps its own lines, each indented."""
    lines = [
        line
        for renderable in list(job_details(evil_job()))[1:]
        for line in printed(renderable, terminal=False, width=1000).splitlines()
    ]
    assert lines[0].endswith(f"at {SHOWN} epoch 0: {SHOWN}")
    assert f"  nodes: {SHOWN}" in lines
    assert f"  devices: {SHOWN}" in lines
    assert f"  {SHOWN}: [{SHOWN}] {SHOWN}" in lines
    tail = lines.index("  output tail:")
    # Output's newlines (CRLF too) stay line breaks, where other strings show them as \n.
    shown_lines = [f"    {line}" for line in SHOWN.split("\\n")]
    assert lines[tail + 1 : tail + 6] == ["    first", *shown_lines, "    last", "events"]


def test_rpc_error_details_are_escaped() -> None:
    """A refusal that echoes a tenant's string prints as one safe line."""
    err = grpc.aio.AioRpcError(
        grpc.StatusCode.NOT_FOUND,
        grpc.aio.Metadata(),
        grpc.aio.Metadata(),
        details=f"no job {EVIL}",
    )
    assert describe_rpc_error(err) == f"NOT_FOUND: no job {SHOWN}"
