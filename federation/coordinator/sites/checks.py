"""Checks on everything a site sends on its Connect stream, before anything else reads it.

Placement ranks sites by the numbers they publish, so one NaN price, an infinite speed or a
device with more memory free than it has would put a lying site first for every job. Each
stream write is checked here as it arrives, in one plain loop over its messages: every number
finite and in range, every free amount at most its total, every list, map and string bounded,
and a probe endpoint on the address the stream came from (peers dial it). A write with a bad
field is refused ``INVALID_ARGUMENT`` naming each bad field, up to ``MAX_VIOLATIONS`` of them.

Field paths use the proto field names. The stream's first message is named ``hello``, as in
``hello.view.nodes[3].devices[0].memory_free_mib``; later messages by their place in their
stream write, as in ``messages[2].view.delta.upserted_nodes[0].cpu_free``.
"""

from __future__ import annotations

import ipaddress
import math
from collections.abc import Iterable, Mapping, Sequence, Sized
from dataclasses import dataclass
from typing import Any
from urllib.parse import unquote

from federation.api.v1 import resources_pb2
from federation.api.v1 import site_link_service_pb2 as pb
from federation.common import job_state
from federation.common.view_limits import (
    ABSOLUTE_ZERO_C,
    MAX_DEVICE_MEMORY_MIB,
    MAX_DEVICE_PARTITIONS,
    MAX_FIGURE,
    MAX_IMAGE_REFERENCES,
    MAX_IMAGE_REGISTRIES,
    MAX_NODE_DEVICES,
    MAX_NODE_IMAGES,
    MAX_NODE_MEMORY_MIB,
    MAX_STORED_BYTES,
    MAX_TIMESTAMP_S,
    MAX_VIEW_DATASETS,
    MAX_VIEW_LINKS,
    MAX_VIEW_NODES,
)
from federation.coordinator.jobs.validation import MAX_DEVICES_PER_REPLICA, MAX_REPLICAS
from federation.coordinator.sites.live_view import PlannedDelta
from federation.envelopes import MAX_MESSAGES
from federation.errors import FieldViolation, InvalidArgumentError
from federation.placement.selector_cost import MAX_ATTRIBUTE_CHARS, MAX_DEVICE_ATTRIBUTES
from federation.resources import resource_problem
from federation.security.interceptors import MAX_VIOLATIONS

MAX_LABELS = MAX_DEVICE_ATTRIBUTES
"""Labels per node or site, as attributes per device."""
MAX_HELLO_TASKS = 10_000
"""Task reports in a hello: applying 100,000 kept the coordinator busy for over 21 s."""
MAX_REPORT_DEVICES = MAX_REPLICAS * MAX_DEVICES_PER_REPLICA
"""Devices one task report may name: every device of the largest task a spec may ask for."""
MAX_ENVELOPE_MESSAGES = 4 * MAX_MESSAGES
"""Messages in one stream write: agents send at most ``MAX_MESSAGES``; room for one that
batches more."""
MAX_TEXT_CHARS = 4096
"""Longest name, id, path, label value or other text a site sends (Slurm feature lists in
labels grow long). What placement and selectors compare (vendor, model, attributes, label keys)
is held to ``MAX_ATTRIBUTE_CHARS``."""
REPORTED_STATES = job_state.AT_SITE | job_state.TERMINAL
"""What a task may be at a site; any other state in a report is a lie or a bug."""


@dataclass(frozen=True, slots=True)
class _Rules:
    """What each scalar field of one kind of message must be."""

    ranges: tuple[tuple[str, float, float], ...] = ()
    """(field, lowest, highest); ``low <= value <= high`` also refuses NaN."""
    free: tuple[tuple[str, str], ...] = ()
    """(free, total): a site cannot have more free than it has."""
    texts: tuple[tuple[str, int], ...] = ()
    """(field, most characters)."""
    enums: tuple[tuple[str, frozenset[int]], ...] = ()
    """(field, known values): placement names kinds, and an unknown one would break it."""


