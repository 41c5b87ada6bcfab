"""NVIDIA GPUs through NVML: canonical model, memory, health, MIG and NVLink groups.

A query a GPU or driver does not support (power on a MIG slice, ECC on a GeForce card, row
remapping before Ampere, MIG before Ampere) reads as unknown: the field keeps its zero, the
attribute is left out. A query that fails for another reason degrades the GPU, and one that
cannot read the GPU at all (handle, name, memory) makes it unhealthy. Xid events (``XidWatch``)
are gathered between discoveries: a critical one makes its GPU unhealthy.
"""

from __future__ import annotations

import ctypes
import math
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from itertools import combinations
from typing import Any, TypeVar

import pynvml
import structlog

from federation.agent.discovery.models import canonical_model
from federation.agent.discovery.plugin import Scan
from federation.api.v1 import resources_pb2

log = structlog.get_logger()

_MIB = 1024 * 1024
_T = TypeVar("_T")

# Errors that mean "this GPU or driver cannot answer that", not "something is wrong".
_UNSUPPORTED = frozenset(
    {
        pynvml.NVML_ERROR_NOT_SUPPORTED,
        pynvml.NVML_ERROR_NO_PERMISSION,
        pynvml.NVML_ERROR_FUNCTION_NOT_FOUND,
        pynvml.NVML_ERROR_INVALID_ARGUMENT,
        pynvml.NVML_ERROR_NOT_FOUND,
    }
)
# nvmlInit errors of a machine with no NVIDIA driver: no GPUs, and nothing wrong.
_NO_DRIVER = frozenset({pynvml.NVML_ERROR_LIBRARY_NOT_FOUND, pynvml.NVML_ERROR_DRIVER_NOT_LOADED})
_MIG_MODES = {pynvml.NVML_DEVICE_MIG_ENABLE: "enabled", pynvml.NVML_DEVICE_MIG_DISABLE: "disabled"}

CRITICAL_XIDS: Mapping[int, str] = {
    48: "double-bit ECC error",
    63: "ECC page retirement or row remapping recorded",
    64: "ECC page retirement or row remapping failed",
    74: "NVLink error",
    79: "fallen off the bus",
    92: "high single-bit ECC error rate",
    94: "contained ECC error",
    95: "uncontained ECC error",
}
"""Xids after which a GPU should take no new work until it is reset or serviced. Others (13
graphics engine exception, 31 MMU fault, 43 a stopped channel, ...) are mostly one
application's fault and only recorded."""
_MAX_EVENTS_PER_POLL = 1024


def _optional(default: _T, call: Callable[..., _T], *args: Any) -> _T:
    """Result of an NVML query, or ``default`` when it fails for any reason."""
    try:
        return call(*args)
    except pynvml.NVMLError:
        return default


class _Queries:
    """NVML queries on one GPU that remember the ones that failed (not merely unsupported)."""

    def __init__(self, handle: Any) -> None:
        self.handle = handle
        self.failed: list[str] = []

    def get(self, default: _T, call: Callable[..., _T], *args: Any) -> _T:
        try:
            return call(self.handle, *args)
        except pynvml.NVMLError as exc:
            if exc.value not in _UNSUPPORTED:
                self.failed.append(f"{call.__name__.removeprefix('nvmlDeviceGet')}: {exc}")
            return default


@dataclass(frozen=True, slots=True)
class HealthReadings:
    """What NVML said about a GPU's health; False where it could not say."""

    retired_pages_pending: bool = False
    """Pages await retirement (pre-Ampere), which takes a GPU reset."""
    row_remap_pending: bool = False
    """Rows await remapping (Ampere and later), which takes a GPU reset."""
    row_remap_failed: bool = False
    """A row could not be remapped: the GPU needs service."""
    failed_queries: tuple[str, ...] = ()
    critical_xids: tuple[int, ...] = ()
    """Critical Xids (``CRITICAL_XIDS``) the GPU raised since the agent started watching."""


