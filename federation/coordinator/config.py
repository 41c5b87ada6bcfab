"""Coordinator settings: a TOML file, overridden by flags."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True, slots=True)
class CoordinatorConfig:
    data_dir: Path
    """Where the embedded store keeps its database."""
    ca_cert: Path
    """The federation CA certificate: every client certificate must chain to it."""
    ca_key: Path
    """The CA key, used to sign site certificates at Join."""
    cert: Path
    """The coordinator's server certificate."""
    key: Path
    listen: str = "127.0.0.1:7070"
    """mTLS address for agents, clients and operators."""
    join_listen: str = "127.0.0.1:7071"
    """Server-only TLS address where agents redeem join tokens."""
    metrics_listen: str = ""
    """Where to serve Prometheus /metrics, e.g. 127.0.0.1:9464; empty serves none."""
    heartbeat_interval_s: float = 3.0
    offer_timeout_s: float = 5.0
    reservation_lease_s: float = 10.0
    retry_interval_s: float = 5.0
    max_offers_per_round: int = 5
