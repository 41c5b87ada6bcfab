"""One federation task as one Slurm batch job: its sbatch flags, its script, its outcome.

The job's comment carries the site, job id, task and epoch (``federation:SITE:JOB:TASK:EPOCH``),
so an agent that restarts finds its jobs in Slurm again. Pure functions; nothing here runs.
"""

from __future__ import annotations

import math
import re
import shlex
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TypeAlias

from datacenter_agent.slurm.cli import Record, expand_hostlist, parse_exit_code, parse_time
from datacenter_agent.slurm.view import GRES_KINDS, parse_gres
from federation.agent.config import SlurmSettings
from federation.agent.discovery import device_kind_name
from federation.agent.process import describe_exit
from federation.api.v1 import jobs_pb2
from federation.common.keys import RunKey

State: TypeAlias = jobs_pb2.JobState.ValueType

_COMMENT_RE = re.compile(
    r"^federation:(?P<site>[^:\s]+):(?P<job>\S+):(?P<task>[^:\s]+):(?P<epoch>\d+)$"
)
_TEST_ONLY_RE = re.compile(r"to start at (\S+) using \d+ processors on nodes (\S+)")
_EPSILON = 1e-9

WAITING_STATES = frozenset(
    {"PENDING", "CONFIGURING", "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED", "RESV_DEL_HOLD"}
)
"""Slurm job states in which the task has not started (ours: DELEGATED)."""
RUNNING_STATES = frozenset(
    {"RUNNING", "COMPLETING", "SUSPENDED", "STOPPED", "SIGNALING", "STAGE_OUT", "RESIZING"}
)
"""Slurm job states in which the task holds its allocation (ours: RUNNING)."""
INTERRUPTED_STATES = frozenset({"PREEMPTED", "NODE_FAIL", "BOOT_FAIL"})
"""Slurm ended the job for reasons not the task's own: the site requeues it."""
RESTORE_FILE = "restore-from"
"""In the job's folder: the checkpoint a requeued job restarts from (the agent writes it)."""

RESERVED_ENV_PREFIXES = ("FEDERATION_", "SLURM_", "SBATCH_", "SRUN_")
RESERVED_ENV = frozenset(
    {
        "CUDA_VISIBLE_DEVICES",
        "HIP_VISIBLE_DEVICES",
        "ROCR_VISIBLE_DEVICES",
        "GPU_DEVICE_ORDINAL",
        "ASCEND_RT_VISIBLE_DEVICES",
        "MLU_VISIBLE_DEVICES",
    }
)
"""Variables a task's own env may not set: Slurm and the core set them (devices, identity)."""

# Runs in each replica before the task's program: names the devices Slurm gave it.
DEVICES_PRELUDE = (
    'gpus="${SLURM_STEP_GPUS:-${SLURM_JOB_GPUS:-}}"; FEDERATION_DEVICES=""; '
    "for i in $(echo \"$gpus\" | tr ',' ' '); do "
    'FEDERATION_DEVICES="${FEDERATION_DEVICES:+$FEDERATION_DEVICES,}${SLURMD_NODENAME}:GPU:$i"; '
    "done; export FEDERATION_DEVICES"
)


def job_comment(site: str, key: RunKey) -> str:
    """The comment that marks a Slurm job as this site's copy of a task."""
    return f"federation:{site}:{key[0]}:{key[1]}:{key[2]}"


def parse_comment(comment: str, site: str) -> RunKey | None:
    """The task a job's comment names, when the job belongs to ``site``; else None."""
    match = _COMMENT_RE.match(comment)
    if match is None or match.group("site") != site:
        return None
    return match.group("job"), match.group("task"), int(match.group("epoch"))


def job_dir(work_dir: Path, key: RunKey) -> Path:
    """The folder a task's job runs in, as the embedded core's: ``work_dir/JOB/TASK/EPOCH``."""
    return work_dir / key[0] / key[1] / str(key[2])


def job_name(key: RunKey) -> str:
    """A job name people can read in ``squeue``."""
    return f"fed.{key[0]}.{key[1]}.{key[2]}"


