"""The Grafana dashboards in deploy/grafana/ ask only for metrics the project exports, and
define every variable they use."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client.metrics import MetricWrapperBase

from federation import metrics

GRAFANA = Path(__file__).resolve().parent.parent / "deploy" / "grafana"
DASHBOARDS = sorted((GRAFANA / "dashboards").glob("*.json"))

SUFFIXES = {
    "counter": ("_total", "_created"),
    "gauge": ("",),
    "histogram": ("_bucket", "_sum", "_count", "_created"),
    "summary": ("", "_sum", "_count", "_created"),
    "info": ("_info",),
    "stateset": ("",),
    "enum": ("",),
}
"""The series each kind of collector exposes, by the suffix added to its family's name."""

KEYWORDS = {
    "by", "without", "on", "ignoring", "group_left", "group_right", "bool", "offset",
    "and", "or", "unless", "atan2", "inf", "nan",
}  # fmt: skip
"""PromQL words that are neither functions nor metrics."""

STRING = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'|`[^`]*`')
MATCHERS = re.compile(r"\{[^{}]*\}")
RANGE = re.compile(r"\[[^\[\]]*\]")
LABEL_LIST = re.compile(
    r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^()]*\)", re.IGNORECASE
)
VARIABLE = re.compile(r"\$\{(\w+)(?:[:.][^}]*)?\}|\$(\w+)|\[\[(\w+)(?::\w+)?\]\]")
DURATION = re.compile(r"(?<![\w:.])\d+(?:ms|[smhdwy])(?:\d+(?:ms|[smhdwy]))*(?![\w:])")
NUMBER = re.compile(r"(?<![\w:.])(?:0x[0-9a-fA-F]+|\d+(?:\.\d*)?(?:[eE][+-]?\d+)?|\.\d+)")
IDENTIFIER = re.compile(r"[A-Za-z_:][A-Za-z0-9_:]*")
LABEL_VALUES = re.compile(r"^\s*label_values\s*\((.*),\s*\w+\s*\)\s*$", re.DOTALL)
QUERY_RESULT = re.compile(r"^\s*query_result\s*\((.*)\)\s*$", re.DOTALL)


def metric_names(expr: str) -> set[str]:
    """Every metric a PromQL expression names: what is left once strings, label matchers,
    ranges, grouping label lists, variables, durations and numbers are taken out, less the
    functions (a name before a parenthesis) and keywords."""
    text = STRING.sub(" ", expr)
    text = MATCHERS.sub(" ", text)
    text = RANGE.sub(" ", text)
    text = LABEL_LIST.sub(" ", text)
    text = VARIABLE.sub(" ", text)
    text = DURATION.sub(" ", text)
    text = NUMBER.sub(" ", text)
    names = set()
    for match in IDENTIFIER.finditer(text):
        rest = text[match.end() :].lstrip()
        if rest.startswith("(") or match.group().lower() in KEYWORDS:
            continue
        names.add(match.group())
    return names


def variable_query_names(query: str) -> set[str]:
    """The metrics a Prometheus variable query names (``label_values(expr, label)``,
    ``query_result(expr)``; ``label_values(label)`` and ``label_names()`` name none)."""
    for pattern in (LABEL_VALUES, QUERY_RESULT):
        if match := pattern.match(query):
            return metric_names(match.group(1))
    return set()


def exported() -> set[str]:
    """Every series name federation/metrics.py's collectors expose, from the collectors
    themselves (the gauges computed when scraped too): a Counter adds ``_total``, a Histogram
    ``_bucket``, ``_sum`` and ``_count``."""
    names = set()
    for collector in vars(metrics).values():
        if not isinstance(collector, MetricWrapperBase | metrics.AggregateCollector):
            continue
        for family in collector.describe():
            names.update(family.name + suffix for suffix in SUFFIXES[family.type])
    return names


