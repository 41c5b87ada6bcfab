"""``fed-datacenter-agent``: a site agent for datacenter and cloud sites.

Besides the embedded core it offers ``scheduler = "slurm"``, which delegates to the site's Slurm,
and ``scheduler = "ray"``, which delegates to an existing Ray cluster (the ``ray`` extra),
whose autoscaler launches the site's node types with ``[elastic] provider = "ray"``.
"""

from __future__ import annotations

import importlib.util

from datacenter_agent.ray_cluster.autoscaler import RayAutoscalerProvider
from datacenter_agent.ray_cluster.core import RayCore
from datacenter_agent.slurm.core import SlurmCore
from federation.agent.accounts import task_accounts
from federation.agent.config import AgentConfig
from federation.agent.core import ChangeCallback, StatusCallback
from federation.agent.inventory import load_inventory
from federation.agent.main import (
    compat_table,
    elastic_nodes,
    node_types,
    run_agent,
    task_data,
)
from federation.config import ConfigError


async def start_slurm_core(
    config: AgentConfig, on_status: StatusCallback, on_change: ChangeCallback
) -> SlurmCore:
    """The core of a ``scheduler = "slurm"`` agent, started (Slurm read once).

    Raises:
        ConfigError: A setting that cannot apply to a Slurm site.
    """
    if config.inventory:
        raise ConfigError("inventory does not apply to Slurm sites: Slurm describes the nodes")
    work_dir = config.work_dir or config.state_dir / "work"
    accounts = None
    if config.task_user or config.task_accounts or config.task_uid_range:
        # Slurm runs every job as the account that submits it (the agent's): the tenants'
        # accounts are those their containers run as (tasks that name an image).
        accounts = task_accounts(
            accounts=config.task_accounts,
            uid_range=config.task_uid_range,
            shared_user=config.task_user,
            as_agent=True,
            state_dir=config.state_dir,
            work_dir=work_dir,
        )
    core = SlurmCore(
        config.slurm,
        site=config.site,
        work_dir=work_dir,
        on_status=on_status,
        on_change=on_change,
        kill_grace_s=config.kill_grace_s,
        compat=compat_table(config),
        containers=config.containers,
        accounts=accounts,
    )
    await core.start()
    return core


async def start_ray_core(
    config: AgentConfig, on_status: StatusCallback, on_change: ChangeCallback
) -> RayCore:
    """The core of a ``scheduler = "ray"`` agent, connected to the head (its jobs adopted).

    Raises:
        ConfigError: A setting that cannot apply to a Ray site, or Ray is not installed.
    """
    if config.task_user or config.task_accounts or config.task_uid_range:
        raise ConfigError(
            "task_user, task_accounts and task_uid_range do not apply to Ray sites: Ray runs "
            "jobs as the account its nodes run as. To fix: drop them"
        )
    if config.inventory and (not config.elastic.provider or load_inventory(config.inventory)):
        raise ConfigError(
            "inventory does not apply to Ray sites: Ray describes the nodes (an elastic Ray "
            "site's inventory declares node_types only)"
        )
    if importlib.util.find_spec("ray") is None:
        raise ConfigError(
            'scheduler = "ray" needs Ray\'s client. To fix: pip install "federation[ray]"'
        )
    elastic, autoscaler = None, None
    if config.elastic.provider == "ray":
        autoscaler = RayAutoscalerProvider(
            node_types(config), timeout_s=config.elastic.launch_timeout_s
        )
        elastic = elastic_nodes(config, autoscaler)
        assert elastic is not None
        autoscaler.delays = elastic.delays  # the launch timeout follows the learned p90
    core = RayCore(
        config.ray,
        site=config.site,
        work_dir=config.work_dir or config.state_dir / "work",
        on_status=on_status,
        on_change=on_change,
        kill_grace_s=config.kill_grace_s,
        compat=compat_table(config),
        elastic=elastic,
        autoscaler=autoscaler,
        data=task_data(config),
    )
    await core.start()
    return core


def main(argv: list[str] | None = None) -> None:
    run_agent(
        argv,
        prog="fed-datacenter-agent",
        domain="datacenter",
        cores={"slurm": start_slurm_core, "ray": start_ray_core},
    )


if __name__ == "__main__":
    main()