_KINDS = frozenset(resources_pb2.DeviceKind.values())
_PROVENANCES = frozenset(resources_pb2.Provenance.values())
_SITE = _Rules(
    ranges=(("price_per_device_hour", 0, MAX_FIGURE), ("power_watts", 0, MAX_FIGURE)),
    texts=(
        ("site", MAX_TEXT_CHARS),
        ("region", MAX_ATTRIBUTE_CHARS),
        ("scheduler", MAX_TEXT_CHARS),
        ("agent_version", MAX_TEXT_CHARS),
        ("image_refusal", MAX_TEXT_CHARS),
    ),
)
_IMAGE = _Rules(
    ranges=(("size_bytes", 0, MAX_STORED_BYTES), ("pull_bytes", 0, MAX_STORED_BYTES)),
    texts=(("id", MAX_ATTRIBUTE_CHARS),),
)
_QUEUE = _Rules(ranges=(("estimated_wait_s", 0, MAX_FIGURE),))
_NODE = _Rules(
    ranges=(
        ("cpu_cores", 0, MAX_FIGURE),
        ("cpu_free", 0, MAX_FIGURE),
        ("memory_mib", 0, MAX_NODE_MEMORY_MIB),
        ("memory_free_mib", 0, MAX_NODE_MEMORY_MIB),
    ),
    free=(("cpu_free", "cpu_cores"), ("memory_free_mib", "memory_mib")),
    texts=(("name", MAX_TEXT_CHARS), ("arch", MAX_ATTRIBUTE_CHARS)),
    enums=(("provenance", _PROVENANCES),),
)
_DEVICE = _Rules(
    ranges=(
        ("memory_total_mib", 0, MAX_DEVICE_MEMORY_MIB),
        ("memory_free_mib", 0, MAX_DEVICE_MEMORY_MIB),
        ("tflops_fp32", 0, MAX_FIGURE),
        ("tflops_fp16", 0, MAX_FIGURE),
        ("tflops_int8", 0, MAX_FIGURE),
        ("power_watts", 0, MAX_FIGURE),
        ("power_tdp_watts", 0, MAX_FIGURE),
        ("temperature_c", ABSOLUTE_ZERO_C, MAX_FIGURE),
        ("free_fraction", 0, 1),
    ),
    free=(("memory_free_mib", "memory_total_mib"),),
    texts=(
        ("id", MAX_TEXT_CHARS),
        ("vendor", MAX_ATTRIBUTE_CHARS),
        ("model", MAX_ATTRIBUTE_CHARS),
        ("interconnect_group", MAX_ATTRIBUTE_CHARS),
        ("health_reason", MAX_TEXT_CHARS),
    ),
    enums=(
        ("kind", _KINDS),
        ("health", frozenset(resources_pb2.DeviceHealth.values())),
        ("provenance", _PROVENANCES),
    ),
)
_PARTITION = _Rules(
    ranges=(("memory_mib", 0, MAX_DEVICE_MEMORY_MIB),),
    free=(("free", "total"),),
    texts=(("profile", MAX_ATTRIBUTE_CHARS),),
)
_LINK = _Rules(
    ranges=(
        ("bandwidth_mbps", 0, MAX_FIGURE),
        ("rtt_ms", 0, MAX_FIGURE),
        ("measured_at", 0, MAX_FIGURE),
    ),
    texts=(("peer_site", MAX_TEXT_CHARS),),
)
_REPORT = _Rules(
    texts=(("job_id", MAX_ATTRIBUTE_CHARS), ("task", MAX_ATTRIBUTE_CHARS)),
    enums=(("state", REPORTED_STATES),),
)
_CHECKPOINT = _Rules(
    ranges=(("bytes", 0, MAX_STORED_BYTES), ("progress_s", 0, MAX_FIGURE)),
    texts=(("path", MAX_TEXT_CHARS), ("site", MAX_TEXT_CHARS)),
)
_MEASURED = _Rules(
    ranges=(
        ("measured_at", 0, MAX_TIMESTAMP_S),
        ("compute", 0, 1),
        ("memory_used_mib", 0, MAX_NODE_MEMORY_MIB),
    )
)
_TIMESTAMP = _Rules(ranges=(("seconds", 0, MAX_TIMESTAMP_S), ("nanos", 0, 999_999_999)))
_STAGE = _Rules(
    ranges=(("seconds", 0, MAX_FIGURE), ("active_s", 0, MAX_FIGURE)),
    free=(("bytes_done", "bytes_total"),),
    texts=(("dataset", MAX_ATTRIBUTE_CHARS), ("source_site", MAX_ATTRIBUTE_CHARS)),
)
_COPY = _Rules(
    texts=(
        ("tenant", MAX_ATTRIBUTE_CHARS),
        ("dataset", MAX_ATTRIBUTE_CHARS),
        ("location", 2 * MAX_ATTRIBUTE_CHARS),
        ("sha256", 64),
    ),
)
_ANSWER = _Rules(
    ranges=(
        ("expected_start_s", 0, MAX_FIGURE),
        ("lease_s", 0, MAX_FIGURE),
        ("run_s", 0, MAX_FIGURE),
    ),
    texts=(("device_model", MAX_ATTRIBUTE_CHARS),),
)