def gpu_health(readings: HealthReadings) -> tuple[resources_pb2.DeviceHealth.ValueType, str]:
    """A GPU's health and the reason for it (empty when healthy)."""
    fatal = [
        *(["row remapping failed: the GPU needs service"] if readings.row_remap_failed else []),
        *(f"Xid {xid} ({CRITICAL_XIDS.get(xid, 'critical')})" for xid in readings.critical_xids),
    ]
    if readings.critical_xids:
        fatal[-1] += ": reset or service the GPU"
    if fatal:
        return resources_pb2.DEVICE_HEALTH_UNHEALTHY, "; ".join(fatal)
    reasons = [
        *(["pages pending retirement: reset the GPU"] if readings.retired_pages_pending else []),
        *(["rows pending remapping: reset the GPU"] if readings.row_remap_pending else []),
        *(f"NVML query failed: {query}" for query in readings.failed_queries),
    ]
    if reasons:
        return resources_pb2.DEVICE_HEALTH_DEGRADED, "; ".join(reasons)
    return resources_pb2.DEVICE_HEALTH_HEALTHY, ""


def _address(handle: Any) -> int | None:
    """Where an NVML device handle points: the same GPU gives the same address while NVML is
    initialised, even once the GPU no longer answers queries."""
    return ctypes.cast(handle, ctypes.c_void_p).value


