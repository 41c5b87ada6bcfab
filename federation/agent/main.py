"""The command line shared by ``fed-edge-agent`` and ``fed-datacenter-agent``."""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import signal
import sys
from collections.abc import Awaitable, Callable, Mapping
from pathlib import Path
from typing import Any

import structlog
import yaml

from federation import __version__, tracing
from federation.agent.accounts import task_accounts
from federation.agent.config import AgentConfig, check_slurm, coordinator_endpoints
from federation.agent.core import ChangeCallback, LocalCore, StatusCallback
from federation.agent.discovery import (
    InventoryError,
    check_node_names,
    discover_host_node,
    load_inventory,
)
from federation.agent.elastic import Elastic, Provider, provider_named
from federation.agent.embedded_core import EmbeddedCore
from federation.agent.enroll import EnrollmentError, channel_options, ensure_enrolled
from federation.agent.host_watch import HostWatcher, export_gauges, readings_pace
from federation.agent.inventory import load_node_types
from federation.agent.journal import Journal
from federation.agent.links import LinkMonitor, ProbeServer, link_settings
from federation.agent.object_store import SiteStore
from federation.agent.owner_share import check_owner_share, owner_share
from federation.agent.renewal import CertificateRenewer
from federation.agent.runtime import AgentRejectedError, AgentRuntime, CertificateExpiredError
from federation.agent.state_lock import StateDirLockedError, hold_state_dir
from federation.agent.task_data import TaskData
from federation.api.v1 import resources_pb2
from federation.common.node_types import NodeType
from federation.config import ConfigError, build, read_toml
from federation.logging import LEVELS, configure_logging
from federation.metrics import serve_metrics
from federation.placement.compat import CompatTable, load_table_files

log = structlog.get_logger()

CoreFactory = Callable[[AgentConfig, StatusCallback, ChangeCallback], Awaitable[LocalCore]]
"""Builds (and starts) a local scheduler core for an agent config."""


def parse_args(argv: list[str] | None, prog: str, domain: str) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog=prog, description=f"Run a {domain} site agent.")
    p.add_argument("--version", action="version", version=f"{prog} {__version__}")
    p.add_argument("--config", type=Path, help="TOML config file")
    p.add_argument("--site", help="site name")
    p.add_argument("--domain", choices=["edge", "datacenter", "cloud"], help=f"default {domain}")
    p.add_argument("--region")
    p.add_argument(
        "--coordinator", help="coordinator mTLS address host:port (several: comma-separated)"
    )
    p.add_argument(
        "--join-address", help="coordinator join address host:port (several: comma-separated)"
    )
    p.add_argument("--ca", type=Path, help="federation CA certificate")
    p.add_argument("--token-file", type=Path, help="file holding a one-time join token")
    p.add_argument("--state-dir", type=Path, help="where the site key, cert and work live")
    p.add_argument("--inventory", type=Path, help="declared nodes and devices (YAML/TOML)")
    p.add_argument("--price-per-device-hour", type=float)
    p.add_argument("--no-host", action="store_true", help="do not publish this machine as a node")
    p.add_argument("--metrics-listen", help="serve Prometheus /metrics here, e.g. :9465")
    p.add_argument("--otlp-endpoint", help="send spans to this OTLP/gRPC collector, http://h:p")
    p.add_argument("--log-level", default="info", type=str.lower, choices=LEVELS)
    p.add_argument("--log-json", action="store_true", default=None)
    return p.parse_args(argv)


