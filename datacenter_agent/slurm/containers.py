"""Tasks from OCI images on a Slurm site: the batch script runs them with the node's Podman.

The job runs as the agent's account (root: Podman is rootful, as on embedded sites), and the
container as the embedded core runs it, with the same options (``containers.run_args``): the
tenant's uid and gid, no capabilities, its folder ``JOB/TASK/EPOCH/0`` (the tenant's; the
job's own folder stays the agent's) at the same path as its working directory, the checkpoint
folder mounted at its path, the spec's cpu and memory as limits, and only the GPUs Slurm gave
the job (CDI names where the node has a CDI spec, /dev nodes otherwise). The task's variables
reach the container through a file only the agent's account reads (``container.env`` in the
job's folder), never through the script's text. So does the task's login for its image's
registry (``image_pull_secrets``): ``pull-auth.json`` in the job's folder, the agent's alone
(mode 0600), which the script gives ``podman pull --authfile``; the agent removes it with the
environment file once the job has ended (not after the first pull: a requeued job may pull
again, on another node).

On the node the script first makes sure the image is in the store (pulled once per node, then
found there; the site's store flags), and a pull that fails writes its reason (the image and
the registry's answer) to ``container-failed`` in the job's folder, where the agent reads it as
the task's reason. ``podman run`` stays attached: the container's output is the job's output
and its exit code the job's. A SIGTERM (the core's ``scancel --signal=TERM --full``) reaches
``podman run``, which passes it on to the container's init and so to the command; a second
one (``scancel``, after the grace) has the script kill and remove the container, which Slurm's
own SIGKILL would not reach (Podman's conmon leaves the job's processes).
"""

from __future__ import annotations

import shlex
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from datacenter_agent.slurm.job import (
    DEVICES_PRELUDE,
    read_restore,
    script_header,
    task_variables,
)
from federation.agent.accounts import Account
from federation.agent.containers import (
    GPU_DEVICES_SHELL,
    ContainerSettings,
    container_name,
    login_for,
    podman_env,
    pull_args,
    pull_failure,
    run_args,
    store_flags,
)
from federation.api.v1 import jobs_pb2
from federation.common.keys import RunKey

CONTAINER_ENV = "container.env"
"""In the job's folder (the agent's): the container's environment."""
PULL_AUTH = "pull-auth.json"
"""In the job's folder (the agent's, mode 0600): the task's login for its image's registry,
if it gave one."""
CONTAINER_FAILED = "container-failed"
"""In the job's folder: why the container could not start (its image not pulled), if so."""
WORK_FOLDER = "0"
"""The container's folder in the job's: the tenant's, as an embedded replica's ``0``."""
PODMAN_FAILED = 125
"""The job's exit code when the container could not start (Podman's own for its errors)."""
_RUN_OPTIONS = "\0run-options\0"
"""Where the options made on the node (devices, the run's variables) go in ``run_args``."""


@dataclass(frozen=True, slots=True)
class ContainerJob:
    """How this site runs a task's image: its settings, the tenant's account, the agent's
    work folder (in container names and labels) and the agent's environment (podman's)."""

    settings: ContainerSettings
    account: Account
    work_dir: Path
    environ: Mapping[str, str]


def container_env(
    spec: jobs_pb2.TaskSpec,
    key: RunKey,
    site: str,
    account: Account,
    folder: Path,
    checkpoint_env: Mapping[str, str] | None,
) -> dict[str, str]:
    """The variables the container gets from ``container.env``: the task's and the
    federation's, its account's names and home. Those only the node knows (devices, Slurm's
    job id, the checkpoint a requeued job restores from) the script adds at run time."""
    env = task_variables(spec, key, site, checkpoint_env)
    env.pop("FEDERATION_RESTORE_FROM", None)  # given at run time: a requeue changes it
    env["FEDERATION_REPLICA"] = "0"
    home = account.home or str(folder / WORK_FOLDER)
    env.update(HOME=home, USER=account.name, LOGNAME=account.name)
    return env


def container_mounts(folder: Path, checkpoint_env: Mapping[str, str] | None) -> list[Path]:
    """What the container sees of the host: its folder, its checkpoint folder and the
    checkpoint it starts from, each at its own path."""
    work = folder / WORK_FOLDER
    mounts = [work]
    for variable in ("FEDERATION_CHECKPOINT_DIR", "FEDERATION_RESTORE_FROM"):
        path = Path((checkpoint_env or {}).get(variable, "") or "")
        if path.is_absolute() and not any(path.is_relative_to(m) for m in mounts):
            mounts.append(path)
    return mounts


