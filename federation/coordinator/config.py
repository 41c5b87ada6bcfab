"""Coordinator settings: a TOML file, overridden by flags."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from federation.config import ConfigError, address, at_least, one_of, positive, url, within
from federation.coordinator.policy.priority import parse_priority_classes
from federation.coordinator.scheduling.waits import WAIT_GAIN
from federation.placement.registry import DEFAULT_FILTERS, DEFAULT_SCORERS
from federation.store.etcd import DEFAULT_PREFIX

SITE_CERTIFICATE_LIFETIME_S = 7 * 86400.0
CLIENT_CERTIFICATE_LIFETIME_S = 90 * 86400.0
MIN_CERTIFICATE_LIFETIME_S = 10
"""Shorter, and a certificate could expire before the agent's renewal at two thirds of it
has gone its round trip."""


STORE_FILE = "federation.db"
"""The embedded store's database, in ``data_dir``."""


@dataclass(frozen=True, slots=True)
class CoordinatorConfig:
    data_dir: Path
    """Where the embedded store keeps its database."""
    ca_cert: Path
    """The trust bundle: the roots every client certificate must chain to."""
    ca_key: Path
    """The issuing CA's key, used to sign site certificates at Join and renewals."""
    cert: Path
    """The coordinator's server certificate."""
    key: Path
    listen: str = field(default="127.0.0.1:7070", metadata=address())
    """mTLS address for agents, clients and operators."""
    join_listen: str = field(default="127.0.0.1:7071", metadata=address())
    """Server-only TLS address where agents redeem join tokens."""
    probe_listen: str = field(default="", metadata=address(empty=True))
    """Where agents measure their link to this coordinator (a TCP link probe, as agents run for
    each other); empty: the host of ``listen`` on a free port."""
    probe_advertise: str = field(default="", metadata=address(lowest_port=1, empty=True))
    """The probe address agents should dial; empty: the advertised host and the bound port."""
    metrics_listen: str = field(default="", metadata=address(empty=True))
    """Where to serve Prometheus /metrics, e.g. 127.0.0.1:9464; empty serves none."""
    otlp_endpoint: str = field(default="", metadata=url("http", "https", empty=True))
    """An OpenTelemetry collector's OTLP/gRPC address, e.g. http://127.0.0.1:4317 (https://
    for TLS), to send spans of each job's path to; empty sends none. Needs the ``tracing``
    extra."""
    otlp_service: str = "fed-coordinator"
    """``service.name`` of this coordinator's spans."""
    heartbeat_interval_s: float = field(default=3.0, metadata=positive())
    """How often agents send a heartbeat; also how often lost sites are looked at."""
    missed_heartbeats: int = field(default=3, metadata=at_least(1))
    """Heartbeats a session may miss before it is dropped and its site is UNREACHABLE."""
    offer_timeout_s: float = field(default=5.0, metadata=positive())
    reservation_lease_s: float = field(default=10.0, metadata=positive())
    retry_interval_s: float = field(default=5.0, metadata=positive())
    unfit_retry_interval_s: float = field(default=60.0, metadata=positive())
    """How often, at least, a waiting task is tried again that every site refused for what no
    task ending changes (hardware it lacks, the job's own bounds): a backlog of thousands of
    such tasks costs little, and one waits at most this long after the hardware appears."""
    max_offers_per_round: int = field(default=5, metadata=at_least(1))
    offers_at_once: int = field(default=3, metadata=at_least(1))
    """Sites offered a task at once after its best site declined (that one is offered alone);
    the best that accepts gets the commit, the rest a release."""
    placement_filters: list[str] = field(default_factory=lambda: list(DEFAULT_FILTERS))
    """Filter plugins, in order: built-in names, names published in the entry-point group
    fedplane.placement.filters, or module:Class (see federation/placement/loading.py)."""
    placement_scores: dict[str, float] = field(
        default_factory=lambda: dict(DEFAULT_SCORERS), metadata=at_least(0)
    )
    """Score plugin -> weight (names as for filters; group fedplane.placement.scorers)."""
    placement_plugin_budget_ms: float = field(default=100.0, metadata=positive())
    """How long one call of a plugin from outside the project may take: one that takes longer,
    raises or breaks the framework's contract is disabled, and the cycle goes on."""
    compat_table: Path | None = None
    """A YAML file merged over the shipped compatibility table (driver/runtime/framework)."""
    store: str = field(default="sqlite", metadata=one_of("sqlite", "etcd"))
    """"sqlite": the embedded store in data_dir, one coordinator that always leads. "etcd":
    state in etcd, shared by several coordinators of which one leads (elected on a lease)."""
    etcd_endpoints: list[str] = field(default_factory=list)
    """etcd members, host:port or http(s)://host:port; required with store = "etcd"."""
    etcd_prefix: str = DEFAULT_PREFIX
    """Key prefix in etcd: federations sharing one etcd need prefixes that do not nest."""
    etcd_ca: Path | None = None
    """CA that etcd's certificate chains to; with etcd_cert and etcd_key, etcd is reached
    over mutual TLS (https:// endpoints), else in plaintext."""
    etcd_cert: Path | None = None
    etcd_key: Path | None = None
    advertise: str = field(default="", metadata=address(lowest_port=1, empty=True))
    """The host:port clients and agents should dial for this coordinator's listen address;
    empty: the listen host (this machine's name for a wildcard) and the bound port."""
    join_advertise: str = field(default="", metadata=address(lowest_port=1, empty=True))
    """The same for join_listen; empty: the advertised host and the bound join port."""
    issuing_cert: Path | None = None
    """The issuing CA's certificate; none: ``issuing.pem`` beside ``ca_key`` if there is one,
    else ``ca_cert`` is the issuer (a pki made before the offline root)."""
    etcd_history_s: float = field(default=300.0, metadata=at_least(0))
    """With etcd: how long of history to keep; older revisions are compacted away so that job
    writes do not pile up in etcd (watches further behind re-read; 0 leaves it to etcd)."""
    leader_lease_s: float = field(default=3.0, metadata=positive())
    """With etcd: ttl of the leader's lease, so a dead leader is replaced this long after its
    last keepalive (etcd rounds up to whole seconds and to its own minimum)."""
    client_requests_per_s: float = field(default=200.0, metadata=at_least(0))
    """RPCs per second one tenant or operator identity may sustain; 0: no limit."""
    client_request_burst: float = field(default=400.0, metadata=at_least(0))
    """RPCs an idle identity may send at once."""
    client_jobs_per_s: float = field(default=50.0, metadata=at_least(0))
    """Jobs per second one identity may submit (each spec of a batch counts); 0: no limit.
    Sustained, 50 a second from one tenant keeps another's calls within a few times their
    quiet latency (as tests/e2e/test_abuse.py measures)."""
    client_job_burst: float = field(default=1000.0, metadata=at_least(0))
    """Jobs an idle identity may submit at once."""
    max_unfinished_jobs_per_tenant: int = field(default=10_000, metadata=at_least(0))
    """Jobs one tenant may have that have not finished; 0: no limit. Every waiting job costs
    each scheduling pass, so this bounds what one tenant can make the scheduler do."""
    client_streams: int = field(default=32, metadata=at_least(0))
    """WatchJobs streams one identity may hold open at once; 0: no limit."""
    client_bytes_per_s: float = field(default=4 << 20, metadata=at_least(0))
    """Request and reply bytes per second one identity may sustain; 0: no limit."""
    client_byte_burst: float = field(default=16 << 20, metadata=at_least(0))
    """Request and reply bytes an idle identity may move at once."""
    client_refusal_hold_s: float = field(default=1.0, metadata=at_least(0))
    """Longest a rate-limit refusal is held before it is sent; 0: sent at once."""
    client_held_refusals: int = field(default=64, metadata=at_least(0))
    """Refusals one identity may have held at once; further ones are sent at once."""
    max_request_bytes: int = field(default=4 << 20, metadata=at_least(0))
    """Largest client request (sites' Connect messages excepted), refused before parsing."""
    preemption_min_run_s: float = field(default=60.0, metadata=at_least(0))
    """A task runs at least this long before a higher-priority one may preempt it."""
    reclaim_min_run_s: float = field(default=120.0, metadata=at_least(0))
    """A task on borrowed quota runs at least this long before the queue it borrowed from
    takes it back: longer than for priority, as a queue often borrows only while the one it
    borrows from has nothing placeable, and that may change within seconds."""
    wait_gain: float = field(default=WAIT_GAIN, metadata=within(0, 1))
    """A task waits for a busy site where it would finish by this share of its finish on the
    best site free now; 0: tasks never wait while some site can take them."""
    priority_classes: dict[str, Any] = field(default_factory=dict)
    """Named priorities jobs may name: ``[priority_classes.urgent]`` with ``value`` (-1000 to
    1000), ``preemptible`` (default true) and ``may_preempt`` (default false)."""
    site_certificate_lifetime_s: float = field(
        default=SITE_CERTIFICATE_LIFETIME_S, metadata=at_least(MIN_CERTIFICATE_LIFETIME_S)
    )
    """Lifetime of the certificates sites get at a join and at each renewal (agents renew at
    two thirds of it): short, so a stolen site key is good for days at most."""
    client_certificate_lifetime_s: float = field(
        default=CLIENT_CERTIFICATE_LIFETIME_S, metadata=at_least(MIN_CERTIFICATE_LIFETIME_S)
    )
    """Lifetime of the certificates operators and tenants get by renewing (``fedctl pki
    renew``): people renew by hand, so a quarter rather than days; offline issues keep a
    year."""
    renewal_overlap_s: float = field(default=600.0, metadata=at_least(0))
    """How long a renewed certificate is still accepted after its renewal, unless the new one
    is used sooner: a renewal whose reply was lost leaves its holder able to repeat it."""
    finished_job_retention_s: float = field(default=7 * 86400.0, metadata=at_least(0))
    """How long a finished job is kept (from its last task's finish); then the leader removes
    it from the store, archiving it first when ``archive_dir`` is set. 0: kept for ever."""
    archive_dir: Path | None = None
    """Where removed jobs are archived: one JSON-lines file per day, ``jobs-YYYY-MM-DD.jsonl``,
    each line a job and its newest events; none: removed jobs are not kept anywhere."""
    audit_retention_s: float = field(default=90 * 86400.0, metadata=at_least(0))
    """How long an audit entry is kept; 0: for ever."""
    max_spec_bytes: int = field(default=256 * 1024, metadata=within(1024, 1024 * 1024))
    """Largest job spec accepted (its encoded size): every transition rewrites the job's
    record, and etcd refuses a request over 1.5 MiB."""


def check_settings(config: CoordinatorConfig, *, source: str) -> None:
    """Refuse settings that cannot work together (each one alone is checked by ``build``).

    Raises:
        ConfigError: Naming ``source`` and the setting.
    """
    if config.store == "etcd" and not config.etcd_endpoints:
        raise ConfigError(f'{source}: store = "etcd" needs etcd_endpoints, e.g. ["127.0.0.1:2379"]')
    tls = (config.etcd_ca, config.etcd_cert, config.etcd_key)
    if any(tls) and not all(tls):
        raise ConfigError(f"{source}: give all of etcd_ca, etcd_cert and etcd_key, or none")
    # A task offered to several sites at once is decided when all have answered or timed
    # out, so a site that accepted at once holds its reservation up to offer_timeout_s
    # before the commit: a shorter lease would let it lapse and refuse the commit.
    if not config.reservation_lease_s > config.offer_timeout_s:
        raise ConfigError(
            f"{source}: reservation_lease_s ({config.reservation_lease_s:g}) must be longer "
            f"than offer_timeout_s ({config.offer_timeout_s:g})"
        )
    parse_priority_classes(config.priority_classes, source=source)