def panels(board: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """Every panel, those inside collapsed rows too."""
    for panel in board.get("panels", []):
        yield panel
        yield from panel.get("panels", [])


def exprs(board: dict[str, Any]) -> Iterator[tuple[str, str]]:
    """(where, expr) of every panel target."""
    for panel in panels(board):
        for target in panel.get("targets", []):
            if "expr" in target:
                yield f"panel {panel.get('title')!r} target {target.get('refId')}", target["expr"]


def variable_queries(board: dict[str, Any]) -> Iterator[tuple[str, str]]:
    for variable in board["templating"]["list"]:
        if variable.get("type") == "query":
            query = variable["query"]
            yield variable["name"], query["query"] if isinstance(query, dict) else query


def used_variables(value: object) -> set[str]:
    """The variables a dashboard (or part of one) refers to, less Grafana's own ($__...)."""
    text = json.dumps(value)
    found = {next(g for g in m.groups() if g) for m in VARIABLE.finditer(text)}
    return {name for name in found if not name.startswith("__")}


def load(path: Path) -> dict[str, Any]:
    board = json.loads(path.read_text())
    assert isinstance(board, dict)
    return board


def missing_in(board: dict[str, Any], known: set[str]) -> list[str]:
    """'where: name' of every metric the board names that nobody exports."""
    named = [(where, metric_names(expr)) for where, expr in exprs(board)]
    named += [(f"variable ${n}", variable_query_names(q)) for n, q in variable_queries(board)]
    return [f"{where}: {name}" for where, names in named for name in sorted(names - known)]


def test_the_dashboards_are_there() -> None:
    names = {path.stem for path in DASHBOARDS}
    assert names == {
        "federation-overview",
        "federation-site",
        "federation-device",
        "federation-jobs",
    }


@pytest.mark.parametrize("path", DASHBOARDS, ids=lambda p: p.stem)
def test_every_metric_is_exported(path: Path) -> None:
    """Every metric a panel or variable query names is one federation/metrics.py exports."""
    board = load(path)
    assert list(exprs(board)), "a dashboard without queries"
    for where, expr in exprs(board):
        assert metric_names(expr), f"{where} names no metric: {expr}"
    for name, query in variable_queries(board):
        assert variable_query_names(query), f"variable ${name} names no metric: {query}"
    assert missing_in(board, exported()) == []


@pytest.mark.parametrize("path", DASHBOARDS, ids=lambda p: p.stem)
def test_every_variable_used_is_defined(path: Path) -> None:
    """Each $variable the dashboard uses (queries, titles, data sources) is one it defines,
    and each query variable's own query uses only variables defined before it."""
    board = load(path)
    defined = [variable["name"] for variable in board["templating"]["list"]]
    assert "datasource" in defined
    assert used_variables({k: v for k, v in board.items() if k != "templating"}) <= set(defined)
    for index, variable in enumerate(board["templating"]["list"]):
        assert used_variables(variable.get("query", "")) <= set(defined[:index]), variable["name"]


@pytest.mark.parametrize("path", DASHBOARDS, ids=lambda p: p.stem)
def test_dashboard_shape(path: Path) -> None:
    """Standard dashboard JSON: a uid, schemaVersion 39, unique panel ids, every query panel
    on the Prometheus data source variable with a grid position."""
    board = load(path)
    assert board["uid"] == path.stem
    assert board["schemaVersion"] == 39
    ids = [panel["id"] for panel in panels(board)]
    assert len(ids) == len(set(ids))
    source = {"type": "prometheus", "uid": "${datasource}"}
    for panel in panels(board):
        assert {"x", "y", "w", "h"} <= panel["gridPos"].keys()
        assert panel["gridPos"]["x"] + panel["gridPos"]["w"] <= 24
        if panel["type"] == "row":
            continue
        assert panel["type"] in {"timeseries", "stat", "table"}
        assert panel["datasource"] == source
        assert all(target["datasource"] == source for target in panel["targets"])


def test_templated_dashboards_have_their_variables() -> None:
    """The site dashboard is templated by $site, the device one by $site, $node, $device."""
    for stem, wanted in [
        ("federation-site", {"site"}),
        ("federation-device", {"site", "node", "device"}),
    ]:
        board = load(GRAFANA / "dashboards" / f"{stem}.json")
        assert wanted <= {v["name"] for v in board["templating"]["list"]}
        assert wanted <= used_variables(board["panels"])


def test_extractor_finds_metrics_and_reports_unknown_ones() -> None:
    """The extractor keeps metric names and drops functions, keywords, labels, strings,
    durations, numbers and variables; a metric nobody exports is reported."""
    expr = (
        'histogram_quantile(0.9, sum by (le, site) (rate(federation_bogus_bucket{site=~"$site",'
        ' kind="GPU"}[5m] offset 1h30m))) / on (site) group_left (model)'
        ' federation_devices{state="total"} * 1e3 > bool 0.5'
        " and ignoring(state) federation_run_time_ratio_count[$__rate_interval:1m]"
    )
    assert metric_names(expr) == {
        "federation_bogus_bucket",
        "federation_devices",
        "federation_run_time_ratio_count",
    }
    assert variable_query_names('label_values(federation_bogus{site="$site"}, node)') == {
        "federation_bogus"
    }
    assert variable_query_names("label_values(site)") == set()
    board = {
        "panels": [{"title": "p", "targets": [{"refId": "A", "expr": expr}]}],
        "templating": {"list": []},
    }
    assert missing_in(board, exported()) == ["panel 'p' target A: federation_bogus_bucket"]


def test_exported_names_follow_the_collectors() -> None:
    """Counters are exported with _total, histograms as _bucket, _sum and _count, gauges as
    they are named; nothing hard-coded."""
    known = exported()
    assert {"federation_jobs_submitted_total", "federation_devices"} <= known
    assert "federation_jobs_submitted" not in known
    assert {f"federation_run_time_ratio{s}" for s in ("_bucket", "_sum", "_count")} <= known
    assert "federation_run_time_ratio" not in known


def test_provisioning_files_load() -> None:
    """The dashboards provider reads files; the data source example is a Prometheus one."""
    providers = yaml.safe_load((GRAFANA / "provisioning" / "dashboards.yaml").read_text())
    assert providers["apiVersion"] == 1
    (provider,) = providers["providers"]
    assert provider["type"] == "file"
    assert provider["options"]["path"]
    example = GRAFANA / "provisioning" / "datasources.example.yaml"
    sources = yaml.safe_load(example.read_text())["datasources"]
    assert [source["type"] for source in sources] == ["prometheus"]
    scrape = yaml.safe_load((GRAFANA / "prometheus.example.yaml").read_text())
    assert {job["job_name"] for job in scrape["scrape_configs"]} == {
        "federation-coordinator",
        "federation-agent",
    }
