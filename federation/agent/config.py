"""Site agent settings: a TOML file, overridden by flags."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path


@dataclass(frozen=True, slots=True)
class AgentConfig:
    site: str
    """The site's name; it must match the name its join token was minted for."""
    domain: str
    """edge, datacenter or cloud."""
    coordinator: str
    """mTLS address of the coordinator, host:port."""
    ca: Path
    """The federation CA certificate (public), to verify the coordinator."""
    state_dir: Path
    """Holds the site key and certificate (0600) and the task work folders."""
    join_address: str = ""
    """Server-TLS address for Join; only needed until the site has its certificate."""
    token: str = ""
    """One-time join token (prefer token_file: tokens in command lines leak)."""
    token_file: Path | None = None
    region: str = ""
    inventory: Path | None = None
    """Declared nodes and devices (hardware this machine lacks), YAML or TOML."""
    discover_host: bool = True
    """Publish this machine (CPU, memory, NVIDIA GPUs via NVML) as a node."""
    host_node_name: str = ""
    price_per_device_hour: float = 0.0
    labels: dict[str, str] = field(default_factory=dict)
    server_name: str = ""
    """Name to verify in the coordinator's certificate when it differs from the address."""
    metrics_listen: str = ""
    """Where to serve Prometheus /metrics, e.g. 127.0.0.1:9465; empty serves none."""
    task_user: str = ""
    """Run tasks as this account (the agent must run as root). Tasks then cannot read the
    site key; without it they run as the agent's own user and can."""
    work_dir: Path | None = None
    """Task work folders; default state_dir/work. With task_user, put it outside state_dir
    (which is private to the agent) and the agent creates the folders owned by task_user."""
    kill_grace_s: float = 5.0
    """Time between SIGTERM and SIGKILL when a task is cancelled."""
    datasets: dict[str, int] = field(default_factory=dict)
    """Datasets this site holds, id -> bytes; placement counts moving them elsewhere."""
    probe_listen: str = "127.0.0.1:0"
    """Where the link probe server listens, host:port; port 0 picks a free one."""
    probe_advertise: str = ""
    """The probe endpoint peers should dial when it differs from the bound address (NAT,
    a wildcard listen address); empty advertises the bound address."""
    probe_interval_s: float = 60.0
    """Time between two rounds of link measurements to every peer."""
    probe_payload_bytes: int = 4 * 1024 * 1024
    """Bytes sent by one throughput probe; more is more accurate and costs more traffic."""
    links: list[dict[str, object]] = field(default_factory=list)
    """Declared links, ``[[links]]`` tables with peer, bandwidth_mbps and rtt_ms: for peers
    the agent cannot measure. A declared link replaces a measurement of the same peer."""
