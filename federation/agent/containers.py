"""Replicas of tasks that name an OCI image, run with rootful Podman under the supervisor.

The supervisor runs ``podman run`` (as the agent: root) in place of the task's program; the
container then keeps what a bare replica is given: the tenant's uid and gid (``--user``, no
capabilities, no new privileges), the same work folder at the same path as its working
directory, the same environment, the host's network, the spec's cpu and memory as limits, and
only the devices it was granted. ``podman run`` stays attached, so the container's output is
the replica's output and its exit code the replica's; a SIGTERM to it is passed on to the
container's init (``--init``), which passes it on to the command. A container is removed once
its replica has ended however it ended (``remove``): a SIGKILL reaches ``podman run`` only, not
the container, which ``podman rm --force`` then kills.

Images are pulled once per node: a replica whose image is in the node's store starts from it
(``--pull=never``), and a pull that fails fails the task with the registry's answer. The images
in the store are published with the node (``images``), each with the bytes a pull of it moves
(its manifest's config and layers, as the store keeps the manifest it pulled), so placement
charges a pull only where no node holds the image.

A task may bring a login for its image's registry (``image_pull_secrets``). The pull then
runs with ``--authfile`` naming a file written for that pull alone (``write_auth_file``: the
agent's, mode 0600, in the agent's state folder, never the task's) and removed as soon as the
pull is done, whatever its outcome; the login is never logged, and the replica's process
never sees it. A task without a login for the image's registry pulls with the operator's
credentials (``REGISTRY_AUTH_FILE``, root's ``podman login``), as before. An image in the
node's store is run without a pull, so without checking a login (as Kubernetes'
``IfNotPresent``).
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import json
import os
import re
import shutil
import tempfile
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import structlog

from federation.agent.accounts import TaskAccounts
from federation.agent.process import ReplicaStartError
from federation.agent.usage import Slot
from federation.api.v1 import jobs_pb2, resources_pb2
from federation.common.view_limits import MAX_IMAGE_REFERENCES, MAX_NODE_IMAGES
from federation.config import positive
from federation.images import ImageReferenceError, parse_image

log = structlog.get_logger()

ENV_FILE = "container.env"
"""In the replica's run folder (the agent's alone): the environment podman gives the
container. Given as a file, not through podman's own environment, which a task's variables
(HOME, TMPDIR, CONTAINERS_CONF...) would otherwise steer."""
CDI_DIRS = (Path("/etc/cdi"), Path("/var/run/cdi"))
_PODMAN_ENV = ("HOME", "CONTAINERS_CONF", "CONTAINERS_REGISTRIES_CONF", "REGISTRY_AUTH_FILE")
"""The agent's own variables podman runs with (operators set these); no task's."""
_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
IMAGE_REFRESH_S = 300.0
"""How often the agent reads its store's images again, beside after each pull."""
_NVIDIA_CONTROL = ("/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools")
_CDI_GPU = "nvidia.com/gpu"


@dataclass(frozen=True, slots=True)
class ContainerSettings:
    """Tasks from OCI images: the ``[containers]`` table of an agent's config."""

    enabled: bool = True
    """Run tasks that name an image (needs Podman, and the agent running as root); false:
    offers of them are declined, saying so."""
    registries: list[str] = field(default_factory=list)
    """Registries (host[:port]) images may come from; empty: any."""
    insecure_registries: list[str] = field(default_factory=list)
    """Registries reached over plain HTTP or with an unverified certificate (a registry on
    loopback, say): pulled with ``--tls-verify=false``."""
    podman: str = "podman"
    """The podman program, by name on the agent's PATH or by path."""
    pull_timeout_s: float = field(default=900.0, metadata=positive())
    """A pull that takes longer fails the task."""
    storage: str = ""
    """A Podman store of this agent's own, in this folder (``store_flags``); empty: the
    host's. For agents that share a host but should each hold their own images."""


def store_flags(folder: Path) -> list[str]:
    """Podman's options for the store in ``folder``: its images and containers there, its run
    state in /run/fedpod-<hash of the folder> (podman takes no run folder over 50 characters)."""
    root = folder.absolute()
    digest = hashlib.sha256(str(root).encode()).hexdigest()[:12]
    return [f"--root={root}", f"--runroot=/run/fedpod-{digest}"]


