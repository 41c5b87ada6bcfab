"""deploy/prometheus/: the alert rules pass `promtool check rules`, their unit tests
(alerts_test.yaml) pass `promtool test rules`, and every metric they name is one the project
exports."""

from __future__ import annotations

import re
import subprocess

import yaml
from deploy_tools import DEPLOY, need_tool
from prometheus_client import REGISTRY

import federation.metrics  # noqa: F401  # registers every metric

RULES = DEPLOY / "prometheus" / "alerts.yaml"
HOW = "Debian package prometheus; .ci/run extracts promtool alone from it"
# The alerts the operators' runbooks name; renaming one breaks their routing.
ALERTS = {
    "FederationNoLeader",
    "FederationStoreSlow",
    "FederationSiteUnreachable",
    "FederationReschedulingPaused",
    "FederationCertificateExpiringSoon",
    "FederationCertificateExpiringNow",
    "FederationSiteCertificateNotRenewed",
    "FederationQueueStarving",
}


def promtool(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [need_tool("promtool", HOW), *args],
        cwd=RULES.parent,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def test_rules_check() -> None:
    run = promtool("check", "rules", RULES.name)
    assert run.returncode == 0, run.stdout + run.stderr
    assert f"SUCCESS: {len(ALERTS)} rules found" in run.stdout


def test_rules_unit_tests() -> None:
    run = promtool("test", "rules", "alerts_test.yaml")
    assert run.returncode == 0, run.stdout + run.stderr


def rules() -> list[dict[str, object]]:
    groups = yaml.safe_load(RULES.read_text())["groups"]
    return [rule for group in groups for rule in group["rules"]]


def test_every_alert_has_severity_runbook_and_a_wait() -> None:
    assert {rule["alert"] for rule in rules()} == ALERTS
    for rule in rules():
        assert rule["labels"]["severity"] in {"warning", "critical"}, rule  # type: ignore[index]
        assert {"summary", "description", "runbook"} <= set(rule["annotations"]), rule  # type: ignore[arg-type]
        assert re.fullmatch(r"\d+[mh]", str(rule["for"])), rule


def test_alerts_name_only_exported_metrics() -> None:
    families = {metric.name for metric in REGISTRY.collect()}
    for rule in rules():
        named = set(re.findall(r"\bfederation_[a-z_]+", str(rule["expr"])))
        assert named, rule
        # A labelled histogram has no samples before its first observation: compare families.
        bases = {re.sub(r"_(bucket|count|sum|total)$", "", name) for name in named}
        assert bases <= families, (rule["alert"], bases - families)
