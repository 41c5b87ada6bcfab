"""``fedctl sites links``: the site-by-site matrix and its JSON, from a hand-made reply."""

from __future__ import annotations

import json

import pytest
from rich.console import Console

from federation.api.v1 import admin_service_pb2, resources_pb2
from federation.cli.app import build_parser
from federation.cli.output import Output
from federation.cli.remote import cmd_site_links
from federation.cli.render import format_age, link_records, links_matrix

NOW = 1_700_000_000.0


def reply() -> admin_service_pb2.ListSitesResponse:
    """Three sites: edge measured dc 12 s ago and declares cloud; dc measured edge 400 s ago."""

    def site(name: str, *links: resources_pb2.Link) -> admin_service_pb2.Site:
        return admin_service_pb2.Site(name=name, view=resources_pb2.SiteView(links=links))

    return admin_service_pb2.ListSitesResponse(
        sites=[
            site(
                "edge",
                resources_pb2.Link(
                    peer_site="dc", bandwidth_mbps=940.4, rtt_ms=0.31, measured_at=NOW - 12
                ),
                resources_pb2.Link(peer_site="cloud", bandwidth_mbps=50, rtt_ms=20, declared=True),
            ),
            site(
                "dc",
                resources_pb2.Link(
                    peer_site="edge", bandwidth_mbps=12034.5, rtt_ms=0.052, measured_at=NOW - 400
                ),
            ),
            site("cloud"),
        ]
    )


def render(sites: list[admin_service_pb2.Site]) -> list[str]:
    console = Console(width=200, record=True)
    console.print(links_matrix(sites, now=NOW))
    return console.export_text().splitlines()


def row(lines: list[str], name: str) -> list[str]:
    """The cells of the table row that starts with ``name``."""
    [line] = [line for line in lines if line.startswith(f"│ {name} ")]
    return [cell.strip() for cell in line.strip("│").split("│")]


def test_matrix_rows_are_from_columns_are_to() -> None:
    """Each row is the source site; each column the peer; cells give Mbit/s / ms (age)."""
    lines = render(list(reply().sites))
    [header] = [line for line in lines if "from \\ to" in line]
    assert [c.strip() for c in header.strip("┃").split("┃")] == [
        "from \\ to",
        "cloud",
        "dc",
        "edge",
    ]
    assert row(lines, "edge") == ["edge", "50 / 20*", "940 / 0.31 (12s)", "·"]
    assert row(lines, "dc") == ["dc", "-", "·", "12034 / 0.052 (6m)"]
    assert row(lines, "cloud") == ["cloud", "·", "-", "-"]


def test_matrix_explains_the_declared_mark() -> None:
    """The table's legend says what the trailing star means."""
    assert any("* declared by the operator" in line for line in render(list(reply().sites)))


def test_peer_without_a_site_gets_a_column() -> None:
    """A link to a site the coordinator does not list still shows, in its own column."""
    lines = render([reply().sites[0]])
    assert row(lines, "edge") == ["edge", "50 / 20*", "940 / 0.31 (12s)", "·"]
    assert row(lines, "dc") == ["dc", "-", "·", "-"]


def test_json_records(capsys: pytest.CaptureFixture[str]) -> None:
    """--json gives one record per link, with age_s, and null age for a declared link."""
    Output("json").data(link_records(list(reply().sites), now=NOW))
    records = json.loads(capsys.readouterr().out)
    assert records == [
        {
            "from": "dc",
            "to": "edge",
            "bandwidth_mbps": 12034.5,
            "rtt_ms": 0.052,
            "declared": False,
            "age_s": 400.0,
        },
        {
            "from": "edge",
            "to": "cloud",
            "bandwidth_mbps": 50.0,
            "rtt_ms": 20.0,
            "declared": True,
            "age_s": None,
        },
        {
            "from": "edge",
            "to": "dc",
            "bandwidth_mbps": 940.4,
            "rtt_ms": 0.31,
            "declared": False,
            "age_s": 12.0,
        },
    ]


@pytest.mark.parametrize(
    ("seconds", "text"), [(0.4, "0s"), (59, "59s"), (60, "1m"), (7200, "2h"), (200000, "2d")]
)
def test_format_age(seconds: float, text: str) -> None:
    """Ages read in the largest whole unit."""
    assert format_age(seconds) == text


def test_sites_links_command_is_wired() -> None:
    """``fedctl --json sites links`` parses to the links command."""
    args = build_parser().parse_args(["--json", "sites", "links"])
    assert args.func is cmd_site_links
    assert args.json