def load_config(args: argparse.Namespace, domain: str) -> AgentConfig:
    values: dict[str, Any] = {"domain": domain}
    if args.config:
        values |= read_toml(args.config)
    flags = {
        "site": args.site,
        "domain": args.domain,
        "region": args.region,
        "coordinator": args.coordinator,
        "join_address": args.join_address,
        "ca": args.ca,
        "token_file": args.token_file,
        "state_dir": args.state_dir,
        "inventory": args.inventory,
        "price_per_device_hour": args.price_per_device_hour,
        "discover_host": False if args.no_host else None,
        "metrics_listen": args.metrics_listen,
        "otlp_endpoint": args.otlp_endpoint,
    }
    values |= {k: v for k, v in flags.items() if v is not None}
    if "coordinator" not in values and values.get("coordinators"):
        values["coordinator"] = ""  # the list alone is enough
    missing = {"site", "coordinator", "ca", "state_dir"} - values.keys()
    if missing:
        raise ConfigError(
            f"missing settings: {', '.join(sorted(missing))}. To fix: pass them as flags "
            "(--site, --coordinator, --ca, --state-dir) or set them in --config"
        )
    source = str(args.config) if args.config else "flags"
    folder = args.config.parent if args.config else None  # relative paths: beside the file
    config = build(AgentConfig, values, source=source, folder=folder)
    try:
        coordinator_endpoints(config)
    except ValueError:
        raise ConfigError(f"{source}: coordinator: give at least one address") from None
    check_slurm(config.slurm, source=source)
    check_owner_share(config.owner_share, source=source)
    levels = config.topology_levels
    if any(not level for level in levels) or len(set(levels)) < len(levels):
        raise ConfigError(f"{source}: topology_levels: give distinct, non-empty label names")
    link_settings(config, source=source)  # refuse bad probe settings or declared links now
    if config.inventory:  # read now, before a join token is spent on a site that cannot start
        check_node_names(load_inventory(config.inventory), config.inventory)
    check_elastic(config, source=source)
    return config


def site_nodes(config: AgentConfig) -> list[resources_pb2.Node]:
    nodes = []
    if config.discover_host:
        nodes.append(
            discover_host_node(config.host_node_name or None, model_names=config.model_names)
        )
    if config.inventory:
        nodes += load_inventory(config.inventory)
        check_node_names(nodes, config.inventory)
    if not nodes and not config.elastic.provider:
        raise ConfigError("the site has no nodes: enable discover_host or give an inventory")
    return nodes


def compat_table(config: AgentConfig) -> CompatTable:
    """The compatibility table the site's packer reads requirements with."""
    try:
        return load_table_files((config.compat_table,) if config.compat_table else ())
    except (OSError, ValueError, yaml.YAMLError) as err:  # CompatError is a ValueError
        raise ConfigError(f"compat_table {config.compat_table}: {err}") from None


def site_store(config: AgentConfig) -> SiteStore | None:
    """The site's object store, its keys read now; None when the config names no bucket."""
    if not config.object_store.bucket:
        return None
    return SiteStore(config.object_store, source="object_store")


def core_data(core: LocalCore) -> TaskData | None:
    """The stage-in and store of a core that stages inputs and stores outputs (the
    embedded and Ray cores); None for one that does neither."""
    data = getattr(core, "data", None)
    return data if isinstance(data, TaskData) else None


def task_data(config: AgentConfig) -> TaskData:
    """The site's stage-in and store, as its config describes them."""
    return TaskData(
        site_store(config), config.site, config.object_store, scratch=config.state_dir / "scratch"
    )


async def embedded_core(
    config: AgentConfig, on_status: StatusCallback, on_change: ChangeCallback
) -> LocalCore:
    """The default core: tasks run as processes on the site's discovered and declared nodes,
    taking over those the agent before it left running."""
    work_dir = config.work_dir or config.state_dir / "work"
    accounts = task_accounts(
        accounts=config.task_accounts,
        uid_range=config.task_uid_range,
        shared_user=config.task_user,
        as_agent=config.run_tasks_as_agent,
        state_dir=config.state_dir,
        work_dir=work_dir,
    )
    core = EmbeddedCore(
        site_nodes(config),
        data=task_data(config),
        site=config.site,
        work_dir=work_dir,
        on_status=on_status,
        on_change=on_change,
        kill_grace_s=config.kill_grace_s,
        accounts=accounts,
        compat=compat_table(config),
        owner_share=owner_share(config.owner_share),
        state_dir=config.state_dir,
        service_address=config.service_address,
        containers=config.containers,
        elastic=elastic_nodes(config),
        topology_levels=config.topology_levels,
    )
    await core.adopt()  # before the first hello, which reports the tasks adopted
    await core.refresh_images()  # the first hello says which images the nodes hold
    core.watch_images()
    return core


