"""Prometheus metrics: defined once here, served by each daemon on its own port."""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field

from prometheus_client import Counter, Gauge, Histogram, start_http_server

from federation.api.v1 import resources_pb2
from federation.config import ConfigError

JOBS_SUBMITTED = Counter("federation_jobs_submitted_total", "Jobs accepted by the coordinator")
SUBMIT_COMMITS = Counter(
    "federation_submit_commits_total",
    "Store commits of submitted jobs: a SubmitJobs batch takes one, and SubmitJob calls that "
    "arrive while one is under way share the next",
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
# ``measured`` those with a reading of their use (discovered hardware, not declared).
DEVICES = Gauge(
    "federation_devices",
    "Devices of the connected sites by kind and model (state: total, healthy, booked, measured)",
    ["kind", "model", "state"],
)
DEVICE_USE_MEAN = Gauge(
    "federation_device_utilization_mean",
    "Measured compute use averaged over the devices with a reading, in [0, 1]",
    ["kind", "model"],
)
CPU_CORES = Gauge(
    "federation_cpu_cores",
    "CPU cores of the connected sites (state: total, booked, measured: of nodes with a reading,"
    " used: measured use times cores; used / measured is the mean use)",
    ["state"],
)
TASKS = Gauge(
    "federation_tasks",
    "Tasks the connected sites' local schedulers hold, as their views say (pending, running)",
    ["state"],
)
SITE_DEVICES = Gauge(
    "federation_site_devices",
    "Devices of a connected site (state: total, healthy, booked, measured)",
    ["site", "state"],
)
SITE_DEVICE_USE_MEAN = Gauge(
    "federation_site_device_utilization_mean",
    "Measured compute use averaged over the site's devices with a reading, in [0, 1]",
    ["site"],
)
SITE_CPU_CORES = Gauge(
    "federation_site_cpu_cores",
    "CPU cores of a connected site (state: total, booked, measured, used)",
    ["site", "state"],
)
SITE_CPU_USE_MEAN = Gauge(
    "federation_site_cpu_utilization_mean",
    "Measured CPU use of the site's nodes with a reading, weighted by cores, in [0, 1]",
    ["site"],
)
SITE_TASKS = Gauge(
    "federation_site_tasks",
    "Tasks the site's local scheduler holds (pending, running)",
    ["site", "state"],
)
SITE_QUEUE_WAIT = Gauge(
    "federation_site_queue_wait_seconds", "The site's estimate of a new task's wait", ["site"]
)
_AGGREGATES = (
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
DEVICE_STATES = ("total", "healthy", "booked", "measured")
CPU_STATES = ("total", "booked", "measured", "used")
_USABLE = (resources_pb2.DEVICE_HEALTH_HEALTHY, resources_pb2.DEVICE_HEALTH_UNSPECIFIED)
"""Health fit for work, as placement reads it."""
_DeviceKey = tuple[str, str]
"""(kind, model)."""


def _sums() -> list[float]:
    """Per (kind, model): the DEVICE_STATES in order, then the sum of the measured use."""
    return [0.0] * (len(DEVICE_STATES) + 1)


@dataclass(slots=True)
class _Tally:
    """What one site's view adds up to."""

    devices: dict[_DeviceKey, list[float]] = field(default_factory=dict)
    cpu: list[float] = field(default_factory=lambda: [0.0] * len(CPU_STATES))
    """The CPU_STATES in order."""
    tasks: tuple[float, float] = (0.0, 0.0)
    """Pending, running."""
    wait_s: float = 0.0


def _tally_nodes(nodes: Iterable[resources_pb2.Node], tally: _Tally) -> None:
    for node in nodes:
        cpu = tally.cpu
        cpu[0] += node.cpu_cores
        cpu[1] += max(0.0, node.cpu_cores - node.cpu_free)
        if node.measured.measured_at:
            cpu[2] += node.cpu_cores
            cpu[3] += node.measured.compute * node.cpu_cores
        for device in node.devices:
            kind = resources_pb2.DeviceKind.Name(device.kind).removeprefix("DEVICE_KIND_")
            sums = tally.devices.setdefault((kind, device.model), _sums())
            sums[0] += 1
            sums[1] += device.health in _USABLE
            sums[2] += 1.0 if device.allocated else _shared_out(device)
            if device.measured.measured_at:
                sums[3] += 1
                sums[4] += device.measured.compute


def _shared_out(device: resources_pb2.Device) -> float:
    """The share of a shareable device that tasks hold as fractions."""
    return min(1.0, max(0.0, 1.0 - device.free_fraction)) if device.shareable else 0.0


class FederationAggregates:
    """The coordinator's federation-wide gauges, kept from the site views it holds.

    Each change costs what the changed site's view holds (its nodes when they changed, else
    only its queue), never a walk over every site: the federation's sums move by the
    difference between the site's old tally and its new one. A new instance (a new term of
    leadership) starts from nothing.
    """

    def __init__(self) -> None:
        for gauge in _AGGREGATES:
            gauge.clear()
        self._sites: dict[str, _Tally] = {}
        self._devices: dict[_DeviceKey, list[float]] = {}
        self._cpu = [0.0] * len(CPU_STATES)
        self._tasks = [0.0, 0.0]

    def site_view(
        self,
        site: str,
        nodes: Iterable[resources_pb2.Node] | None,
        queue: resources_pb2.QueueState,
    ) -> None:
        """A connected site's view changed; ``nodes`` None: its nodes did not."""
        old = self._sites.get(site) or _Tally()
        new = _Tally(
            tasks=(queue.pending_tasks, queue.running_tasks), wait_s=queue.estimated_wait_s
        )
        if nodes is None:
            new.devices, new.cpu = old.devices, old.cpu
        else:
            _tally_nodes(nodes, new)
        self._replace(site, old, new)
        self._sites[site] = new

    def site_gone(self, site: str) -> None:
        """The site has no session any more: it counts no longer."""
        old = self._sites.pop(site, None)
        if old is not None:
            self._replace(site, old, None)
        if not self._sites:
            self._cpu = [0.0] * len(CPU_STATES)  # no rounding drift outlives the last site

    def _replace(self, site: str, old: _Tally, new: _Tally | None) -> None:
        after = new or _Tally()
        if after.devices is not old.devices:
            for key in old.devices.keys() | after.devices.keys():
                self._move_devices(key, old.devices.get(key), after.devices.get(key))
        if after.cpu is not old.cpu:
            for i, (was, now) in enumerate(zip(old.cpu, after.cpu, strict=True)):
                self._cpu[i] += now - was
            for state, value in zip(CPU_STATES, self._cpu, strict=True):
                CPU_CORES.labels(state).set(max(0.0, value))
        for i, state in enumerate(("pending", "running")):
            self._tasks[i] += after.tasks[i] - old.tasks[i]
            TASKS.labels(state).set(self._tasks[i])
        _set_site(site, new)

    def _move_devices(
        self, key: _DeviceKey, was: list[float] | None, now: list[float] | None
    ) -> None:
        sums = self._devices.setdefault(key, _sums())
        for i, value in enumerate(now or _sums()):
            sums[i] += value - (was[i] if was else 0.0)
        if sums[0] < 0.5:  # none left: the series go, and any rounding drift with them
            del self._devices[key]
            for state in DEVICE_STATES:
                DEVICES.remove(*key, state)
            DEVICE_USE_MEAN.remove(*key)
            return
        for state, value in zip(DEVICE_STATES, sums, strict=False):
            DEVICES.labels(*key, state).set(max(0.0, value))
        if sums[3] >= 0.5:
            DEVICE_USE_MEAN.labels(*key).set(sums[4] / sums[3])
        else:
            DEVICE_USE_MEAN.remove(*key)


def _set_site(site: str, tally: _Tally | None) -> None:
    """The site's own series (few: they cost nothing to set again), or none once it is gone."""
    if tally is None:
        for state in DEVICE_STATES:
            SITE_DEVICES.remove(site, state)
        for state in CPU_STATES:
            SITE_CPU_CORES.remove(site, state)
        for state in ("pending", "running"):
            SITE_TASKS.remove(site, state)
        for gauge in (SITE_DEVICE_USE_MEAN, SITE_CPU_USE_MEAN, SITE_QUEUE_WAIT):
            gauge.remove(site)
        return
    devices = [math.fsum(column) for column in zip(_sums(), *tally.devices.values(), strict=True)]
    for state, value in zip(DEVICE_STATES, devices, strict=False):
        SITE_DEVICES.labels(site, state).set(value)
    _set_or_remove(SITE_DEVICE_USE_MEAN, site, devices[4], devices[3])
    for state, value in zip(CPU_STATES, tally.cpu, strict=True):
        SITE_CPU_CORES.labels(site, state).set(value)
    _set_or_remove(SITE_CPU_USE_MEAN, site, tally.cpu[3], tally.cpu[2])
    SITE_TASKS.labels(site, "pending").set(tally.tasks[0])
    SITE_TASKS.labels(site, "running").set(tally.tasks[1])
    SITE_QUEUE_WAIT.labels(site).set(tally.wait_s)


def _set_or_remove(gauge: Gauge, site: str, part: float, whole: float) -> None:
    """A mean, or no series while nothing has a reading."""
    if whole > 0:
        gauge.labels(site).set(part / whole)
    else:
        gauge.remove(site)


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
