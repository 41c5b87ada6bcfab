"""Prometheus metrics: defined once here, served by each daemon on its own port."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram, start_http_server

JOBS_SUBMITTED = Counter("federation_jobs_submitted_total", "Jobs accepted by the coordinator")
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
AGENT_TASKS_RUNNING = Gauge("federation_agent_tasks_running", "Tasks running at this site")


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


def serve_metrics(listen: str) -> int:
    """Serve /metrics on ``host:port`` (port 0 picks one); returns the bound port."""
    host, _, port = listen.rpartition(":")
    server, _ = start_http_server(int(port), addr=host or "127.0.0.1")
    return int(server.server_port)