def resource_args(spec: jobs_pb2.TaskSpec, settings: SlurmSettings, gres: str) -> list[str]:
    """sbatch flags for where and what the task asks: partition, CPUs, memory, devices, time.

    One replica is one Slurm task on one node (``--gres=gpu:TYPE:N``); several replicas are as
    many Slurm tasks, each with its own CPUs, memory and GPUs (``--gpus-per-task``).

    Args:
        spec: The task.
        settings: The site's partition, account, QoS and extra flags.
        gres: ``"gpu:a100"`` or ``"gpu"`` (any type) when devices are asked for, else "".
    """
    res = spec.resources
    replicas = spec.replicas or 1
    cpus = max(1, math.ceil(res.cpu - _EPSILON))
    args = [f"--partition={settings.partition}"] if settings.partition else []
    if settings.account:
        args.append(f"--account={settings.account}")
    if settings.qos:
        args.append(f"--qos={settings.qos}")
    if spec.timeout_s > 0:
        args.append(f"--time={math.ceil(spec.timeout_s / 60 - _EPSILON)}")
    count = res.accelerator.count
    if replicas == 1:
        args += ["--nodes=1", "--ntasks=1", f"--cpus-per-task={cpus}"]
        if res.memory_mib:
            args.append(f"--mem={res.memory_mib}")
        if gres and count:
            args.append(f"--gres={gres}:{count}")
    else:
        args += [f"--ntasks={replicas}", f"--cpus-per-task={cpus}"]
        if res.memory_mib:
            args.append(f"--mem-per-cpu={math.ceil(res.memory_mib / cpus)}")
        if gres and count:
            gpu_type = gres.partition(":")[2]
            args.append(
                f"--gpus-per-task={gpu_type}:{count}" if gpu_type else f"--gpus-per-task={count}"
            )
    return [*args, *settings.extra_sbatch_args]


def task_env(spec: jobs_pb2.TaskSpec) -> dict[str, str]:
    """The task's own variables, less those Slurm or the core set (devices, identity)."""
    return {
        k: v
        for k, v in spec.env.items()
        if k not in RESERVED_ENV and not k.startswith(RESERVED_ENV_PREFIXES)
    }


def task_variables(
    spec: jobs_pb2.TaskSpec, key: RunKey, site: str, checkpoint_env: Mapping[str, str] | None
) -> dict[str, str]:
    """What a task's replicas see but for their devices and replica number: its own
    variables, the federation's, and its checkpoint folder (``checkpoint_env``)."""
    variables = dict(task_env(spec))
    variables.update(
        FEDERATION_JOB_ID=key[0],
        FEDERATION_TASK=key[1],
        FEDERATION_EPOCH=str(key[2]),
        FEDERATION_SITE=site,
        FEDERATION_REPLICAS=str(spec.replicas or 1),
        **(checkpoint_env or {}),
    )
    return variables


def script_header(key: RunKey, site: str) -> str:
    """A batch script's first lines: its shell, and what it runs."""
    return (
        f"#!/bin/sh\n# The federation's task {key[1]} of job {key[0]}, epoch {key[2]}, "
        f"at site {site}."
    )


def read_restore(restore_file: Path) -> str:
    """The script's line that takes ``FEDERATION_RESTORE_FROM`` from ``restore_file``, where
    the agent names the checkpoint a requeued job restarts from, when it is there."""
    file = shlex.quote(str(restore_file))
    return (
        f'if [ -s {file} ]; then FEDERATION_RESTORE_FROM="$(cat {file})"; '
        "export FEDERATION_RESTORE_FROM; fi"
    )


def batch_script(
    spec: jobs_pb2.TaskSpec,
    key: RunKey,
    *,
    site: str,
    checkpoint_env: Mapping[str, str] | None = None,
    restore_file: Path | None = None,
) -> str:
    """The ``sh`` batch script: the task's env, the federation's variables, then its command.

    Slurm itself sets ``CUDA_VISIBLE_DEVICES`` to the GPUs it allocated; the script adds
    ``FEDERATION_DEVICES`` (``node:GPU:index``) and, with several replicas, starts them with
    ``srun`` so each sees its own ``FEDERATION_REPLICA``.

    Args:
        spec: The task.
        key: Its job, name and epoch.
        site: This site's name.
        checkpoint_env: ``FEDERATION_CHECKPOINT_DIR`` (and ``FEDERATION_RESTORE_FROM``) for a
            task with a checkpoint policy.
        restore_file: Where the agent names the checkpoint a requeued job restarts from; the
            script reads it each time the job starts.
    """
    replicas = spec.replicas or 1
    exports = task_variables(spec, key, site, checkpoint_env)
    lines = [
        script_header(key, site),
        *(f"export {name}={shlex.quote(value)}" for name, value in exports.items()),
    ]
    if restore_file is not None:
        lines.append(read_restore(restore_file))
    command = " ".join(shlex.quote(arg) for arg in spec.command)
    if replicas == 1:
        lines += [DEVICES_PRELUDE, "export FEDERATION_REPLICA=0", f"exec {command}"]
    else:
        per_replica = f'{DEVICES_PRELUDE}; export FEDERATION_REPLICA="$SLURM_PROCID"; exec "$@"'
        lines.append(
            f"exec srun --kill-on-bad-exit=1 sh -c {shlex.quote(per_replica)} replica {command}"
        )
    return "\n".join(lines) + "\n"


