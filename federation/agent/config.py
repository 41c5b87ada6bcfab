"""Site agent settings: a TOML file, overridden by flags."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from federation.agent.containers import ContainerSettings
from federation.agent.elastic import ElasticSettings
from federation.agent.object_store import ObjectStoreSettings
from federation.agent.owner_share import OwnerShareSettings
from federation.common.probe import MAX_PROBE_BYTES
from federation.config import (
    ConfigError,
    address,
    at_least,
    build,
    one_of,
    positive,
    url,
    within,
)
from federation.endpoints import parse_endpoints

MANAGED_SBATCH_FLAGS = frozenset(
    {"--hold", "--parsable", "--test-only", "--comment", "--job-name", "-J", "--export"}
    | {"--output", "-o", "--error", "-e", "--chdir", "-D", "--wrap", "--array", "-a"}
)
"""sbatch flags the Slurm core sets itself; extra_sbatch_args may not override them."""


@dataclass(frozen=True, slots=True)
class GresModel:
    """How the federation describes the devices of one Slurm GRES type."""

    model: str = ""
    """Device model to publish, e.g. "A100-80GB"; default: the GRES type itself."""
    vendor: str = ""
    """e.g. "nvidia"; default "nvidia" for the ``gpu`` GRES, else empty."""
    memory_mib: int = field(default=0, metadata=at_least(0))
    """Memory of one device (Slurm does not know it); 0 when unknown."""
    attributes: dict[str, str] = field(default_factory=dict)
    """Device attributes such as cuda or compute_capability."""


@dataclass(frozen=True, slots=True)
class SlurmSettings:
    """How a datacenter agent delegates to Slurm: the ``[slurm]`` table of its config."""

    partition: str = ""
    """Partition to describe and submit to; empty means the cluster's default partition."""
    account: str = ""
    """``sbatch --account``; empty leaves it to Slurm (the user's default account)."""
    qos: str = ""
    """``sbatch --qos``; empty leaves it to Slurm."""
    extra_sbatch_args: list[str] = field(default_factory=list)
    """More sbatch flags for every job, e.g. ``["--constraint=ib"]``."""
    conf: Path | None = None
    """slurm.conf given to every Slurm command as SLURM_CONF; default: the agent's own."""
    poll_interval_s: float = field(default=2.0, metadata=positive())
    """Time between two readings of Slurm's nodes, partition and jobs."""
    command_timeout_s: float = field(default=4.0, metadata=positive())
    """A Slurm command that takes longer fails (an offer must be answered within 5 s)."""
    gres: dict[str, GresModel] = field(default_factory=dict)
    """GRES type (``"a100"``, or ``"npu:910b"`` for another GRES name) → device description."""


@dataclass(frozen=True, slots=True)
class RayDevice:
    """How the federation describes the devices one Ray resource counts (Ray counts them
    without names or models; the core names them ``RESOURCE-INDEX`` per node)."""

    model: str = ""
    """Device model to publish, e.g. "A100-80GB"; default: the resource's name."""
    vendor: str = ""
    memory_mib: int = field(default=0, metadata=at_least(0))
    kind: str = field(default="gpu", metadata=one_of("gpu", "npu", "mlu", "fpga", "dpu"))
    declared: bool = False
    """The resource is declared to Ray (``--resources``) for hardware Ray cannot see: its
    devices are published with declared provenance."""
    attributes: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class RaySettings:
    """How an agent delegates to an existing Ray cluster: the ``[ray]`` table of its config."""

    address: str = "127.0.0.1:6379"
    """The head's GCS address, host:port, as ``ray start --head`` printed it."""
    dashboard: str = "http://127.0.0.1:8265"
    """The head's dashboard URL: the Ray Jobs API (``ray[default]`` on the head)."""
    namespace: str = "federation"
    """Ray namespace of the core's placement groups (their names carry site and task)."""
    python: str = "python3"
    """The cluster's Python, which runs each job's launcher."""
    poll_interval_s: float = field(default=1.0, metadata=positive())
    """Time between two readings of Ray's nodes and this site's jobs."""
    devices: dict[str, RayDevice] = field(default_factory=lambda: {"GPU": RayDevice()})
    """Ray resource (``GPU``, or a custom one such as ``GPU_A100``) → its devices."""