def container_name(work_dir: Path, key: tuple[str, str, int], replica: int) -> str:
    """Names one replica's container for good: a restarted agent finds it by this name.

    Readable (job, task, epoch, replica) and unique on the host (a hash that includes the
    agent's work folder: several agents may share one host's Podman).
    """
    job_id, task, epoch = key
    digest = hashlib.sha256(f"{work_dir}\0{job_id}\0{task}\0{epoch}\0{replica}".encode())
    readable = re.sub(r"[^a-zA-Z0-9_.-]+", "-", f"{job_id}-{task}")[:80]
    return f"fed-{readable}-{epoch}-{replica}-{digest.hexdigest()[:12]}"


class Containers:
    """A node's Podman: which images it may run, pulling them once, running replicas."""

    def __init__(
        self,
        settings: ContainerSettings,
        work_dir: Path,
        *,
        local: bool = True,
        auth_dir: Path | None = None,
    ) -> None:
        """``local``: Podman runs on this host; False: on the nodes a scheduler (Slurm) gives
        each job, where this agent cannot look (it checks only its settings then).
        ``auth_dir``: where a pull's login file is written for the pull (the agent's state
        folder); None: a private temporary folder, made at the first such pull."""
        self._settings = settings
        self._auth_dir = auth_dir
        self._work_dir = work_dir
        self._local = local
        self._podman = shutil.which(settings.podman) if local else settings.podman
        self._pulls: dict[str, asyncio.Lock] = {}
        self._store: Path | None = None
        """Where the store keeps its images' files (``podman info``), once asked."""
        self._store_flags: list[str] = []
        if settings.storage:
            self._store_flags = store_flags(Path(settings.storage))

    @property
    def registries(self) -> list[str]:
        """The registries images may come from; empty: any."""
        return list(self._settings.registries)

    @property
    def settings(self) -> ContainerSettings:
        return self._settings

    def policy(self, accounts: TaskAccounts | None) -> tuple[str, list[str]]:
        """Why this site runs no image ("": it runs them), and the registries it pulls from:
        a site whose tasks run as the agent's own account runs none (containers take the
        tenant's)."""
        refusal = self.site_refusal()
        if not refusal and not (accounts is not None and accounts.switches):
            refusal = (
                "this site cannot run containers: its tasks run as the agent's own account "
                "(containers take the tenant's: set task_uid_range, task_accounts or task_user)"
            )
        return refusal, self.registries

    def site_refusal(self) -> str:
        """Why this site runs no image at all, or "" (then ``refusal`` checks each image)."""
        if not self._settings.enabled:
            return "this site does not run containers: [containers] enabled = false"
        if self._local and self._podman is None:
            return f"this site cannot run containers: {self._settings.podman} is not installed"
        if os.geteuid() != 0:
            return "this site cannot run containers: its agent does not run as root"
        return ""

    def refusal(self, image: str) -> str:
        """Why this site does not run ``image``, or ""."""
        if problem := self.site_refusal():
            return f"{problem} (image {image})"
        try:
            registry = parse_image(image).registry
        except ImageReferenceError as err:
            return f"image {image!r} {err}"
        allowed = self._settings.registries
        if allowed and registry not in allowed:
            return (
                f"this site runs images from {', '.join(allowed)} only, not from {registry} "
                f"(image {image})"
            )
        return ""

    async def pull(self, image: str, secrets: Sequence[jobs_pb2.ImagePullSecret] = ()) -> bool:
        """Makes sure ``image`` is in the node's store: pulled once, then found there. True
        if it was pulled now. ``secrets``: the task's registry logins; the one for the
        image's registry, if any, is used for this pull alone.

        Raises:
            ReplicaStartError: The pull failed; the message names the image and has the
                registry's answer.
        """
        async with self._pulls.setdefault(image, asyncio.Lock()):
            code, _ = await self._podman_run("image", "exists", image)
            if code == 0:
                log.info("image_cached", image=image)
                return False
            started = time.monotonic()
            login = login_for(image, secrets)
            authfile = self._auth_file() if login is not None else None
            try:
                if authfile is not None and login is not None:
                    write_auth_file(authfile, [login])
                code, answer = await asyncio.wait_for(
                    self._podman_run(*pull_args(self._settings, image, authfile)),
                    self._settings.pull_timeout_s,
                )
            except TimeoutError:
                limit = self._settings.pull_timeout_s
                why = f"not done within {limit:g}s"
                raise ReplicaStartError(pull_failure(image, why), 0) from None
            finally:
                if authfile is not None:
                    authfile.unlink(missing_ok=True)
            if code != 0:
                log.warning("image_pull_failed", image=image, answer=answer)
                raise ReplicaStartError(pull_failure(image, answer), 0)
            log.info("image_pulled", image=image, seconds=round(time.monotonic() - started, 3))
            return True

    def _auth_file(self) -> Path:
        """A new path for one pull's login file, in a folder only the agent reads."""
        if self._auth_dir is None:
            self._auth_dir = Path(tempfile.mkdtemp(prefix="fed-pull-auth-"))
        self._auth_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        self._auth_dir.chmod(0o700)
        return self._auth_dir / f"pull-{uuid.uuid4().hex}.json"

    async def images(self) -> list[resources_pb2.CachedImage]:
        """The images in the node's store, newest first (at most ``MAX_NODE_IMAGES``), each
        with its names and digests, its size and the bytes a pull of it moves; [] where this
        site runs no containers or podman cannot list them."""
        if self.site_refusal():
            return []
        code, listed = await self._podman_out("images", "--format=json")
        if code != 0:
            log.warning("images_not_listed", answer=listed)
            return []
        store = await self._image_store()
        seen: dict[str, resources_pb2.CachedImage] = {}
        entries = json.loads(listed or "[]")
        for entry in sorted(entries, key=lambda e: -int(e.get("Created") or 0)):
            image_id = str(entry.get("Id", ""))
            if not image_id or image_id in seen or len(seen) >= MAX_NODE_IMAGES:
                continue
            names = [*(entry.get("Names") or []), *(entry.get("RepoDigests") or [])]
            seen[image_id] = resources_pb2.CachedImage(
                references=list(dict.fromkeys(names))[:MAX_IMAGE_REFERENCES],
                id=image_id,
                size_bytes=max(0, int(entry.get("Size") or 0)),
                pull_bytes=pull_bytes(store / image_id / "manifest") if store else 0,
            )
        return list(seen.values())

    async def _image_store(self) -> Path | None:
        """The folder the store keeps each image's files in (its manifest among them)."""
        if self._store is None:
            code, out = await self._podman_out(
                "info", "--format={{.Store.GraphRoot}} {{.Store.GraphDriverName}}"
            )
            root, _, driver = out.strip().rpartition(" ")
            if code != 0 or not root:
                return None
            self._store = Path(root) / f"{driver}-images"
        return self._store

    def command(
        self,
        name: str,
        image: str,
        argv: list[str],
        *,
        uid: int,
        gid: int,
        cwd: Path,
        mounts: list[Path],
        env: Mapping[str, str],
        env_file: Path,
        cpu: float,
        memory_mib: int,
        devices: list[str],
    ) -> tuple[list[str], dict[str, str]]:
        """The ``podman run`` command line for one replica and the environment podman runs
        with; writes the container's environment to ``env_file`` (values may hold no newline).
        """
        assert self._podman is not None
        run = run_args(
            name,
            image,
            argv,
            work_dir=self._work_dir,
            uid=uid,
            gid=gid,
            cwd=cwd,
            mounts=mounts,
            env_file=env_file,
            cpu=cpu,
            memory_mib=memory_mib,
            devices=devices,
        )
        write_env_file(env_file, env)
        return [self._podman, *self._store_flags, *run], podman_env(os.environ)

    async def remove(self, name: str) -> None:
        """Kills and removes the container, if it is still there."""
        code, answer = await self._podman_run("rm", "--force", "--ignore", "--time=0", name)
        if code != 0:
            log.warning("container_not_removed", container=name, answer=answer)

    async def _podman_run(self, *args: str) -> tuple[int, str]:
        """Runs podman; its exit code and the last line it wrote to stderr (its error)."""
        code, _, answer = await self._podman_call(args, keep_output=False)
        return code, answer

    async def _podman_out(self, *args: str) -> tuple[int, str]:
        """Runs podman; its exit code and what it wrote to stdout, or its error."""
        code, out, answer = await self._podman_call(args, keep_output=True)
        return code, out if code == 0 else answer

    async def _podman_call(
        self, args: tuple[str, ...], *, keep_output: bool
    ) -> tuple[int, str, str]:
        assert self._podman is not None
        process = await asyncio.create_subprocess_exec(
            self._podman,
            *self._store_flags,
            *args,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE if keep_output else asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.PIPE,
            env=podman_env(os.environ),
        )
        try:
            out, err = await process.communicate()
        except asyncio.CancelledError:
            process.kill()
            await process.wait()
            raise
        lines = err.decode(errors="replace").strip().splitlines()
        answer = lines[-1].removeprefix("Error: ") if lines else ""
        return process.returncode or 0, (out or b"").decode(errors="replace"), answer


