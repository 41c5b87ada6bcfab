"""A real single-host Slurm cluster for the Slurm tests, shared by the whole session.

The fixture installs nothing: it starts munged, slurmctld and slurmd (one node with two
declared A100 GPUs) on free ports in a temporary folder when the programs are on PATH and the
tests run as root, and skips the tests that need it otherwise. Tests that use it carry
``pytest.mark.xdist_group("slurm")`` so one xdist worker runs them all against one cluster.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from datacenter_agent.slurm_cluster import LocalNode, LocalSlurmCluster, missing_binaries

NODE = LocalNode(name="fed-node-1", cpus=8, memory_mib=16000, gpus={"a100": 2})
PARTITION = "gpu"
MAX_MEM_PER_NODE_MIB = 8000
"""The partition's per-node memory limit, below the node's: only Slurm knows it."""
GRES = {"a100": {"model": "A100-80GB", "vendor": "nvidia", "memory_mib": 81920}}


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
        conf_lines=("EnforcePartLimits=ALL",),
    )
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()
