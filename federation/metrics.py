"""Prometheus metrics: defined once here, served by each daemon on its own port."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

from prometheus_client import REGISTRY, Counter, Gauge, Histogram, Metric, start_http_server
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from federation.config import ConfigError

JOBS_SUBMITTED = Counter("federation_jobs_submitted_total", "Jobs accepted by the coordinator")
SUBMIT_COMMITS = Counter(
    "federation_submit_commits_total",
    "Store commits of submitted jobs: a SubmitJobs batch takes one, and SubmitJob calls that "
    "arrive while one is under way share the next",
)
PLACEMENT_PLUGINS_DISABLED = Counter(
    "federation_placement_plugins_disabled_total",
    "Placement plugins from outside the project disabled for raising, breaking the framework's "
    "contract or running past placement_plugin_budget_ms",
    ["plugin"],
)
JOBS_REMOVED = Counter(
    "federation_jobs_removed_total",
    "Finished jobs removed from the store once past their retention",
    ["archived"],
)
TASK_TRANSITIONS = Counter(
    "federation_task_transitions_total", "Task state transitions written", ["state"]
)
OFFERS = Counter(
    "federation_offers_total",
    "Negotiation rounds with a site: settled (delegated, or moot after a cancel) or refused",
    ["outcome"],
)
GANG_RESERVATIONS_LET_GO = Counter(
    "federation_gang_reservation_device_seconds_total",
    "Device-seconds held by reservations of gang parts let go because another part of the "
    "gang found no site (all or nothing)",
)
SITE_MESSAGES = Counter(
    "federation_site_messages_total", "Messages received from site agents", ["kind"]
)
SITES_CONNECTED = Gauge("federation_sites_connected", "Sites with a live Connect stream")
SITES_UNREACHABLE = Gauge(
    "federation_sites_unreachable", "Sites whose session ended without a goodbye"
)
TASKS_MOVED = Counter("federation_tasks_moved_total", "Tasks moved away from a site that was lost")
RESCHEDULING_PAUSED = Gauge(
    "federation_rescheduling_paused",
    "1 while moving tasks off lost sites is paused (most sites unreachable at once)",
)
COORDINATOR_LEADER = Gauge(
    "federation_coordinator_leader",
    "1 while this coordinator leads (schedules and writes), 0 while it stands by",
)
STORE_COMMIT_SECONDS = Histogram(
    "federation_store_commit_seconds",
    "Time from asking the store to commit until it is durable (store: sqlite, etcd)",
    ["store"],
    buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0),
)
AGENT_TASKS_RUNNING = Gauge("federation_agent_tasks_running", "Tasks running at this site")
CERTIFICATE_EXPIRY = Gauge(
    "federation_certificate_expiry_timestamp_seconds",
    "When certificates expire, Unix time (certificate: issued, the soonest of those the "
    "coordinator issued, not revoked and not expired, 0 for none; server; ca)",
    ["certificate"],
)
CERTIFICATES_RENEWED = Counter(
    "federation_certificates_renewed_total", "Certificates renewed, by role", ["role"]
)
AGENT_CERTIFICATE_EXPIRY = Gauge(
    "federation_agent_certificate_expiry_timestamp_seconds",
    "When this site's certificate expires, Unix time (the agent renews it at two thirds)",
)


RUN_TIME_RATIO = Histogram(
    "federation_run_time_ratio",
    "Measured run time over the estimate's, per task that succeeded on devices",
    ["workload_class"],
    buckets=(0.25, 0.5, 0.67, 0.8, 0.9, 1.0, 1.1, 1.25, 1.5, 2.0, 4.0),
)

# Agents: each site's nodes and devices, measured use beside what tasks booked.
_NODE = ["site", "node"]
_DEVICE = ["site", "node", "device"]
NODE_CPU_USE = Gauge("federation_node_cpu_utilization", "CPU in use, a share in [0, 1]", _NODE)
NODE_MEMORY_USED = Gauge("federation_node_memory_used_bytes", "Memory in use", _NODE)
DEVICE_USE = Gauge(
    "federation_device_utilization", "Compute in use (the vendor's reading), in [0, 1]", _DEVICE
)
DEVICE_MEMORY_USED = Gauge("federation_device_memory_used_bytes", "Device memory in use", _DEVICE)
DEVICE_POWER = Gauge("federation_device_power_watts", "Power drawn now", _DEVICE)
DEVICE_TEMPERATURE = Gauge("federation_device_temperature_celsius", "Temperature now", _DEVICE)
DEVICE_BOOKED = Gauge(
    "federation_device_booked", "Share of the device tasks hold (1: held whole)", _DEVICE
)

# Coordinator: what the views of the sites with a live session add up to, per site and in all.
# Device states overlap: ``total`` counts every device, ``healthy`` those fit for work,
# ``booked`` the device-equivalents tasks hold (whole devices and shares of shareable ones),
# ``measured`` those with a reading of their use (discovered hardware, not declared). These are
# computed when scraped (``AGGREGATES``), from sums the coordinator keeps as views change.


@dataclass(frozen=True, slots=True)
class GaugeFamily:
    """A gauge the coordinator computes when scraped, rather than sets as things change."""

    name: str
    documentation: str
    labels: tuple[str, ...] = ()

    def family(self) -> GaugeMetricFamily:
        """An empty family of this gauge, to add samples to."""
        return GaugeMetricFamily(self.name, self.documentation, labels=self.labels)


DEVICES = GaugeFamily(
    "federation_devices",
    "Devices of the connected sites by kind and model (state: total, healthy, booked, measured)",
    ("kind", "model", "state"),
)
DEVICE_USE_MEAN = GaugeFamily(
    "federation_device_utilization_mean",
    "Measured compute use averaged over the devices with a reading, in [0, 1]",
    ("kind", "model"),
)
CPU_CORES = GaugeFamily(
    "federation_cpu_cores",
    "CPU cores of the connected sites (state: total, booked, measured: of nodes with a reading,"
    " used: measured use times cores; used / measured is the mean use)",
    ("state",),
)
TASKS = GaugeFamily(
    "federation_tasks",
    "Tasks the connected sites' local schedulers hold, as their views say (pending, running)",
    ("state",),
)
SITE_DEVICES = GaugeFamily(
    "federation_site_devices",
    "Devices of a connected site (state: total, healthy, booked, measured)",
    ("site", "state"),
)
SITE_DEVICE_USE_MEAN = GaugeFamily(
    "federation_site_device_utilization_mean",
    "Measured compute use averaged over the site's devices with a reading, in [0, 1]",
    ("site",),
)
SITE_CPU_CORES = GaugeFamily(
    "federation_site_cpu_cores",
    "CPU cores of a connected site (state: total, booked, measured, used)",
    ("site", "state"),
)
SITE_CPU_USE_MEAN = GaugeFamily(
    "federation_site_cpu_utilization_mean",
    "Measured CPU use of the site's nodes with a reading, weighted by cores, in [0, 1]",
    ("site",),
)
SITE_TASKS = GaugeFamily(
    "federation_site_tasks",
    "Tasks the site's local scheduler holds (pending, running)",
    ("site", "state"),
)
SITE_QUEUE_WAIT = GaugeFamily(
    "federation_site_queue_wait_seconds", "The site's estimate of a new task's wait", ("site",)
)
AGGREGATE_FAMILIES = (
    DEVICES,
    DEVICE_USE_MEAN,
    CPU_CORES,
    TASKS,
    SITE_DEVICES,
    SITE_DEVICE_USE_MEAN,
    SITE_CPU_CORES,
    SITE_CPU_USE_MEAN,
    SITE_TASKS,
    SITE_QUEUE_WAIT,
)


class AggregateCollector(Collector):
    """Serves the ``AGGREGATE_FAMILIES`` from whatever ``source`` the coordinator's current
    term set (``coordinator.aggregates.FederationAggregates``); none before it does."""

    def __init__(self) -> None:
        self.source: Callable[[], Iterable[Metric]] | None = None

    def describe(self) -> Iterable[Metric]:
        return [spec.family() for spec in AGGREGATE_FAMILIES]

    def collect(self) -> Iterable[Metric]:
        source = self.source
        return source() if source is not None else []


AGGREGATES = AggregateCollector()
REGISTRY.register(AGGREGATES)
DEVICE_STATES = ("total", "healthy", "booked", "measured")
CPU_STATES = ("total", "booked", "measured", "used")
TASK_STATES = ("pending", "running")


def serve_metrics(listen: str) -> int:
    """Serve /metrics on ``host:port`` (port 0 picks one); returns the bound port.

    Raises:
        ConfigError: The port is in use, or the host is not this machine's.
    """
    host, _, port = listen.rpartition(":")
    host = host.removeprefix("[").removesuffix("]") or "127.0.0.1"
    try:
        server, _ = start_http_server(int(port), addr=host)
    except OSError as err:  # also a host that does not resolve (socket.gaierror)
        raise ConfigError(
            f"metrics_listen {listen}: cannot listen: {err.strerror or err}. To fix: stop what "
            "holds the port, or choose another address"
        ) from None
    return int(server.server_port)


# Coordinator: queues (refreshed by the scheduling loop every few seconds, and when listed).
QUEUE_USAGE = Gauge(
    "federation_queue_usage",
    "What a queue and the queues under it hold (cpu cores, memory_mib, devices by kind/model)",
    ["queue", "resource"],
)
QUEUE_DOMINANT_SHARE = Gauge(
    "federation_queue_dominant_share",
    "A queue's largest share of any resource the federation has, over its weight",
    ["queue"],
)
QUEUE_WAITING_JOBS = Gauge(
    "federation_queue_waiting_jobs",
    "Jobs of a queue with a task waiting to be placed (with usage 0 for long: a starving queue)",
    ["queue"],
)
PREEMPTIONS = Counter(
    "federation_preemptions_total", "Tasks stopped to make room for higher-priority work"
)
SCHEDULING_WALK_SECONDS = Histogram(
    "federation_scheduling_walk_seconds",
    "How long a scheduling cycle took to walk the line of waiting jobs, rests included",
    buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0),
)
SCHEDULING_JOBS_READ = Counter(
    "federation_scheduling_jobs_read_total",
    "Waiting jobs a scheduling cycle read; one whose every task waits out a timer is passed by",
)
