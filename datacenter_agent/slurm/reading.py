"""One reading of Slurm: the partition, its nodes, its queue and every job, or Slurm's error."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from pathlib import Path

from datacenter_agent.slurm.cli import Output, Record, SlurmCli, SlurmError, parse_records
from datacenter_agent.slurm.view import (
    ClusterView,
    Partition,
    cluster_view,
    parse_partition,
    queue_state,
)
from federation.agent.config import SlurmSettings
from federation.api.v1 import resources_pb2

READ_TIMEOUT_S = 30.0
"""Readings may take longer than negotiation commands: a big cluster lists many jobs."""


@dataclass(frozen=True, slots=True)
class Reading:
    """What Slurm said at one moment."""

    partition: Partition
    cluster: ClusterView
    queue: resources_pb2.QueueState
    jobs: list[Record]


async def read_slurm(cli: SlurmCli, settings: SlurmSettings, conf: Path | None) -> Reading:
    """Reads the partition, then its nodes, jobs and expected starts at once.

    Args:
        cli: Runs Slurm's commands.
        settings: Which partition, and how to describe GRES types.
        conf: The slurm.conf in use, checked first (a missing one makes commands hang).

    Raises:
        SlurmError: Slurm could not be read, or the partition is missing or not UP.
    """
    if conf is not None and not await asyncio.to_thread(conf.is_file):
        raise SlurmError("slurm.conf", f"{conf} does not exist")
    partition = await _read_partition(cli, settings.partition)
    if not partition.is_up:
        raise SlurmError("partition", f"partition {partition.name} is {partition.state}")
    results = await asyncio.gather(
        cli.run("scontrol", "show", "node", "-d", "-o", timeout_s=READ_TIMEOUT_S),
        cli.run("scontrol", "show", "job", "-d", "-o", timeout_s=READ_TIMEOUT_S),
        cli.run(
            *("squeue", "--start", "-h", "-t", "PENDING", "-p", partition.name, "-o", "%i|%S"),
            timeout_s=READ_TIMEOUT_S,
        ),
        return_exceptions=True,
    )
    outputs: list[Output] = []
    for result in results:
        if isinstance(result, BaseException):
            raise result
        outputs.append(result)
    nodes_out, jobs_out, starts_out = (output.stdout for output in outputs)
    jobs = parse_records(jobs_out)
    return Reading(
        partition=partition,
        cluster=cluster_view(parse_records(nodes_out), partition.name, settings.gres),
        queue=queue_state(jobs, partition.name, starts_out, time.time()),
        jobs=jobs,
    )


async def _read_partition(cli: SlurmCli, name: str) -> Partition:
    """The named partition, or the cluster's default one when ``name`` is empty."""
    argv = ["scontrol", "show", "partition", "-o", *([name] if name else [])]
    records = parse_records((await cli.run(*argv, timeout_s=READ_TIMEOUT_S)).stdout)
    if not name:
        records = [r for r in records if r.value("Default") == "YES"]
    if not records:
        raise SlurmError("partition", "Slurm has no default partition; set slurm.partition")
    return parse_partition(records[0])
