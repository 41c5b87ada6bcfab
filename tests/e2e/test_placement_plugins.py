"""Placement plugins from outside the project, in a real coordinator: the example package's
filter and scorer loaded by their entry-point names change where jobs go, and a plugin that
raises in a cycle is disabled while the job is still placed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from federation.api.v1 import job_service_pb2, jobs_pb2
from federation.local import LocalFederation, SiteSpec
from federation.placement.registry import DEFAULT_FILTERS, DEFAULT_SCORERS

from .conftest import jobs, python_task, running, spec, until, wait_for_job

pytestmark = pytest.mark.xdist_group("e2e-placement-plugins")

# Passes its trial on the sample federation the coordinator starts with, raises on the real one.
EXPLODES = """
class Explodes:
    name = "Explodes"

    def filter(self, req, snap):
        if not all(site.startswith("sample-") for site in snap.site_ids):
            raise RuntimeError("boom in a real cycle")
        from federation.placement.framework import Verdict
        import numpy as np
        return Verdict(mask=np.ones(snap.n_sites, dtype=bool))
"""


def site(name: str, **labels: str) -> SiteSpec:
    node = {"name": f"{name}-box", "cpu_cores": 4, "memory_mib": 4096, "labels": labels}
    return SiteSpec(name, "edge", nodes=[node])


@pytest.fixture(scope="module")
def federation(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalFederation]:
    root = tmp_path_factory.mktemp("plugins")
    (root / "outside_plugins.py").write_text(EXPLODES)
    filters = [*DEFAULT_FILTERS, "AvoidMaintenance", "outside_plugins:Explodes"]
    scores = {**DEFAULT_SCORERS, "RenewablePower": 5.0}
    config = root / "coordinator.toml"
    config.write_text(
        f"placement_filters = {json.dumps(filters)}\n[placement_scores]\n"
        + "".join(f'"{name}" = {weight}\n' for name, weight in scores.items())
    )
    # The coordinator imports module:Class plugins from its path, as it would from site-packages.
    before = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(root), before]))
    try:
        sites = [
            site("plain-p"),
            site("fixing-p", maintenance="true"),
            site("green-p", power="renewable"),
        ]
        with running(root / "fed", sites, ["--config", str(config)]) as fed:
            yield fed
    finally:
        if before is None:
            os.environ.pop("PYTHONPATH")
        else:
            os.environ["PYTHONPATH"] = before


def quick(job_id: str, **extra: object) -> jobs_pb2.JobSpec:
    task = python_task("t", "print('placed')", resources={"cpu": 1, "memory_mib": 64})
    return spec(job_id, [task], id=job_id, **extra)


async def test_plugins_from_outside_change_placement_and_a_raising_one_is_disabled(
    operator: grpc.aio.Channel, federation: LocalFederation
) -> None:
    stub = jobs(operator)
    # The scorer: the site with renewable power goes first.
    await stub.SubmitJob(job_service_pb2.SubmitJobRequest(spec=quick("anywhere")))
    done = await wait_for_job(operator, "anywhere")
    assert done.state == jobs_pb2.JOB_STATE_SUCCEEDED, done.reason
    assert done.tasks[0].site == "green-p"
    # The filter: a site in maintenance takes nothing, and the explanation says why.
    pinned = quick("fixing-only", constraints={"sites": ["fixing-p"]})
    await stub.SubmitJob(job_service_pb2.SubmitJobRequest(spec=pinned))

    async def refused_for_maintenance() -> bool:
        reply = await stub.ExplainJob(job_service_pb2.ExplainJobRequest(job_id="fixing-only"))
        rejected = {s.site: s for s in reply.tasks[0].sites if not s.feasible}
        found = rejected.get("fixing-p")
        return found is not None and any(
            (v.stage, v.code) == ("AvoidMaintenance", "IN_MAINTENANCE") for v in found.rejections
        )

    await until(refused_for_maintenance, "fixing-p rejected by AvoidMaintenance")
    job = (await stub.GetJob(job_service_pb2.GetJobRequest(job_id="fixing-only"))).job
    assert job.state == jobs_pb2.JOB_STATE_PENDING
    # The raising filter was disabled at the first real cycle, named in the coordinator's log,
    # and the jobs above were placed all the same.
    log = federation.log_path("coordinator").read_text()
    disabled = [
        json.loads(line)
        for line in log.splitlines()
        if line.startswith("{") and "placement_plugin_disabled" in line
    ]
    assert [(r["plugin"], r["reason"]) for r in disabled] == [
        ("Explodes", "RuntimeError: boom in a real cycle")
    ]


def test_a_plugin_that_cannot_be_loaded_stops_the_coordinator_in_one_line(tmp_path: Path) -> None:
    """A bad plugin name is one line naming it, and exit 2, before anything starts."""
    config = tmp_path / "coordinator.toml"
    config.write_text('placement_filters = ["SiteState", "no_such_module:Filter"]\n')
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "federation.coordinator",
            "--config",
            str(config),
            "--pki-dir",
            str(tmp_path / "pki"),
            "--data-dir",
            str(tmp_path / "data"),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert "no_such_module:Filter" in lines[0]
    assert "ModuleNotFoundError" in lines[0]
