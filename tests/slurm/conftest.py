"""A real single-host Slurm cluster for the Slurm tests, shared by the whole session.

The fixture installs nothing: it starts munged, slurmctld and slurmd (one node with two
declared A100 GPUs) on free ports in a temporary folder when the programs are on PATH and the
tests run as root, and skips the tests that need it otherwise. Tests that use it carry
``pytest.mark.xdist_group("slurm")`` so one xdist worker runs them all against one cluster.

The node is in two partitions: the federation's, and ``urgent``, whose jobs preempt the
federation's (Slurm's partition priority preemption, which requeues the preempted job). Slurm
starts a job it requeued again a few seconds later instead of two minutes.
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest

from datacenter_agent.slurm.core import SlurmCore
from federation.agent.config import GresModel, SlurmSettings
from federation.api.v1 import site_link_service_pb2
from federation.testing.slurm_cluster import LocalNode, LocalSlurmCluster, missing_binaries

from .cores import FINAL, Harness, MakeCore, sites

NODE = LocalNode(name="fed-node-1", cpus=8, memory_mib=16000, gpus={"a100": 2})
PARTITION = "gpu"
MAX_MEM_PER_NODE_MIB = 8000
"""The partition's per-node memory limit, below the node's: only Slurm knows it."""
URGENT = "urgent"
"""A partition of the same node whose jobs preempt those of ``PARTITION``."""
GRES = {"a100": {"model": "A100-80GB", "vendor": "nvidia", "memory_mib": 81920}}
SETTINGS = SlurmSettings(
    partition=PARTITION,
    poll_interval_s=0.2,
    gres={"a100": GresModel(model="A100-80GB", vendor="nvidia", memory_mib=81920)},
)
"""A core of the tests: it reads Slurm every 0.2 s."""


@pytest.fixture(scope="session")
def slurm_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalSlurmCluster]:
    """A running Slurm cluster; the tests are skipped when Slurm is not installed."""
    missing = missing_binaries()
    if missing:
        pytest.skip(
            f"Slurm is not installed (missing {', '.join(missing)}): apt-get install "
            "slurm-wlm munge"
        )
    if os.geteuid() != 0:
        pytest.skip("a local Slurm cluster needs root (slurmd starts jobs as their users)")
    cluster = LocalSlurmCluster(
        tmp_path_factory.mktemp("slurm"),
        node=NODE,
        partition=PARTITION,
        partition_options={"MaxTime": "60", "MaxMemPerNode": str(MAX_MEM_PER_NODE_MIB)},
        conf_lines=(
            "EnforcePartLimits=ALL",
            "PreemptType=preempt/partition_prio",
            "PreemptMode=REQUEUE",
            f"PartitionName={URGENT} Nodes={NODE.name} PriorityTier=10 MaxTime=60 DefMemPerCPU=100",
            "SchedulerParameters=sched_interval=1",  # start a requeued job once it may
        ),
        cred_expire_s=5,  # a requeued job may start 6 s later (by default two minutes)
    )
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture
async def make_core(slurm_cluster: LocalSlurmCluster, tmp_path: Path) -> AsyncIterator[MakeCore]:
    """Starts Slurm cores (each its own site) on the session's cluster; closes them after."""
    harnesses: list[Harness] = []

    async def make(
        settings: SlurmSettings = SETTINGS,
        environ: dict[str, str] | None = None,
        site: str = "",
        **options: Any,
    ) -> Harness:
        site = site or f"site-{next(sites)}"
        reports: list[site_link_service_pb2.TaskReport] = []
        core = SlurmCore(
            settings,
            site=site,
            work_dir=tmp_path / "work",
            on_status=reports.append,
            on_change=lambda: None,
            kill_grace_s=1.0,
            environ=environ or slurm_cluster.env,
            **options,
        )
        await core.start()
        harness = Harness(core, site, reports)
        harnesses.append(harness)
        return harness

    yield make
    for harness in harnesses:
        if not harness.is_closed:
            for task in harness.core.tasks():
                if task.state not in FINAL:
                    await harness.core.cancel(task.job_id, task.task, 0, "test over")
        await harness.shutdown()
