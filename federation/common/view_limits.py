"""The limits a site's view is held to: the coordinator refuses a view past them
(``coordinator.site_checks``), and an agent refuses a declared inventory past them first."""

from __future__ import annotations

MAX_FIGURE = 1e12
"""Largest figure (cores, TFLOPS, watts, USD, seconds, Mbit/s, ms) a site may report: far above
any real one, and far enough below float64's range that placement's sums and products of a
few of them stay finite."""
MAX_DEVICE_MEMORY_MIB = 1 << 30
"""Largest memory of a device or partition: 1 PiB (2^50 bytes), thousands of times today's."""
MAX_NODE_MEMORY_MIB = 1 << 40
"""Largest memory of a node: 1 EiB, far above any machine; scripted test sites declare 2^40
MiB to mean "unlimited"."""
MAX_STORED_BYTES = 1 << 60
"""Largest dataset or checkpoint: 1 EiB."""
ABSOLUTE_ZERO_C = -273.15
"""Lowest temperature a device may report (edge devices can be below 0 °C)."""
MAX_TIMESTAMP_S = 253_402_300_799
"""9999-12-31T23:59:59Z, the latest time a protobuf ``Timestamp`` may hold."""
MAX_VIEW_NODES = 10_000
MAX_NODE_DEVICES = 1024
MAX_DEVICE_PARTITIONS = 64
"""Partition profiles per device (a MIG-capable GPU offers at most about 20)."""
MAX_VIEW_LINKS = 10_000
"""Links per view: one per peer site."""
MAX_VIEW_DATASETS = 10_000
MAX_NODE_IMAGES = 256
"""Images a node reports: its most recent, enough for placement to see what it holds."""
MAX_IMAGE_REFERENCES = 16
"""Names (tags and digests) reported per image."""
MAX_IMAGE_REGISTRIES = 64
