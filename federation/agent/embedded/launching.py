"""Starting a task's replicas on the embedded core's nodes: each one's environment, its
account, its folders, and its process (under a supervisor), in its image where it names one."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Awaitable, Callable
from pathlib import Path

from federation.agent.accounts import (
    Account,
    NoAccountError,
    TaskAccounts,
    agent_folder,
    private_folder,
)
from federation.agent.containers import ENV_FILE, Containers, container_name, device_args
from federation.agent.device_env import SHARING_VARS, device_env
from federation.agent.embedded.folders import TaskFolders
from federation.agent.embedded.task import Task
from federation.agent.process import ReplicaProcess, ReplicaStartError
from federation.agent.task_records import TaskRecords
from federation.api.v1 import jobs_pb2, resources_pb2
from federation.common.keys import RunKey

INHERITED_ENV = frozenset(
    {
        "PATH",
        "HOME",
        "USER",
        "LOGNAME",
        "SHELL",
        "LANG",
        "LC_ALL",
        "LC_CTYPE",
        "TZ",
        "TMPDIR",
        "LD_LIBRARY_PATH",
        "CUDA_HOME",
        "ASCEND_HOME_PATH",
        "NEURON_RT_ROOT",
    }
)


class ReplicaLauncher:
    """Starts replicas of the core's tasks.

    Args:
        nodes: The site's nodes by name (the devices a replica is given are theirs).
        site: Site name, given to tasks as ``FEDERATION_SITE``.
        folders: Where each replica runs.
        containers: Runs the replicas of tasks that name an image.
        accounts: Who runs each tenant's tasks; None: the agent itself.
        kill_grace_s: Time between SIGTERM and SIGKILL when a replica is stopped.
        records: The task records, whose owner file each supervisor watches; None: none.
        on_pulled: Called after an image was pulled (the nodes' images are read again).
    """

    def __init__(
        self,
        nodes: dict[str, resources_pb2.Node],
        *,
        site: str,
        folders: TaskFolders,
        containers: Containers,
        accounts: TaskAccounts | None,
        kill_grace_s: float,
        records: TaskRecords | None,
        on_pulled: Callable[[], Awaitable[None]],
    ) -> None:
        self._nodes = nodes
        self._site = site
        self._folders = folders
        self._containers = containers
        self._accounts = accounts
        self._kill_grace_s = kill_grace_s
        self._records = records
        self._on_pulled = on_pulled

    def replica_env(self, task: Task, replica: int) -> dict[str, str]:
        slot = task.slots[replica]
        node = self._nodes[slot.node]
        # Only the basics of the agent's own environment: it may hold the agent's secrets.
        env = {k: v for k, v in os.environ.items() if k in INHERITED_ENV}
        env.update(task.spec.env)
        for name in SHARING_VARS:
            env.pop(name, None)
        # Set last: a task's own env must not widen what it was given.
        env.update(
            FEDERATION_JOB_ID=task.key[0],
            FEDERATION_TASK=task.key[1],
            FEDERATION_EPOCH=str(task.key[2]),
            FEDERATION_SITE=self._site,
            FEDERATION_REPLICA=str(replica),
            FEDERATION_REPLICAS=str(len(task.slots)),
        )
        env.update(device_env(node, slot))
        if task.checkpoints is not None:
            env.update(task.checkpoints.env())
        if task.service is not None:
            env["FEDERATION_PORT"] = str(task.service[replica].port)
        if task.gang_peers:  # a part of a gang across sites: its rendezvous
            rank = task.gang_rank + replica
            env.update(
                FEDERATION_GANG_PEERS=",".join(task.gang_peers),
                FEDERATION_GANG_RANK=str(rank),
                FEDERATION_GANG_SIZE=str(len(task.gang_peers)),
                FEDERATION_GANG_PORT=task.gang_peers[
                    min(rank, len(task.gang_peers) - 1)
                ].rpartition(":")[2],
            )
        return env

    def account(self, task: Task) -> Account | None:
        """The account the task runs as; ReplicaStartError when the site has none for it."""
        try:
            return self._accounts.for_tenant(task.tenant) if self._accounts else None
        except NoAccountError as exc:
            raise ReplicaStartError(str(exc), 0) from None

    async def start_replica(self, task: Task, replica: int, account: Account | None) -> None:
        """Starts (or starts again) one replica, in its folder, as ``task.replicas[replica]``."""
        cwd, env = self._folders.task_dir(task.key) / str(replica), self.replica_env(task, replica)
        argv = list(task.spec.command)
        if task.spec.image:
            argv, env = await self._in_container(task, replica, account, cwd, env)
            account = None  # podman runs as the agent; the container as the account
        process = await ReplicaProcess.start(
            argv,
            cwd=cwd,
            env=env,
            run_dir=self._folders.run_dir(task.key, replica),
            account=account,
            grace_s=self._kill_grace_s,
            owner=self._records.owner if self._records is not None else None,
        )
        self.bind_container(task.key, task.spec, replica, process)
        if replica < len(task.replicas):
            task.replicas[replica] = process
        else:
            task.replicas.append(process)
        if task.service is not None:
            task.service[replica].revision = task.revision
            task.service[replica].checked = False

    async def _in_container(
        self, task: Task, replica: int, account: Account | None, cwd: Path, env: dict[str, str]
    ) -> tuple[list[str], dict[str, str]]:
        """The ``podman run`` that runs the replica in its image, and podman's environment;
        pulls the image first if the node does not have it."""
        if account is None:
            raise ReplicaStartError("containers run as the tenant's account: this site has none", 0)
        if await self._containers.pull(task.spec.image, task.spec.image_pull_secrets):
            await self._on_pulled()
        slot = task.slots[replica]
        devices = device_args(self._nodes[slot.node], slot)
        # The image's own PATH and libraries, not the host's; what the task set stays.
        env = {k: v for k, v in env.items() if k not in INHERITED_ENV or k in task.spec.env}
        home = account.home or str(cwd)
        env.update(HOME=home, USER=account.name, LOGNAME=account.name)
        if devices and "CUDA_VISIBLE_DEVICES" in env:
            # The container holds only its own GPUs, numbered from 0.
            env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, range(len(slot.device_positions))))
        mounts = [cwd]
        for variable in ("FEDERATION_CHECKPOINT_DIR", "FEDERATION_RESTORE_FROM"):
            if variable in env and not Path(env[variable]).is_relative_to(cwd):
                mounts.append(Path(env[variable]))
        run_dir = self._folders.run_dir(task.key, replica)
        await asyncio.to_thread(private_folder, run_dir, None)
        return self._containers.command(
            container_name(self._folders.work_dir, task.key, replica),
            task.spec.image,
            list(task.spec.command),
            uid=account.uid,
            gid=account.gid,
            cwd=cwd,
            mounts=mounts,
            env=env,
            env_file=run_dir / ENV_FILE,
            cpu=slot.cpu,
            memory_mib=slot.memory_mib,
            devices=devices,
        )

    def bind_container(
        self, key: RunKey, spec: jobs_pb2.TaskSpec, replica: int, process: ReplicaProcess
    ) -> None:
        """A container replica's container, and the file of its environment, go when the
        replica has ended."""
        if not spec.image:
            return
        name = container_name(self._folders.work_dir, key, replica)

        async def clean_up() -> None:
            await self._containers.remove(name)
            (process.run_dir / ENV_FILE).unlink(missing_ok=True)

        process.after_exit = clean_up

    def make_dirs(self, task: Task) -> None:
        """Creates the task's folders (again: a retried start takes those there). Blocking."""
        # The folders above the replicas' are the agent's, so no task can put a link where
        # another task's folder goes; each replica's is its account's alone.
        base = self._folders.task_dir(task.key)
        account = self.account(task)
        agent_folder(base)
        private_folder(self._folders.run_dir(task.key, 0).parent, None)
        for replica in range(len(task.slots)):
            private_folder(base / str(replica), account)
        if task.checkpoints is not None:
            self._folders.reopen(task.key, task.checkpoints.restore_from)
            task.checkpoints.prepare(account)

    async def start_replicas(self, task: Task) -> None:
        account = self.account(task)
        try:
            await asyncio.to_thread(self.make_dirs, task)
        except OSError as exc:
            # No replica ran, so there is no exit code to report.
            raise ReplicaStartError(f"cannot create working directory: {exc}", 0) from exc
        for replica in range(len(task.slots)):
            await self.start_replica(task, replica, account)
