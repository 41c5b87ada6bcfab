"""Deciding an offer with Slurm: what is refused before asking, what Slurm foresees, the hold.

``sbatch --test-only`` says whether Slurm would take the job and when it would start; the
reservation is then the real job, submitted held (``sbatch --hold``), so Slurm has checked it
as it checks every submission (account, QoS, partition limits) before the offer is accepted.
"""

from __future__ import annotations

import asyncio
import dataclasses
import re
import time
from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from datacenter_agent.slurm.checkpoints import save_policy
from datacenter_agent.slurm.cli import SlurmCli, SlurmError
from datacenter_agent.slurm.containers import (
    CONTAINER_ENV,
    PULL_AUTH,
    WORK_FOLDER,
    ContainerJob,
    container_env,
    container_script,
)
from datacenter_agent.slurm.job import (
    RESTORE_FILE,
    batch_script,
    job_comment,
    job_dir,
    job_name,
    parse_test_only,
    resource_args,
)
from datacenter_agent.slurm.select import gres_devices, gres_name, gres_options, matches
from datacenter_agent.slurm.view import GRES_KINDS
from federation.agent.accounts import Account, agent_folder, private_folder
from federation.agent.checkpoints import TaskCheckpoints
from federation.agent.commits import epoch_problem
from federation.agent.config import SlurmSettings
from federation.agent.containers import login_for, write_auth_file, write_env_file
from federation.agent.core import gang_refusal
from federation.agent.node_fit import invalid_names, task_problem
from federation.agent.packing import task_speed
from federation.api.v1 import jobs_pb2, resources_pb2, site_link_service_pb2
from federation.common.keys import RunKey

_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*(/[0-9]+)?$")
"""A task, or a part of a divided one ("train/1"), as Slurm's job names and comments take it."""
_JOB_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:-]*$")
"""A tenant's chosen ids are ``TENANT:ID``."""
_ENV_KEY_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


SLURM_DATA_REFUSAL = "this Slurm site does not stage inputs or store outputs yet"


def offer_problem(
    offer: site_link_service_pb2.Offer,
    *,
    health: str,
    held: Iterable[RunKey],
    committed: Collection[RunKey],
) -> str:
    """Why an offer is declined before Slurm is even asked, or "": the checks every core
    makes (``node_fit.task_problem``, ``commits.epoch_problem``) and what this site cannot do
    under Slurm.

    Args:
        offer: The offer.
        health: Why the site is degraded, or "".
        held: Tasks with a held job here.
        committed: Tasks committed here.
    """
    if health:
        return f"site degraded: {health}"
    if problem := task_problem(offer):
        return problem
    if not (_JOB_ID_RE.match(offer.job_id) and _NAME_RE.match(offer.task)):
        return invalid_names(offer)  # names Slurm's job names and comments cannot carry
    spec = offer.spec
    acc = spec.resources.accelerator
    if spec.kind == jobs_pb2.TASK_KIND_SERVICE:
        return (
            "services are not run under Slurm, which takes work that ends: this site keeps "
            "no replica running"
        )
    if spec.spread.all_or_nothing:
        return gang_refusal("Slurm")
    if offer.stages_inputs or spec.outputs:
        # Declined, not run without them: the task would miss its inputs, and a dependant
        # elsewhere would wait for outputs no store ever gets.
        return SLURM_DATA_REFUSAL
    if spec.topology.required:
        return (
            f"replicas must share a {spec.topology.required}, and this site does not place by "
            "topology (Slurm's switches are not mapped to node labels)"
        )
    if bad := sorted(k for k in spec.env if not _ENV_KEY_RE.match(k)):
        return f"invalid environment variable names: {', '.join(bad)}"
    if acc.fraction or acc.partition:
        return "this Slurm site gives whole devices only (no fractions or MIG partitions)"
    if acc.same_interconnect and acc.count > 1:
        return "this Slurm site does not know its interconnect groups"
    if acc.count and acc.kind not in (resources_pb2.DEVICE_KIND_UNSPECIFIED, *GRES_KINDS.values()):
        return "Slurm has no generic resource for this device kind"
    if acc.count and (spec.replicas or 1) > 1 and acc.kind != resources_pb2.DEVICE_KIND_GPU:
        return "Slurm gives each of several replicas their own devices for GPUs only"
    return epoch_problem(offer, held, committed)