def podman_env(environ: Mapping[str, str]) -> dict[str, str]:
    """The environment podman runs with: a fixed PATH and the operator's podman variables
    (``HOME``, ``CONTAINERS_CONF``, ``REGISTRY_AUTH_FILE``...) from ``environ``; no task's."""
    return {"PATH": _PATH, **{k: v for k, v in environ.items() if k in _PODMAN_ENV}}


def pull_failure(image: str, answer: str) -> str:
    """A task's reason when its image cannot be pulled: the image and the registry's answer."""
    return f"cannot pull image {image}: {answer}"


def pull_args(settings: ContainerSettings, image: str, authfile: Path | None = None) -> list[str]:
    """Podman's arguments (after the program and store flags) that pull ``image``, with the
    login in ``authfile`` if one is given."""
    registry = parse_image(image).registry
    tls = ["--tls-verify=false"] if registry in settings.insecure_registries else []
    auth = [f"--authfile={authfile}"] if authfile is not None else []
    return ["pull", "--quiet", *tls, *auth, image]


def login_for(
    image: str, secrets: Sequence[jobs_pb2.ImagePullSecret]
) -> jobs_pb2.ImagePullSecret | None:
    """The task's login for its image's registry, or None."""
    if not secrets:
        return None
    registry = parse_image(image).registry
    return next((s for s in secrets if s.registry == registry), None)