class XidWatch:
    """Xid events of this host's GPUs, gathered from one discovery to the next.

    An event set receives only what happens after a GPU is registered with it, so the set lives
    as long as the watch, and so does the NVML initialisation it holds (``close`` gives both
    back): resetting a GPU may then need the agent stopped, as it needs DCGM stopped. A critical
    Xid keeps its GPU unhealthy for as long as the watch lives (until the agent restarts).
    Every method is safe to call from several threads and never raises for an NVML error: a
    driver without events (``NVML_ERROR_NOT_SUPPORTED``) leaves the GPUs as they were.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._events: Any = None
        self._unsupported = False  # the driver has no event sets: never ask again
        self._uuids: dict[int | None, str] = {}  # address of a registered handle -> GPU UUID
        self._tried: set[str] = set()  # UUIDs registered, or that cannot be
        self._critical: dict[str, list[int]] = {}
        self._last: dict[str, int] = {}

    def _event_set(self) -> Any:
        """The event set, created with its own NVML reference the first time; None if NVML has
        none to give."""
        if self._events is None and not self._unsupported:
            try:
                pynvml.nvmlInit()
            except pynvml.NVMLError as exc:
                log.debug("nvml_xid_watch_unavailable", error=str(exc))
                return None
            try:
                self._events = pynvml.nvmlEventSetCreate()
            except pynvml.NVMLError as exc:
                log.info("nvml_xid_events_unavailable", error=str(exc))
                self._unsupported = exc.value in _UNSUPPORTED  # else tried again next time
                _optional(None, pynvml.nvmlShutdown)
        return self._events

    def register(self, handle: Any, uuid: str) -> None:
        """Watch a GPU for Xid events, once; a GPU without them (or a failure) is left out."""
        with self._lock:
            if uuid in self._tried or (events := self._event_set()) is None:
                return
            try:
                pynvml.nvmlDeviceRegisterEvents(
                    handle, pynvml.nvmlEventTypeXidCriticalError, events
                )
            except pynvml.NVMLError as exc:
                if exc.value not in _UNSUPPORTED:
                    log.warning("nvml_xid_register_failed", gpu=uuid, error=str(exc))
                    return  # tried again at the next discovery
                log.info("nvml_xid_events_unsupported", gpu=uuid, error=str(exc))
            else:
                self._uuids[_address(handle)] = uuid
            self._tried.add(uuid)

    def poll(self) -> None:
        """Takes the events that arrived since the last poll, without waiting."""
        with self._lock:
            if self._events is None:
                return
            for _ in range(_MAX_EVENTS_PER_POLL):
                try:
                    data = pynvml.nvmlEventSetWait(self._events, 0)
                except pynvml.NVMLError as exc:
                    if exc.value != pynvml.NVML_ERROR_TIMEOUT:
                        log.warning("nvml_xid_wait_failed", error=str(exc))
                    return
                if data.eventType != pynvml.nvmlEventTypeXidCriticalError:
                    continue
                uuid = self._uuids.get(_address(data.device))
                xid = int(data.eventData)
                log.warning("nvidia_gpu_xid", gpu=uuid, xid=xid, critical=xid in CRITICAL_XIDS)
                if uuid is None:
                    continue
                if xid not in CRITICAL_XIDS:
                    self._last[uuid] = xid
                elif xid not in (seen := self._critical.setdefault(uuid, [])):
                    seen.append(xid)

    def critical(self, uuid: str) -> tuple[int, ...]:
        """The distinct critical Xids the GPU raised, in the order first seen."""
        with self._lock:
            return tuple(self._critical.get(uuid, ()))

    def last(self, uuid: str) -> int | None:
        """The latest Xid the GPU raised that is not critical."""
        with self._lock:
            return self._last.get(uuid)

    def close(self) -> None:
        """Frees the event set and gives back the NVML reference it held."""
        with self._lock:
            if self._events is not None:
                _optional(None, pynvml.nvmlEventSetFree, self._events)
                _optional(None, pynvml.nvmlShutdown)
            self._events = None
            self._uuids.clear()
            self._tried.clear()


XIDS = XidWatch()
"""The watch discovery uses unless handed another."""


def interconnect_groups(linked: Sequence[Sequence[bool]]) -> list[str]:
    """The NVLink group of each GPU, from which pairs of GPUs NVLink joins.

    Args:
        linked: Symmetric matrix; ``linked[i][j]`` when GPUs i and j reach each other over
            NVLink, directly or through NVSwitch.

    Returns:
        Per GPU, ``"nvlink-<k>"`` shared by every GPU it reaches over NVLink, in any number of
        hops (a DGX-1's cube mesh is one group), k counting groups in GPU order; ``""`` for a
        GPU that NVLink joins to none, which is a group of its own.
    """
    n = len(linked)
    group = [-1] * n
    count = 0
    for start in range(n):
        if group[start] >= 0 or not any(linked[start][j] for j in range(n) if j != start):
            continue
        group[start], reach = count, [start]
        while reach:
            i = reach.pop()
            for j in range(n):
                if linked[i][j] and group[j] < 0:
                    group[j] = count
                    reach.append(j)
        count += 1
    return [f"nvlink-{g}" if g >= 0 else "" for g in group]


def _nvlink_matrix(handles: Sequence[Any]) -> list[list[bool]]:
    """Which pairs of GPUs NVML says can do peer-to-peer over NVLink (None: an unread GPU)."""
    linked = [[False] * len(handles) for _ in handles]
    for i, j in combinations(range(len(handles)), 2):
        if handles[i] is None or handles[j] is None:
            continue
        status = _optional(
            None,
            pynvml.nvmlDeviceGetP2PStatus,
            handles[i],
            handles[j],
            pynvml.NVML_P2P_CAPS_INDEX_NVLINK,
        )
        linked[i][j] = linked[j][i] = status == pynvml.NVML_P2P_STATUS_OK
    return linked


def _health_readings(
    q: _Queries, device: resources_pb2.Device, critical_xids: tuple[int, ...] = ()
) -> HealthReadings:
    """ECC mode and error counts, retired pages and remapped rows, as attributes and readings.

    Run it after the GPU's other queries: its readings carry every query that failed.
    """
    ecc_mode = q.get(None, pynvml.nvmlDeviceGetEccMode)  # [current, pending]
    if ecc_mode is not None:
        device.attributes["ecc"] = "on" if ecc_mode[0] == pynvml.NVML_FEATURE_ENABLED else "off"
    # Errors since the driver loaded; counts exist only while ECC is on.
    for error_type, name in (
        (pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, "ecc_uncorrected_volatile"),
        (pynvml.NVML_MEMORY_ERROR_TYPE_CORRECTED, "ecc_corrected_volatile"),
    ):
        if device.attributes.get("ecc") == "on":
            errors = q.get(
                None, pynvml.nvmlDeviceGetTotalEccErrors, error_type, pynvml.NVML_VOLATILE_ECC
            )
            if errors is not None:
                device.attributes[name] = str(errors)
    retired = [
        q.get(None, pynvml.nvmlDeviceGetRetiredPages, cause)
        for cause in (
            pynvml.NVML_PAGE_RETIREMENT_CAUSE_MULTIPLE_SINGLE_BIT_ECC_ERRORS,
            pynvml.NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR,
        )
    ]
    if all(pages is not None for pages in retired):
        device.attributes["retired_pages"] = str(sum(len(pages) for pages in retired))
    pending = q.get(None, pynvml.nvmlDeviceGetRetiredPagesPendingStatus)
    # (corrected rows, uncorrected rows, remap pending, remap failed)
    remap = q.get(None, pynvml.nvmlDeviceGetRemappedRows)
    if remap is not None:
        device.attributes["remapped_rows"] = str(remap[0] + remap[1])
    return HealthReadings(
        retired_pages_pending=pending == pynvml.NVML_FEATURE_ENABLED,
        row_remap_pending=bool(remap and remap[2]),
        row_remap_failed=bool(remap and remap[3]),
        failed_queries=tuple(q.failed),
        critical_xids=critical_xids,
    )


def _gpu_instances(q: _Queries, profile_id: int, most: int) -> int:
    """How many GPU instances of a profile (NVML's profile id) exist on the GPU."""
    count = ctypes.c_uint(0)
    instances = (pynvml.c_nvmlGpuInstance_t * max(1, most))()
    q.get(None, pynvml.nvmlDeviceGetGpuInstances, profile_id, instances, ctypes.pointer(count))
    return count.value


def _mig(q: _Queries, device: resources_pb2.Device) -> list[resources_pb2.PartitionProfile]:
    """The GPU's MIG mode as attributes, and its partition profiles when MIG is on.

    Attributes: ``mig_mode`` (``enabled`` or ``disabled``), ``mig_mode_pending`` where a
    change waits for a GPU reset, and with MIG on ``mig_gpu_instances``, how many GPU
    instances exist. A GPU without MIG gets none of them and no profiles.

    The embedded core counts slots, names the profile to the task (``FEDERATION_PARTITION``)
    and, where the instances exist, gives each replica one of them by name
    (``CUDA_VISIBLE_DEVICES=MIG-<uuid>``, the profile's ``instances``); it does not create GPU
    instances. So while none exist, each
    profile the GPU offers is listed with ``total`` the instances it holds when cut into that
    profile alone (an operator or a MIG manager makes them). Once some exist, the GPU is cut:
    only the profiles of the existing instances are listed, ``total`` counting them.
    """
    modes = q.get(None, pynvml.nvmlDeviceGetMigMode)  # [current, pending]
    if modes is None or modes[0] not in _MIG_MODES:
        return []
    current, pending = modes
    device.attributes["mig_mode"] = _MIG_MODES[current]
    if pending != current and pending in _MIG_MODES:
        device.attributes["mig_mode_pending"] = _MIG_MODES[pending]
    if current != pynvml.NVML_DEVICE_MIG_ENABLE:
        return []
    offered: dict[str, resources_pb2.PartitionProfile] = {}
    existing: dict[str, resources_pb2.PartitionProfile] = {}
    for profile_index in range(getattr(pynvml, "NVML_GPU_INSTANCE_PROFILE_COUNT", 0)):
        info = _optional(None, pynvml.nvmlDeviceGetGpuInstanceProfileInfo, q.handle, profile_index)
        if info is None or not info.instanceCount:
            continue  # a profile this GPU does not offer
        name = _profile_name(info)
        offered.setdefault(
            name,
            resources_pb2.PartitionProfile(
                profile=name,
                total=info.instanceCount,
                free=info.instanceCount,
                memory_mib=info.memorySizeMB,
            ),
        )
        if made := _gpu_instances(q, info.id, info.instanceCount):
            slots = existing.setdefault(
                name, resources_pb2.PartitionProfile(profile=name, memory_mib=info.memorySizeMB)
            )
            slots.total += made
            slots.free += made
    device.attributes["mig_gpu_instances"] = str(sum(p.total for p in existing.values()))
    if existing:
        names = {info_id: name for info_id, name in _profile_ids(q, offered)}
        for name, uuids in _mig_devices(q, names).items():
            if name in existing:
                existing[name].instances.extend(uuids[: existing[name].total])
    return list((existing or offered).values())


def _profile_name(info: Any) -> str:
    """A GPU instance profile's name: NVML says "MIG 1g.10gb"; older drivers say nothing."""
    raw = info.name.decode(errors="replace") if isinstance(info.name, bytes) else ""
    return raw.removeprefix("MIG ").strip() or (
        f"{info.sliceCount}g.{math.ceil(info.memorySizeMB / 1024)}gb"
    )


def _profile_ids(
    q: _Queries, offered: Mapping[str, resources_pb2.PartitionProfile]
) -> Iterator[tuple[int, str]]:
    """(NVML's profile id, profile name) of each profile the GPU offers."""
    for profile_index in range(getattr(pynvml, "NVML_GPU_INSTANCE_PROFILE_COUNT", 0)):
        info = _optional(None, pynvml.nvmlDeviceGetGpuInstanceProfileInfo, q.handle, profile_index)
        if info is None or not info.instanceCount:
            continue
        if (name := _profile_name(info)) in offered:
            yield info.id, name


def _mig_devices(q: _Queries, profile_names: Mapping[int, str]) -> dict[str, list[str]]:
    """The MIG devices on the GPU (what a runtime is given: ``MIG-<uuid>``), by the profile of
    the GPU instance each belongs to; one that cannot be read is left out."""
    out: dict[str, list[str]] = {}
    for i in range(_optional(0, pynvml.nvmlDeviceGetMaxMigDeviceCount, q.handle)):
        mig = _optional(None, pynvml.nvmlDeviceGetMigDeviceHandleByIndex, q.handle, i)
        if mig is None:
            continue  # an empty slot
        uuid = str(_optional("", pynvml.nvmlDeviceGetUUID, mig))
        instance_id = _optional(None, pynvml.nvmlDeviceGetGpuInstanceId, mig)
        if not uuid or instance_id is None:
            continue
        instance = _optional(None, pynvml.nvmlDeviceGetGpuInstanceById, q.handle, instance_id)
        info = _optional(None, pynvml.nvmlGpuInstanceGetInfo, instance) if instance else None
        if info is not None and (name := profile_names.get(info.profileId)):
            out.setdefault(name, []).append(uuid)
    return out


def _nvidia_gpu(
    index: int,
    driver: str,
    cuda: str,
    model_names: Mapping[str, str] | None,
    xids: XidWatch,
) -> tuple[resources_pb2.Device, Any]:
    """One GPU from NVML and its handle; a GPU NVML cannot read is unhealthy, with no handle."""
    device = resources_pb2.Device(
        id=str(index),
        index=index,
        kind=resources_pb2.DEVICE_KIND_GPU,
        vendor="nvidia",
        provenance=resources_pb2.PROVENANCE_DISCOVERED,
        attributes={"driver": driver, **({"cuda": cuda} if cuda else {})},
    )
    try:
        handle = pynvml.nvmlDeviceGetHandleByIndex(index)
        device.id = str(pynvml.nvmlDeviceGetUUID(handle))
        nvml_name = str(pynvml.nvmlDeviceGetName(handle))
        memory = pynvml.nvmlDeviceGetMemoryInfo(handle)
    except pynvml.NVMLError as exc:
        log.warning("nvidia_gpu_unreadable", index=index, error=str(exc))
        device.health = resources_pb2.DEVICE_HEALTH_UNHEALTHY
        device.health_reason = f"NVML: {exc}"
        return device, None
    device.model = canonical_model(nvml_name, model_names)
    device.attributes["nvml_name"] = nvml_name
    device.memory_total_mib = int(memory.total) // _MIB
    device.memory_free_mib = int(memory.free) // _MIB
    q = _Queries(handle)
    # NVML reports milliwatts.
    device.power_watts = q.get(0, pynvml.nvmlDeviceGetPowerUsage) / 1000
    device.power_tdp_watts = q.get(0, pynvml.nvmlDeviceGetEnforcedPowerLimit) / 1000
    device.temperature_c = q.get(0, pynvml.nvmlDeviceGetTemperature, pynvml.NVML_TEMPERATURE_GPU)
    device.measured.measured_at = time.time()
    device.measured.memory_used_mib = int(memory.used) // _MIB
    if (rates := q.get(None, pynvml.nvmlDeviceGetUtilizationRates)) is not None:
        device.measured.compute = min(1.0, max(0.0, rates.gpu / 100))
    major, minor = _optional((0, 0), pynvml.nvmlDeviceGetCudaComputeCapability, handle)
    if major:
        device.attributes["compute_capability"] = f"{major}.{minor}"
    device.partitions.extend(_mig(q, device))
    xids.register(handle, device.id)
    if (last_xid := xids.last(device.id)) is not None:
        device.attributes["last_xid"] = str(last_xid)
    readings = _health_readings(q, device, xids.critical(device.id))
    device.health, device.health_reason = gpu_health(readings)
    if device.health != resources_pb2.DEVICE_HEALTH_HEALTHY:
        log.warning("nvidia_gpu_not_healthy", index=index, reason=device.health_reason)
    return device, handle


def scan_nvidia_gpus(
    model_names: Mapping[str, str] | None = None, xids: XidWatch | None = None
) -> Scan:
    """NVIDIA GPUs on this machine via NVML; nothing when it has no NVIDIA driver.

    Args:
        model_names: The site's extra canonical names (see ``models.canonical_model``).
        xids: Where Xid events are gathered between scans; the module's ``XIDS`` if None.

    Returns:
        One discovered device per GPU, in NVML index order, with attributes ``driver``,
        ``cuda``, ``compute_capability``, ``nvml_name`` and, where NVML knows them, ``ecc``,
        ``ecc_uncorrected_volatile``, ``ecc_corrected_volatile``, ``retired_pages``,
        ``remapped_rows``, the MIG attributes (see ``_mig``) and ``last_xid``; and a problem
        where a driver is there but NVML cannot use it.
    """
    xids = XIDS if xids is None else xids
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as exc:
        if exc.value in _NO_DRIVER:
            log.debug("nvml_unavailable", error=str(exc))
            return Scan()
        log.warning("nvml_init_failed", error=str(exc))
        return Scan(problems=(f"NVML cannot start: {exc}",))
    try:
        driver = str(_optional("", pynvml.nvmlSystemGetDriverVersion))
        cuda_raw = int(_optional(0, pynvml.nvmlSystemGetCudaDriverVersion))
        # NVML encodes CUDA 12.4 as 12040.
        cuda = f"{cuda_raw // 1000}.{cuda_raw % 1000 // 10}" if cuda_raw else ""
        count = _optional(None, pynvml.nvmlDeviceGetCount)
        xids.poll()  # what GPUs registered by earlier scans raised since
        gpus = [_nvidia_gpu(index, driver, cuda, model_names, xids) for index in range(count or 0)]
        groups = interconnect_groups(_nvlink_matrix([handle for _, handle in gpus]))
    finally:
        _optional(None, pynvml.nvmlShutdown)
    devices = [device for device, _ in gpus]
    for device, group in zip(devices, groups, strict=True):
        device.interconnect_group = group
    log.info("nvidia_gpus_discovered", count=len(devices), driver=driver, cuda=cuda)
    problems = () if count is not None else ("NVML cannot count the GPUs",)
    return Scan(devices=tuple(devices), problems=problems)


def discover_nvidia_gpus(
    model_names: Mapping[str, str] | None = None,
) -> list[resources_pb2.Device]:
    """The devices of ``scan_nvidia_gpus``, without its problems."""
    return list(scan_nvidia_gpus(model_names).devices)