def container_script(
    spec: jobs_pb2.TaskSpec,
    key: RunKey,
    *,
    site: str,
    folder: Path,
    job: ContainerJob,
    checkpoint_env: Mapping[str, str] | None = None,
    restore_file: Path | None = None,
) -> str:
    """The ``sh`` batch script of a task from an image (one replica).

    Args:
        spec: The task.
        key: Its job, name and epoch.
        site: This site's name.
        folder: The job's folder (``job_dir``).
        job: How this site runs images, and as whom.
        checkpoint_env: The task's checkpoint folder (and the checkpoint it starts from).
        restore_file: Where the agent names the checkpoint a requeued job restarts from.
    """
    settings = job.settings
    store = store_flags(Path(settings.storage)) if settings.storage else []
    podman = " ".join(
        shlex.quote(arg)
        for arg in [
            "env",
            "-i",
            *(f"{k}={v}" for k, v in podman_env(job.environ).items()),
            settings.podman,
            *store,
        ]
    )
    image = spec.image
    name = container_name(job.work_dir, key, 0)
    run = run_args(
        name,
        image,
        list(spec.command),
        work_dir=job.work_dir,
        uid=job.account.uid,
        gid=job.account.gid,
        cwd=folder / WORK_FOLDER,
        mounts=container_mounts(folder, checkpoint_env),
        env_file=folder / CONTAINER_ENV,
        cpu=spec.resources.cpu,
        memory_mib=spec.resources.memory_mib,
        devices=[_RUN_OPTIONS],
    )
    run_line = " ".join('"$@"' if arg == _RUN_OPTIONS else shlex.quote(arg) for arg in run)
    restore = (checkpoint_env or {}).get("FEDERATION_RESTORE_FROM", "")
    timeout = f"{settings.pull_timeout_s:g}"
    authfile = folder / PULL_AUTH if login_for(image, spec.image_pull_secrets) else None
    pull = " ".join(shlex.quote(arg) for arg in pull_args(settings, image, authfile))
    remove = f"pod rm --force --ignore --time=0 {shlex.quote(name)} >/dev/null 2>&1"
    lines = [
        script_header(key, site),
        f"# Runs image {image} with Podman as uid {job.account.uid}.",
        f"failed={shlex.quote(str(folder / CONTAINER_FAILED))}",
        'rm -f "$failed"',
        f'pod() {{ {podman} "$@"; }}',
        'fail() { printf "%s\\n" "$1" >"$failed"; printf "%s\\n" "$1" >&2; '
        f"exit {PODMAN_FAILED}; }}",
        # Podman on the node, and the image in its store (pulled once per node).
        "pod --version >/dev/null 2>&1",
        '[ "$?" -eq 127 ] && fail '
        + shlex.quote(f"cannot run image {image}: {settings.podman} is not installed on ")
        + '"$(hostname)"',
        "if ! pod image exists " + shlex.quote(image) + "; then",
        f"  answer=$(timeout -k 10 {timeout} {podman} {pull} 2>&1 >/dev/null); code=$?",
        '  [ "$code" -eq 124 ] && fail '
        + shlex.quote(pull_failure(image, f"not done within {timeout}s")),
        '  if [ "$code" -ne 0 ]; then',
        "    answer=$(printf '%s\\n' \"$answer\" | sed '/^[[:space:]]*$/d' | tail -n 1)",
        "    fail " + shlex.quote(pull_failure(image, "")) + '"${answer#Error: }"',
        "  fi",
        "fi",
        # What only the node knows: the GPUs Slurm gave the job, its id, the checkpoint to
        # restore from. The container holds only its own GPUs, numbered from 0.
        f"FEDERATION_RESTORE_FROM={shlex.quote(restore)}",
        *([read_restore(restore_file)] if restore_file is not None else []),
        DEVICES_PRELUDE,
        'gpus="${SLURM_STEP_GPUS:-${SLURM_JOB_GPUS:-}}"',
        "set --",
        GPU_DEVICES_SHELL,
        'if [ -n "$gpus" ]; then visible=""; n=0; '
        "for i in $(echo \"$gpus\" | tr ',' ' '); do "
        'visible="${visible:+$visible,}$n"; n=$((n + 1)); done; '
        'set -- "$@" "--env=CUDA_VISIBLE_DEVICES=$visible"; fi',
        'set -- "$@" "--env=FEDERATION_DEVICES=$FEDERATION_DEVICES" '
        '"--env=SLURM_JOB_ID=${SLURM_JOB_ID:-}" '
        '"--env=SLURM_RESTART_COUNT=${SLURM_RESTART_COUNT:-0}"',
        'if [ -n "$FEDERATION_RESTORE_FROM" ]; then '
        'set -- "$@" "--env=FEDERATION_RESTORE_FROM=$FEDERATION_RESTORE_FROM"; fi',
        # The first SIGTERM reaches podman run too, which passes it on; a second one kills.
        "stopping=''",
        'trap \'interrupted=1; if [ -n "$stopping" ]; then ' + remove + "; fi; stopping=1' TERM",
        # Not through the function: $! must be podman run's own process, not a subshell's.
        f"{podman} {run_line} &",
        # A wait the trap interrupts says 128+15; waited again, podman run's own exit code.
        'pid=$!; while :; do interrupted=""; wait "$pid"; code=$?; [ -n "$interrupted" ] || break; '
        "done",
        'exit "$code"',
    ]
    return "\n".join(lines) + "\n"