def auth_json(secrets: Sequence[jobs_pb2.ImagePullSecret]) -> str:
    """Logins as a containers-auth.json(5) file: ``{"auths": {registry: {"auth": ...}}}``."""
    auths = {
        s.registry: {"auth": base64.b64encode(f"{s.username}:{s.password}".encode()).decode()}
        for s in secrets
    }
    return json.dumps({"auths": auths})


def write_auth_file(path: Path, secrets: Sequence[jobs_pb2.ImagePullSecret]) -> None:
    """Writes the logins to ``path``, a new file readable by its owner (the agent) alone."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    with open(fd, "w", encoding="utf-8") as out:
        out.write(auth_json(secrets))


def env_lines(env: Mapping[str, str]) -> list[str]:
    """A container's environment as ``--env-file`` lines.

    Raises:
        ReplicaStartError: A value holds a line break, which such a file cannot carry.
    """
    lines = []
    for key, value in env.items():
        if "\n" in value or "\r" in value:
            raise ReplicaStartError(
                f"env {key}: a container's variable may not hold a line break", 126
            )
        lines.append(f"{key}={value}\n")
    return lines


def write_env_file(path: Path, env: Mapping[str, str]) -> None:
    """Writes the container's environment to ``path``, readable by its owner (the agent)
    alone: the task's variables may be secrets, so they are not on podman's command line."""
    lines = env_lines(env)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    with open(fd, "w", encoding="utf-8") as out:
        out.writelines(lines)


def run_args(
    name: str,
    image: str,
    argv: list[str],
    *,
    work_dir: Path,
    uid: int,
    gid: int,
    cwd: Path,
    mounts: list[Path],
    env_file: Path,
    cpu: float,
    memory_mib: int,
    devices: list[str],
) -> list[str]:
    """Podman's arguments (after the program and store flags) that run one replica of a task
    in ``image``, as the embedded core and the Slurm batch script both run it: the tenant's
    uid and gid, no capabilities, its folder at the same path as its working directory, the
    host's network, the spec's limits, the devices given (``devices``: any options that
    belong to this one run).

    Raises:
        ReplicaStartError: The account is root.
    """
    if uid == 0 or gid == 0:
        raise ReplicaStartError("containers run as the tenant's account, never as root", 126)
    volumes = [f"--volume={path}:{path}" for path in dict.fromkeys(mounts)]
    limits = [f"--cpus={cpu:g}"] if cpu > 0 else []
    limits += [f"--memory={memory_mib}m"] if memory_mib > 0 else []
    return [
        "run",
        "--rm",
        "--replace",  # a replica restarted at once (or a requeued job) reuses its name
        f"--name={name}",
        f"--label=federation.work_dir={work_dir}",
        "--pull=never",  # pulled beforehand, once per node
        "--init",  # passes the stop's SIGTERM on to the command
        f"--user={uid}:{gid}",
        "--cap-drop=all",
        "--security-opt=no-new-privileges",
        "--umask=0077",
        "--network=host",  # as a bare replica: a service's port is the host's
        f"--workdir={cwd}",
        f"--env-file={env_file}",
        "--log-driver=none",  # the output goes to the supervisor (or Slurm's file) alone
        *volumes,
        *limits,
        *devices,
        "--",
        image,
        *argv,
    ]


def pull_bytes(manifest: Path) -> int:
    """The bytes a pull of an image moves: the config and layers its manifest lists (layers as
    the registry sends them, compressed); 0 if the manifest cannot be read (an image loaded
    from an archive has none, a list of manifests names no layers)."""
    try:
        text = manifest.read_text()
        parsed = json.loads(text)
        blobs = [parsed["config"], *parsed["layers"]]
        return len(text.encode()) + sum(int(blob["size"]) for blob in blobs)
    except (OSError, ValueError, KeyError, TypeError):
        return 0


def device_args(node: resources_pb2.Node, slot: Slot) -> list[str]:
    """``--device`` options for the slot's devices: NVIDIA GPUs by their CDI name where the
    host has a CDI spec for them (the driver's libraries come with it), their /dev nodes
    otherwise (the image must then bring libraries matching the host's driver).

    Raises:
        ReplicaStartError: A device this site cannot give a container (shares, partitions and
            other vendors' devices are not supported yet).
    """
    held = [node.devices[pos] for pos in slot.device_positions]
    if not held:
        return []
    if slot.fraction or slot.partition:
        raise ReplicaStartError("containers take whole devices only at this site", 126)
    for device in held:
        if device.vendor.lower() != "nvidia" or device.kind != resources_pb2.DEVICE_KIND_GPU:
            raise ReplicaStartError("containers take NVIDIA GPUs only at this site", 126)
    return gpu_device_args([d.index for d in held])


def gpu_device_args(indices: list[int]) -> list[str]:
    """``--device`` options for the NVIDIA GPUs of these indices on this host: their CDI names
    where it has a CDI spec for them, else their /dev nodes and the driver's control nodes.
    ``GPU_DEVICES_SHELL`` makes the same options on a node this agent cannot look at."""
    if _has_cdi(_CDI_GPU):
        return [f"--device={_CDI_GPU}={i}" for i in indices]
    nodes = [f"/dev/nvidia{i}" for i in indices]
    nodes += [path for path in _NVIDIA_CONTROL if os.path.exists(path)]
    return [f"--device={path}" for path in nodes]


_CDI_GLOBS = " ".join(f"{folder}/*.json {folder}/*.yaml" for folder in CDI_DIRS)
GPU_DEVICES_SHELL = (
    # ``gpu_device_args`` in sh, for a batch script: appends the options to "$@" for the
    # indices in $gpus (separated by commas), as found on the node the job runs on.
    f'if grep -qs -F {_CDI_GPU} {_CDI_GLOBS}; then cdi=1; else cdi=""; fi; '
    "for i in $(echo \"$gpus\" | tr ',' ' '); do "
    f'if [ -n "$cdi" ]; then set -- "$@" "--device={_CDI_GPU}=$i"; '
    'else set -- "$@" "--device=/dev/nvidia$i"; fi; done; '
    'if [ -z "$cdi" ] && [ -n "$gpus" ]; then '
    f"for path in {' '.join(_NVIDIA_CONTROL)}; do "
    '[ -e "$path" ] && set -- "$@" "--device=$path"; done; fi'
)


def _has_cdi(kind: str) -> bool:
    # GPU_DEVICES_SHELL's grep does the same on a node
    for folder in CDI_DIRS:
        try:
            for spec in folder.iterdir():
                if spec.suffix in (".json", ".yaml") and kind in spec.read_text(errors="replace"):
                    return True
        except OSError:
            continue
    return False