def slurm_settings(table: object, *, source: str) -> SlurmSettings:
    """Reads and checks the ``[slurm]`` table of an agent config.

    Raises:
        ConfigError: naming ``source`` and the key, e.g. ``slurm.gres.a100.memory_mib``.
    """
    if not isinstance(table, Mapping):
        raise ConfigError(f"{source}: slurm must be a table")
    settings = build(SlurmSettings, table, source=source, path="slurm")
    check_slurm(settings, source=source)
    return settings


def check_slurm(settings: SlurmSettings, *, source: str) -> None:
    """Refuse sbatch flags the Slurm core sets itself (the rest ``build`` checks)."""
    managed = [a for a in settings.extra_sbatch_args if a.split("=", 1)[0] in MANAGED_SBATCH_FLAGS]
    if managed:
        raise ConfigError(
            f"{source}: slurm.extra_sbatch_args may not set {', '.join(managed)}: the Slurm "
            "core sets it itself"
        )


@dataclass(frozen=True, slots=True)
class AgentConfig:
    site: str
    """The site's name; it must match the name its join token was minted for."""
    domain: str = field(metadata=one_of("edge", "datacenter", "cloud"))
    """edge, datacenter or cloud."""
    coordinator: str
    """mTLS address of the coordinator, host:port; with several coordinators (one leads,
    the others stand by), a comma-separated list of all of them, tried in order."""
    ca: Path
    """The federation CA certificate (public), to verify the coordinator."""
    state_dir: Path
    """Holds the site key and certificate (0600) and the task work folders."""
    join_address: str = ""
    """Server-TLS address for Join; only needed until the site has its certificate. With
    several coordinators, a comma-separated list of their join addresses."""
    coordinators: list[str] = field(default_factory=list)
    """More coordinator mTLS addresses, tried after ``coordinator`` (the agent follows the
    leader among them by itself)."""
    token: str = ""
    """One-time join token (prefer token_file: tokens in command lines leak)."""
    token_file: Path | None = None
    region: str = ""
    inventory: Path | None = None
    """Declared nodes and devices (hardware this machine lacks), YAML or TOML."""
    compat_table: Path | None = None
    """An operator's compatibility table merged over the shipped one, read as the coordinator
    reads its own compat_table (give both the same file): it says which nodes meet a task's
    software requirements."""
    discover_host: bool = True
    """Publish this machine as a node: CPU and memory, NVIDIA GPUs via NVML, and other vendors'
    accelerators via their tools (amd-smi or rocm-smi, npu-smi, cnmon, xpu-smi, xbutil)."""
    model_names: dict[str, str] = field(default_factory=dict)
    """Device names as vendor tools print them → the model names jobs and tables use, e.g.
    ``"NVIDIA H100 80GB HBM3" = "H100-80GB"``: added to, and overriding, the shipped table
    (``federation/agent/discovery/data/model_names.yaml``)."""
    rediscover_interval_s: float = field(default=30.0, metadata=positive())
    """How often the host is discovered again (devices gone, new or unhealthy, and what they
    use now); SIGUSR1 asks at once. Readings are sent only when they moved by 5 points."""
    host_node_name: str = ""
    service_address: str = ""
    """Where clients reach the services this site runs (every replica of the embedded core
    runs on this machine): published in their endpoints. Empty: the machine's name."""
    price_per_device_hour: float = field(default=0.0, metadata=at_least(0))
    labels: dict[str, str] = field(default_factory=dict)
    topology_levels: list[str] = field(default_factory=list)
    """Node labels that are the site's topology levels, from the widest down, e.g. ["block",
    "rack"]: every placement fills the fullest block, then rack, that has room, so whole ones
    stay free for tasks that require one (``topology.required``). Reported in the view."""
    server_name: str = ""
    """Name to verify in the coordinator's certificate when it differs from the address."""
    metrics_listen: str = field(default="", metadata=address(empty=True))
    """Where to serve Prometheus /metrics, e.g. 127.0.0.1:9465; empty serves none."""
    otlp_endpoint: str = field(default="", metadata=url("http", "https", empty=True))
    """An OpenTelemetry collector's OTLP/gRPC address, e.g. http://127.0.0.1:4317 (https://
    for TLS), to send spans of the site's part of each job's path to (the coordinator's
    collector or another); empty sends none. Needs the ``tracing`` extra."""
    otlp_service: str = "fed-agent"
    """``service.name`` of this agent's spans; ``service.instance.id`` is the site."""
    task_accounts: dict[str, str] = field(default_factory=dict)
    """Tenant → local account its tasks run as (the agent must run as root)."""
    task_uid_range: str = ""
    """Uids to allocate, one per tenant not in task_accounts, e.g. "200000-299999"; kept in
    state_dir across restarts. No account needs to exist for them."""
    task_user: str = ""
    """The one account for tenants with no account of their own: they share it, so they are
    not isolated from each other (the agent still is from them)."""
    run_tasks_as_agent: bool = False
    """With none of the above, run tasks as the agent's own account: development only, since
    tasks can then read the site key; on an agent running as root, tasks run as root."""
    work_dir: Path | None = None
    """Task work folders; default state_dir/work. With task accounts it must lie outside
    state_dir (which is private to the agent); each replica gets a folder only its account
    may enter."""
    kill_grace_s: float = field(default=5.0, metadata=at_least(0))
    """Time between SIGTERM and SIGKILL when a task is cancelled."""
    stop_tasks_on_exit: bool = False
    """Stop the embedded core's tasks when the agent stops (SIGTERM, SIGINT). By default they
    run on under their supervisors and the agent started next adopts them: an agent restart or
    upgrade kills no work. (Slurm jobs always stay with Slurm.)"""
    datasets: dict[str, int] = field(default_factory=dict, metadata=at_least(0))
    """Datasets this site holds, id -> bytes; placement counts moving them elsewhere."""
    probe_listen: str = field(default="127.0.0.1:0", metadata=address())
    """Where the link probe server listens, host:port; port 0 picks a free one."""
    probe_advertise: str = field(default="", metadata=address(lowest_port=1, empty=True))
    """The probe endpoint peers should dial when it differs from the bound address (NAT,
    a wildcard listen address); empty advertises the bound address."""
    probe_interval_s: float = field(default=60.0, metadata=positive())
    """Time between two rounds of link measurements to every peer."""
    probe_payload_bytes: int = field(default=4 * 1024 * 1024, metadata=within(1, MAX_PROBE_BYTES))
    """Bytes sent by one throughput probe; more is more accurate and costs more traffic."""
    links: list[dict[str, object]] = field(default_factory=list)
    """Declared links, ``[[links]]`` tables with peer, bandwidth_mbps and rtt_ms: for peers
    the agent cannot measure. A declared link replaces a measurement of the same peer."""
    scheduler: str = field(default="embedded", metadata=one_of("embedded", "slurm", "ray"))
    """Local scheduler core: "embedded" runs tasks as processes on this site's nodes; "slurm"
    (fed-datacenter-agent) delegates them to the site's Slurm, set up in ``[slurm]``; "ray"
    (fed-datacenter-agent) to an existing Ray cluster, set up in ``[ray]``."""
    slurm: SlurmSettings = field(default_factory=SlurmSettings)
    """How to use Slurm when ``scheduler = "slurm"``: the ``[slurm]`` table."""
    ray: RaySettings = field(default_factory=RaySettings)
    """How to use Ray when ``scheduler = "ray"``: the ``[ray]`` table."""
    owner_share: OwnerShareSettings = field(default_factory=OwnerShareSettings)
    """Room kept for the site owner's tenants: the ``[owner_share]`` table."""
    object_store: ObjectStoreSettings = field(default_factory=ObjectStoreSettings)
    """The site's S3-compatible object store, where its tasks' declared outputs go: the
    ``[object_store]`` table (bucket, endpoint, region, prefix, where the keys are read). Its
    credentials stay at the site. No bucket: the site has no store."""
    containers: ContainerSettings = field(default_factory=ContainerSettings)
    """Tasks that name an OCI image, run with Podman: the ``[containers]`` table (enabled,
    registries, insecure_registries, podman, pull_timeout_s)."""
    elastic: ElasticSettings = field(default_factory=ElasticSettings)
    """Nodes launched on demand, of the inventory's ``node_types``: the ``[elastic]`` table
    (provider, idle_release_s, warm_min). No provider: none are launched."""


def coordinator_endpoints(config: AgentConfig) -> tuple[str, ...]:
    """Every coordinator address the agent may dial, in the order to try them."""
    return parse_endpoints([*config.coordinator.split(","), *config.coordinators])