@dataclass(frozen=True, slots=True)
class Foresight:
    """The sbatch flags Slurm accepted, when it would start the job (Unix time), and how long
    the task runs on that GRES type (0: unknown)."""

    args: list[str]
    start: float
    run_s: float = 0.0
    device_model: str = ""
    """The model of the slowest device the GRES type may give; "" when unknown."""


async def foresee(
    cli: SlurmCli,
    spec: jobs_pb2.TaskSpec,
    settings: SlurmSettings,
    nodes: list[resources_pb2.Node],
    *,
    exclude: Sequence[str] = (),
    min_speed: float = 0.0,
) -> Foresight | str:
    """Asks ``sbatch --test-only`` about each fitting GRES type; the earliest start wins,
    among the types at least ``min_speed`` fast (the speed the coordinator's estimate assumed)
    when Slurm takes any of them, else among all.

    Args:
        cli: Runs Slurm's commands.
        spec: The task.
        settings: The site's settings, its partition resolved.
        nodes: The nodes that may run the task, whose devices say which GRES types fit.
        exclude: Nodes of the partition that may not (``--exclude``).
        min_speed: The device speed the offer's estimate assumed; 0 for none.

    Returns:
        What Slurm foresees, or why no GRES type can match (before Slurm is asked).

    Raises:
        SlurmError: Slurm refused every option; its message says why.
    """
    acc = spec.resources.accelerator
    options = gres_options(acc, nodes, settings.partition)
    if isinstance(options, str):
        return options
    speed = task_speed(spec)
    devices = gres_devices(nodes, gres_name(acc.kind)) if acc.count else {}
    fitting = {gres: d for gres, d in devices.items() if matches(d, acc)}
    fast = sorted(g for g, d in fitting.items() if speed(d) >= min_speed * (1 - 1e-9))
    tries = [fast, options] if min_speed > 0 and fast and fast != options else [options]
    error: SlurmError | None = None
    for tried in tries:
        best: Foresight | None = None
        for gres in tried:
            # An untyped request may get any fitting type: the slowest sets the run time.
            got = [fitting[gres]] if gres in fitting else list(fitting.values())
            slowest_device = min(got, key=speed, default=None)
            slowest = speed(slowest_device) if slowest_device is not None else 0.0
            model = slowest_device.model if slowest_device is not None else ""
            args = resource_args(spec, settings, gres)
            if exclude:
                args.append(f"--exclude={','.join(exclude)}")
            try:
                out = await cli.run("sbatch", "--test-only", *args, "--wrap=true")
            except SlurmError as err:
                error = error or err
                continue
            foreseen = parse_test_only(out.stderr + out.stdout)
            start = foreseen.start if foreseen is not None and foreseen.start else time.time()
            if best is None or start < best.start:
                duration = spec.estimated_duration_s
                run_s = duration / slowest if slowest > 0 and duration > 0 else 0.0
                best = Foresight(args, start, run_s, model)
        if best is not None:
            return best
    assert error is not None  # options is never empty
    raise error