@dataclass(frozen=True, slots=True)
class Outcome:
    """A Slurm job's state in the federation's terms."""

    state: State
    exit_code: int = 0
    reason: str = ""
    interrupted: bool = False
    """Slurm ended it for reasons not the task's own (preempted, its node failed)."""

    @property
    def is_final(self) -> bool:
        """Whether the job has ended."""
        return self.state in (
            jobs_pb2.JOB_STATE_SUCCEEDED,
            jobs_pb2.JOB_STATE_FAILED,
            jobs_pb2.JOB_STATE_CANCELLED,
        )


def slurm_state(record: Record) -> str:
    """The job's state word (``"CANCELLED by 0"`` → ``"CANCELLED"``)."""
    return record.value("JobState").split(" ")[0].upper()


def job_outcome(record: Record) -> Outcome:
    """Maps a ``scontrol show job`` record onto DELEGATED, RUNNING or a final state.

    Unknown states count as waiting: the job is still Slurm's, and a later reading decides.
    """
    state = slurm_state(record)
    job = f"Slurm job {record.value('JobId')}"
    code = parse_exit_code(record.value("ExitCode"))
    why = record.value("Reason")
    detail = f": {why}" if why and why != "None" else ""
    if state in RUNNING_STATES:
        return Outcome(jobs_pb2.JOB_STATE_RUNNING)
    if state == "COMPLETED":
        return Outcome(jobs_pb2.JOB_STATE_SUCCEEDED, code, f"{job} completed")
    if state == "FAILED":
        return Outcome(jobs_pb2.JOB_STATE_FAILED, code, f"{job} {describe_exit(code)} (FAILED)")
    if state == "CANCELLED":
        return Outcome(jobs_pb2.JOB_STATE_CANCELLED, code, f"{job} was cancelled in Slurm{detail}")
    final_reasons = {
        "TIMEOUT": f"reached its time limit {record.value('TimeLimit')} (TIMEOUT)",
        "NODE_FAIL": f"lost its node (NODE_FAIL{detail})",
        "PREEMPTED": "was preempted by higher-priority work (PREEMPTED)",
        "OUT_OF_MEMORY": "ran out of memory (OUT_OF_MEMORY)",
        "BOOT_FAIL": f"could not boot its node (BOOT_FAIL{detail})",
        "DEADLINE": "missed its deadline (DEADLINE)",
        "SPECIAL_EXIT": f"{describe_exit(code)} (SPECIAL_EXIT)",
        "REVOKED": "was revoked by a sibling cluster (REVOKED)",
    }
    if state in final_reasons:
        reason = f"{job} {final_reasons[state]}"
        return Outcome(jobs_pb2.JOB_STATE_FAILED, code, reason, state in INTERRUPTED_STATES)
    return Outcome(jobs_pb2.JOB_STATE_DELEGATED)


def is_held(record: Record) -> bool:
    """Whether the job is pending on a user hold (an uncommitted reservation of ours)."""
    return slurm_state(record) == "PENDING" and record.value("Reason") == "JobHeldUser"


def job_devices(record: Record) -> list[str]:
    """The devices Slurm allocated, as ``node:KIND:index``, from ``scontrol show job -d``.

    The detail lines pair ``Nodes=`` with that node set's ``GRES=gpu:a100:1(IDX:0)``.
    """
    devices: list[str] = []
    nodes: list[str] = []
    for key, value in record.pairs:
        if key == "Nodes":
            nodes = expand_hostlist(value)
        elif key == "GRES":
            for entry in parse_gres(value):
                kind = GRES_KINDS.get(entry.name)
                if kind is None:
                    continue
                label = device_kind_name(kind)
                devices += [f"{node}:{label}:{i}" for node in nodes for i in entry.indices]
    return devices


@dataclass(frozen=True, slots=True)
class TestOnly:
    """What ``sbatch --test-only`` foresees: when the job would start, and where."""

    start: float | None
    nodes: tuple[str, ...]


def parse_test_only(text: str) -> TestOnly | None:
    """Reads ``sbatch: Job 7 to start at 2026-01-31T12:00:00 using 1 processors on nodes n1``."""
    match = _TEST_ONLY_RE.search(text)
    if match is None:
        return None
    return TestOnly(parse_time(match.group(1)), tuple(expand_hostlist(match.group(2))))