def check_envelope(
    messages: Sequence[pb.AgentMessage],
    peer: str,
    *,
    first: bool,
    plans: Mapping[int, PlannedDelta] | None = None,
) -> None:
    """Refuse a stream write with any bad field; ``first`` for the stream's first write.

    Args:
        messages: The write's messages, in order.
        peer: Where the stream comes from, as gRPC names it (``ipv4:10.0.0.7:51234``).
        first: The first message is the stream's hello (named ``hello`` in field paths).
        plans: Per delta among ``messages`` (by place), what it changes of the site's view
            (``plan_deltas``), which was checked when it came: of a delta's node, only the
            devices that changed are checked.

    Raises:
        InvalidArgumentError: Naming each bad field found, up to ``MAX_VIOLATIONS``.
    """
    if len(messages) > MAX_ENVELOPE_MESSAGES:
        raise InvalidArgumentError(
            [FieldViolation("messages", f"at most {MAX_ENVELOPE_MESSAGES}, got {len(messages)}")]
        )
    check = _Check()
    try:
        for i, message in enumerate(messages):
            body = message.WhichOneof("body")
            path = "hello" if first and i == 0 else f"messages[{i}].{body}"
            if body == "hello":
                _hello(check, message.hello, path, peer)
            elif body == "view":
                _update(check, message.view, path, peer, plans.get(i) if plans else None)
            elif body == "task_status":
                _report(check, message.task_status, path)
            elif body == "offer_answer":
                check.fields(message.offer_answer, _ANSWER, path)
            elif body == "stage_progress":
                check.fields(message.stage_progress, _STAGE, path)
            elif body == "dataset_copy":
                check.fields(message.dataset_copy, _COPY, path)
    except _EnoughFound:
        pass
    if check.found:
        raise InvalidArgumentError(check.found)