async def submit_held(
    cli: SlurmCli,
    spec: jobs_pb2.TaskSpec,
    key: RunKey,
    *,
    site: str,
    work_dir: Path,
    args: list[str],
    checkpoints: TaskCheckpoints | None = None,
    restore: jobs_pb2.CheckpointRecord | None = None,
    container: ContainerJob | None = None,
) -> str:
    """Writes the task's batch script and submits it held; returns the Slurm job id.

    A task from an image (``container``, see ``slurm_containers``) runs in its folder's
    ``0``, the tenant's, and its variables go to ``container.env`` beside the script.

    The job runs in ``work_dir/JOB/TASK/EPOCH`` (its output in ``slurm-ID.out`` there), with
    its checkpoint folder there as the embedded core's, and beside the script what an agent
    that adopts the job needs to watch it (``slurm_checkpoints``): the task's checkpoint
    policy and ``restore``, the checkpoint it starts from. It is submitted ``--requeue``, so
    Slurm puts it back in its queue when it is preempted or its node fails, and so can we.

    Raises:
        SlurmError: sbatch refused the job; its message says why.
    """
    folder = job_dir(work_dir, key)
    checkpoint_env = checkpoints.env() if checkpoints is not None else None
    restore_file = folder / RESTORE_FILE if checkpoints is not None else None
    if container is None:
        script = batch_script(
            spec, key, site=site, checkpoint_env=checkpoint_env, restore_file=restore_file
        )
    else:
        script = container_script(
            spec,
            key,
            site=site,
            folder=folder,
            job=container,
            checkpoint_env=checkpoint_env,
            restore_file=restore_file,
        )
    policy = spec.checkpoint if checkpoints is not None else None
    await asyncio.to_thread(_write_script, folder, script, checkpoints, policy, restore)
    if container is not None:
        env = container_env(spec, key, site, container.account, folder, checkpoint_env)
        login = login_for(spec.image, spec.image_pull_secrets)
        await asyncio.to_thread(
            _prepare_container, folder, container.account, checkpoints, env, login
        )
    out = await cli.run(
        "sbatch",
        "--parsable",
        "--hold",
        "--requeue",
        f"--job-name={job_name(key)}",
        f"--comment={job_comment(site, key)}",
        f"--chdir={folder}",
        f"--output={folder}/slurm-%j.out",
        "--export=ALL",
        *args,
        str(folder / "job.sh"),
    )
    return out.stdout.strip().split(";")[0]


def accepted(
    reservation_id: str,
    expected_start_s: float,
    lease_s: float,
    run_s: float = 0.0,
    device_model: str = "",
) -> site_link_service_pb2.OfferAnswer:
    """The answer to an offer that holds a job."""
    return site_link_service_pb2.OfferAnswer(
        accepted=True,
        reservation_id=reservation_id,
        expected_start_s=expected_start_s,
        lease_s=lease_s,
        run_s=run_s,
        device_model=device_model,
    )


def with_partition(settings: SlurmSettings, partition: str) -> SlurmSettings:
    """The settings with the partition resolved (the cluster's default when unset)."""
    return dataclasses.replace(settings, partition=partition)


def _write_script(
    folder: Path,
    script: str,
    checkpoints: TaskCheckpoints | None,
    policy: jobs_pb2.Checkpoint | None,
    restore: jobs_pb2.CheckpointRecord | None,
) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    if checkpoints is not None:
        checkpoints.prepare(None)  # Slurm runs the job as the agent's account
    if policy is not None:
        save_policy(folder, policy, restore)
    path = folder / "job.sh"
    path.write_text(script)
    path.chmod(0o700)


def _prepare_container(
    folder: Path,
    account: Account,
    checkpoints: TaskCheckpoints | None,
    env: dict[str, str],
    login: jobs_pb2.ImagePullSecret | None,
) -> None:
    """The job's folder the agent's (others may pass through it, not list it), the
    container's folder and checkpoint folder the tenant's, its variables and its registry
    login in files of the agent's alone."""
    agent_folder(folder)
    private_folder(folder / WORK_FOLDER, account)
    if checkpoints is not None:
        checkpoints.prepare(account)
    write_env_file(folder / CONTAINER_ENV, env)
    (folder / PULL_AUTH).unlink(missing_ok=True)
    if login is not None:
        write_auth_file(folder / PULL_AUTH, [login])