def node_types(config: AgentConfig) -> list[NodeType]:
    """The inventory's node types, for a site with an elastic provider.

    Raises:
        ConfigError: The provider is set and the inventory declares no node type.
    """
    types = load_node_types(config.inventory) if config.inventory is not None else []
    if not types:
        raise ConfigError(
            f"[elastic] provider {config.elastic.provider!r} is set but the inventory declares "
            "no node_types: there is nothing to launch"
        )
    return types


def check_elastic(config: AgentConfig, *, source: str) -> None:
    """Refuses a provider its core cannot use: Ray's autoscaler launches Ray nodes, which only
    the Ray core runs tasks on; the simulated provider's nodes are not in Ray."""
    provider = config.elastic.provider
    if not provider:
        return
    if (provider == "ray") != (config.scheduler == "ray"):
        raise ConfigError(
            f'{source}: [elastic] provider = "{provider}" does not apply to scheduler = '
            f'"{config.scheduler}": Ray\'s autoscaler launches Ray nodes, which the Ray core '
            'runs tasks on. To fix: provider = "ray" with scheduler = "ray", "simulated" '
            "with the embedded core"
        )
    if config.elastic.spot_reclaim_after_s and provider != "simulated":
        raise ConfigError(
            f'{source}: [elastic] spot_reclaim_after_s applies to provider = "simulated" only: '
            f"the {provider!r} provider's spot nodes are taken back by their cloud. To fix: "
            "drop it"
        )
    node_types(config)


def elastic_nodes(config: AgentConfig, provider: Provider | None = None) -> Elastic | None:
    """The nodes of the inventory's node types, launched by ``provider`` (else the one the
    config names); None without a provider."""
    if not config.elastic.provider:
        return None
    chosen = provider or provider_named(config.elastic)
    return Elastic(node_types(config), chosen, config.elastic)


def host_watcher(config: AgentConfig, core: LocalCore, links: LinkMonitor) -> HostWatcher | None:
    """Rediscovery of the host for an embedded core that publishes it; None otherwise. Its
    readings go at the pace the measured link to the coordinator allows."""
    if not (config.discover_host and isinstance(core, EmbeddedCore)):
        return None

    def discover() -> resources_pb2.Node:
        return discover_host_node(config.host_node_name or None, model_names=config.model_names)

    def apply(found: resources_pb2.Node) -> None:
        core.refresh(found, readings_pace(links.coordinator_link()))
        export_gauges(config.site, core.nodes())

    return HostWatcher(discover, apply, config.rediscover_interval_s)


async def run(config: AgentConfig, cores: Mapping[str, CoreFactory] | None = None) -> int:
    factories: dict[str, CoreFactory] = {"embedded": embedded_core, **(cores or {})}
    factory = factories.get(config.scheduler)
    if factory is None:
        raise ConfigError(
            f"scheduler {config.scheduler!r} is not available in this agent (it offers "
            f"{', '.join(factories)}). To fix: run fed-datacenter-agent for Slurm sites"
        )
    os.umask(0o077)  # what the agent writes (journal, work folders) is its own
    made = config.state_dir.exists()
    if config.metrics_listen and not made:  # a taken port refuses with nothing written
        serve_metrics(config.metrics_listen)
    # A second agent on this state folder stops here, naming the first, before it reads or
    # writes anything there (a folder not made yet holds no agent): before it redeems a token,
    # takes the session or adopts a task. Held until the process ends, however it ends.
    with hold_state_dir(config.state_dir):
        if config.metrics_listen and made:
            serve_metrics(config.metrics_listen)
        return await _serve(config, factory)


