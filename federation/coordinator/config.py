"""Coordinator settings: a TOML file, overridden by flags."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from federation.placement.registry import DEFAULT_FILTERS, DEFAULT_SCORERS


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
    offers_at_once: int = 3
    """Sites offered a task at once; the best that accepts gets the commit, the rest a release."""
    placement_filters: list[str] = field(default_factory=lambda: list(DEFAULT_FILTERS))
    """Filter plugins, in order (see federation/placement/registry.py)."""
    placement_scores: dict[str, float] = field(default_factory=lambda: dict(DEFAULT_SCORERS))
    """Score plugin -> weight."""
    compat_table: Path | None = None
    """A YAML file merged over the shipped compatibility table (driver/runtime/framework)."""