def peer_address(peer: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    """The IP address in gRPC's name of a peer (``ipv4:1.2.3.4:5``, ``ipv6:%5B::1%5D:5``);
    None for a peer without one (a Unix socket)."""
    kind, _, rest = unquote(peer).partition(":")
    if kind not in ("ipv4", "ipv6"):
        return None
    host = rest.rpartition(":")[0].removeprefix("[").removesuffix("]")
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return None
    return _plain(address)


def probe_endpoint_problem(endpoint: str, peer: str) -> str | None:
    """Why peers must not be sent to ``endpoint``, or None: it must be ``host:port`` whose host
    is the address the site's stream came from, so a site can send its peers only to itself.
    A name is refused too: it could resolve elsewhere by the time a peer dials it."""
    host, sep, port = endpoint.rpartition(":")
    if not sep or not port.isdigit() or not 0 < int(port) <= 65535:
        return f"{_quoted(endpoint)} is not host:port"
    try:
        address = _plain(ipaddress.ip_address(host.removeprefix("[").removesuffix("]")))
    except ValueError:
        address = None
    seen = peer_address(peer)
    if address is None or seen is None or address != seen:
        return (
            f"host {_quoted(host)} is not the address this site connects from "
            f"({seen or 'unknown'}). To fix: set probe_advertise to that address, or leave it "
            "unset with probe_listen on it"
        )
    return None


def _plain(
    address: ipaddress.IPv4Address | ipaddress.IPv6Address,
) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    """``address``, or the IPv4 address it maps: a dual-stack listener sees IPv4 clients as
    ``::ffff:a.b.c.d``."""
    mapped = getattr(address, "ipv4_mapped", None)
    return mapped or address


class _EnoughFound(Exception):
    """``MAX_VIOLATIONS`` found: the rest of the write is not worth reading."""


class _Check:
    """Violations found so far, and the checks that find them. A field's path is built only
    for a violation: a view may hold 10,000 nodes of several devices each."""

    def __init__(self) -> None:
        self.found: list[FieldViolation] = []

    def add(self, field: str, description: str) -> None:
        self.found.append(FieldViolation(field, description))
        if len(self.found) >= MAX_VIOLATIONS:
            raise _EnoughFound

    def fields(self, message: Any, rules: _Rules, path: str) -> None:
        for name, low, high in rules.ranges:
            value = getattr(message, name)
            if not low <= value <= high:  # NaN fails too
                self.add(f"{path}.{name}", f"must be in [{_show(low)}, {_show(high)}], got {value}")
        for free, total in rules.free:
            if getattr(message, free) > getattr(message, total):
                self.add(f"{path}.{free}", f"is more than {total}")
        for name, most in rules.texts:
            if len(getattr(message, name)) > most:
                self.add(f"{path}.{name}", f"at most {most} characters")
        for name, known in rules.enums:
            if (value := getattr(message, name)) not in known:
                self.add(f"{path}.{name}", f"unknown value {value}")

    def count(self, items: Sized, path: str, name: str, most: int) -> bool:
        """Whether ``items`` are few enough to read on (else the violation is added)."""
        if len(items) <= most:
            return True
        self.add(f"{path}.{name}", f"at most {most} entries, got {len(items)}")
        return False

    def texts(self, items: Iterable[str], path: str, name: str, most: int) -> None:
        for i, item in enumerate(items):
            if len(item) > most:
                self.add(f"{path}.{name}[{i}]", f"at most {most} characters")

    def mapping(
        self, items: Mapping[str, str], path: str, name: str, most: int, chars: int
    ) -> None:
        """A map of at most ``most`` entries, keys of ``MAX_ATTRIBUTE_CHARS`` and values of
        ``chars`` characters at most."""
        if not self.count(items, path, name, most):
            return
        for key, value in items.items():
            if len(key) > MAX_ATTRIBUTE_CHARS:
                self.add(f"{path}.{name}", f"keys are at most {MAX_ATTRIBUTE_CHARS} characters")
            elif len(value) > chars:
                self.add(f"{path}.{name}[{_quoted(key)}]", f"at most {chars} characters")


def _hello(check: _Check, hello: pb.Hello, path: str, peer: str) -> None:
    _view(check, hello.view, f"{path}.view", peer)
    if check.count(hello.tasks, path, "tasks", MAX_HELLO_TASKS):
        for i, report in enumerate(hello.tasks):
            _report(check, report, f"{path}.tasks[{i}]")


def _update(
    check: _Check,
    update: pb.ViewUpdate,
    path: str,
    peer: str,
    plan: PlannedDelta | None,
) -> None:
    if update.HasField("full"):
        _view(check, update.full, f"{path}.full", peer)
        return
    delta, path = update.delta, f"{path}.delta"
    _nodes(check, delta.upserted_nodes, path, "upserted_nodes", plan)
    if check.count(delta.removed_nodes, path, "removed_nodes", MAX_VIEW_NODES):
        check.texts(delta.removed_nodes, path, "removed_nodes", MAX_TEXT_CHARS)
    # What a delta does not say it replaces is never read (``LiveView.apply``).
    if delta.has_queue:
        check.fields(delta.queue, _QUEUE, f"{path}.queue")
    if delta.has_links:
        _links(check, delta.links, path)
    if delta.has_coordinator_link:
        check.fields(delta.coordinator_link, _LINK, f"{path}.coordinator_link")


def _view(check: _Check, view: resources_pb2.SiteView, path: str, peer: str) -> None:
    check.fields(view, _SITE, path)
    check.fields(view.queue, _QUEUE, f"{path}.queue")
    _nodes(check, view.nodes, path, "nodes")
    _links(check, view.links, path)
    check.fields(view.coordinator_link, _LINK, f"{path}.coordinator_link")
    check.mapping(view.labels, path, "labels", MAX_LABELS, MAX_TEXT_CHARS)
    if check.count(view.datasets, path, "datasets", MAX_VIEW_DATASETS):
        for dataset, size in view.datasets.items():
            if len(dataset) > MAX_TEXT_CHARS or size > MAX_STORED_BYTES:
                check.add(
                    f"{path}.datasets[{_quoted(dataset)}]",
                    f"ids are at most {MAX_TEXT_CHARS} characters, sizes {MAX_STORED_BYTES} bytes",
                )
    if view.probe_endpoint and (problem := probe_endpoint_problem(view.probe_endpoint, peer)):
        check.add(f"{path}.probe_endpoint", problem)
    _owner_share(check, view.owner_share, f"{path}.owner_share")
    if check.count(view.image_registries, path, "image_registries", MAX_IMAGE_REGISTRIES):
        check.texts(view.image_registries, path, "image_registries", MAX_ATTRIBUTE_CHARS)


def _owner_share(check: _Check, share: resources_pb2.OwnerShare, path: str) -> None:
    if check.count(share.tenants, path, "tenants", MAX_LABELS):
        check.texts(share.tenants, path, "tenants", MAX_TEXT_CHARS)
    if check.count(share.keep, path, "keep", MAX_LABELS):
        for resource, amount in share.keep.items():
            if problem := resource_problem(resource):
                check.add(f"{path}.keep", problem)
            elif not 0 <= amount <= MAX_FIGURE:  # NaN fails too
                check.add(f"{path}.keep[{_quoted(resource)}]", f"must be in [0, {MAX_FIGURE:g}]")


def _nodes(
    check: _Check,
    nodes: Sequence[resources_pb2.Node],
    path: str,
    name: str,
    plan: PlannedDelta | None = None,
) -> None:
    if not check.count(nodes, path, name, MAX_VIEW_NODES):
        return
    changed = {c.now.name: c for c in plan.changes if c.now is not None} if plan else {}
    for i, node in enumerate(nodes):
        where = f"{path}.{name}[{i}]"
        check.fields(node, _NODE, where)
        _measured(check, node.measured, node.memory_mib, f"{where}.measured")
        check.mapping(node.labels, where, "labels", MAX_LABELS, MAX_TEXT_CHARS)
        _images(check, node.images, where)
        devices = node.devices
        if not check.count(devices, where, "devices", MAX_NODE_DEVICES):
            continue
        change = changed.get(node.name)
        places: Sequence[int] = range(len(devices))
        if change is not None and change.now is node:  # else named twice: the plan read the last
            places = change.came_at
        for j in places:
            _device(check, devices[j], f"{where}.devices[{j}]")


def _images(check: _Check, images: Sequence[resources_pb2.CachedImage], path: str) -> None:
    if not check.count(images, path, "images", MAX_NODE_IMAGES):
        return
    for i, image in enumerate(images):
        where = f"{path}.images[{i}]"
        check.fields(image, _IMAGE, where)
        if check.count(image.references, where, "references", MAX_IMAGE_REFERENCES):
            check.texts(image.references, where, "references", MAX_ATTRIBUTE_CHARS)


def _measured(check: _Check, use: resources_pb2.MeasuredUse, total_mib: int, path: str) -> None:
    check.fields(use, _MEASURED, path)
    if use.memory_used_mib > total_mib:
        check.add(f"{path}.memory_used_mib", "is more than the memory there is")


def _device(check: _Check, device: resources_pb2.Device, path: str) -> None:
    check.fields(device, _DEVICE, path)
    _measured(check, device.measured, device.memory_total_mib, f"{path}.measured")
    check.mapping(device.attributes, path, "attributes", MAX_DEVICE_ATTRIBUTES, MAX_ATTRIBUTE_CHARS)
    if check.count(device.partitions, path, "partitions", MAX_DEVICE_PARTITIONS):
        for k, partition in enumerate(device.partitions):
            check.fields(partition, _PARTITION, f"{path}.partitions[{k}]")


def _links(check: _Check, links: Sequence[resources_pb2.Link], path: str) -> None:
    if check.count(links, path, "links", MAX_VIEW_LINKS):
        for i, link in enumerate(links):
            check.fields(link, _LINK, f"{path}.links[{i}]")


def _report(check: _Check, report: pb.TaskReport, path: str) -> None:
    # Output and reason are cut to size where they are kept (``JobManager``).
    check.fields(report, _REPORT, path)
    if check.count(report.devices, path, "devices", MAX_REPORT_DEVICES):
        check.texts(report.devices, path, "devices", MAX_TEXT_CHARS)
    if check.count(report.nodes, path, "nodes", MAX_REPLICAS):
        check.texts(report.nodes, path, "nodes", MAX_TEXT_CHARS)
    if report.HasField("checkpoint"):
        check.fields(report.checkpoint, _CHECKPOINT, f"{path}.checkpoint")
        check.fields(report.checkpoint.time, _TIMESTAMP, f"{path}.checkpoint.time")


def _show(value: float) -> str:
    """Exact for whole numbers (no 1.07374e+09), plain otherwise."""
    return str(int(value)) if math.isfinite(value) and float(value).is_integer() else str(value)


def _quoted(value: str, limit: int = 64) -> str:
    """``value`` quoted for an error message, cut short: messages must not echo huge input."""
    return repr(value) if len(value) <= limit else repr(value[:limit]) + f"… ({len(value)} chars)"