async def _serve(config: AgentConfig, factory: CoreFactory) -> int:
    """The agent, its state folder held, until SIGINT/SIGTERM or a refused session."""
    if config.otlp_endpoint:
        tracing.configure(config.otlp_endpoint, config.otlp_service, instance=config.site)
    log.info("agent_starting", version=__version__, site=config.site, scheduler=config.scheduler)
    creds = await ensure_enrolled(config)
    config.state_dir.chmod(0o700)  # also when it existed with a looser mode
    probe = ProbeServer(config.probe_listen)
    try:
        bound = await probe.start()
    except OSError as exc:
        raise ConfigError(f"probe_listen {config.probe_listen}: {exc.strerror or exc}") from None
    runtime_ref: list[AgentRuntime] = []
    # A core may report while it starts, before the runtime exists: the hello carries it all.
    core_ref: list[LocalCore] = []

    def on_change() -> None:
        if runtime_ref:
            runtime_ref[0].on_change()
        if core_ref and isinstance(core_ref[0], EmbeddedCore):
            export_gauges(config.site, core_ref[0].nodes())  # booked moves with every task

    core = await factory(
        config,
        lambda report: runtime_ref[0].on_status(report) if runtime_ref else None,
        on_change,
    )
    core_ref.append(core)
    links = LinkMonitor(
        site=config.site,
        declared=link_settings(config, source="config"),
        on_change=lambda: runtime_ref[0].on_links_change(),
        interval_s=config.probe_interval_s,
        payload_bytes=config.probe_payload_bytes,
    )
    endpoint = config.probe_advertise or bound
    log.info("probe_server_started", listen=bound, endpoint=endpoint)
    journal = Journal(config.state_dir / "journal.db")
    runtime = AgentRuntime(
        config,
        creds,
        core,
        links=links,
        probe_endpoint=endpoint,
        journal=journal,
        data=core_data(core),
    )
    runtime_ref.append(runtime)
    links.start()
    watcher = host_watcher(config, core, links)
    if watcher is not None:
        watcher.start()
    if isinstance(core, EmbeddedCore):
        export_gauges(config.site, core.nodes())
    session = asyncio.create_task(runtime.run())
    renewer = CertificateRenewer(
        creds,
        config.site,
        runtime.session_channel,
        runtime.credentials_renewed,
        channel_options(config),
    )
    runtime.recover = renewer.recover
    renewing = asyncio.create_task(renewer.run())
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    stopper = asyncio.create_task(stop.wait())
    await asyncio.wait({session, stopper}, return_when=asyncio.FIRST_COMPLETED)
    code, expired = 0, None
    if session.done() and (err := session.exception()) is not None:
        log.error("agent_rejected", error=str(err))
        code = 1
        if isinstance(err, CertificateExpiredError):
            expired = err  # said in one line, exit 2, once all is closed
    else:
        if not config.stop_tasks_on_exit:
            # Tasks outlive the agent, but one whose job wants at most one copy must not: an
            # agent that is gone cannot stop it once the coordinator places a replacement.
            await core.stop_cut_off(math.inf)
        await runtime.leave("agent stopping")
    renewing.cancel()
    session.cancel()
    stopper.cancel()
    await runtime.close()
    journal.close()
    await links.close()
    if watcher is not None:
        await watcher.close()
    await probe.close()
    if config.stop_tasks_on_exit:
        await core.shutdown(config.kill_grace_s)
    await core.close()  # the embedded core's tasks run on, for the next agent to adopt
    tracing.shutdown()  # sends the spans still buffered
    if expired is not None:
        raise expired
    return code


def run_agent(
    argv: list[str] | None,
    *,
    prog: str,
    domain: str,
    cores: Mapping[str, CoreFactory] | None = None,
) -> None:
    """Runs an agent until SIGINT/SIGTERM; ``cores`` adds local cores beyond the embedded one."""
    args = parse_args(argv, prog, domain)
    configure_logging(json=args.log_json, level=args.log_level)
    try:
        config = load_config(args, domain)
        sys.exit(asyncio.run(run(config, cores)))
    except (
        ConfigError,
        InventoryError,
        EnrollmentError,
        AgentRejectedError,
        StateDirLockedError,
    ) as err:
        print(f"{prog}: {err}", file=sys.stderr)
        sys.exit(2)
