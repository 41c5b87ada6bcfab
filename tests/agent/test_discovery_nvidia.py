"""The parts of NVIDIA discovery that need no GPU: NVLink groups, health from readings, an
NVML that cannot start, and MIG and Xid events over a stand-in for NVML (``StandInNvml``).

The NVML path itself is tested against real GPUs in ``test_discovery.py`` where a GPU exists.
"""

from __future__ import annotations

import ctypes
import inspect
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import pynvml
import pytest

from federation.agent.discovery.nvidia import (
    HealthReadings,
    XidWatch,
    gpu_health,
    interconnect_groups,
    scan_nvidia_gpus,
)
from federation.agent.discovery.plugin import Scan
from federation.api.v1 import resources_pb2


def _matrix(n: int, pairs: list[tuple[int, int]]) -> list[list[bool]]:
    linked = [[False] * n for _ in range(n)]
    for i, j in pairs:
        linked[i][j] = linked[j][i] = True
    return linked


def test_nvswitch_joins_every_gpu() -> None:
    """On an NVSwitch board (HGX) every pair reaches each other: one group."""
    pairs = [(i, j) for i in range(8) for j in range(i + 1, 8)]
    assert interconnect_groups(_matrix(8, pairs)) == ["nvlink-0"] * 8


def test_bridged_pairs_form_one_group_each() -> None:
    """PCIe cards joined two by two with NVLink bridges form one group per pair."""
    groups = interconnect_groups(_matrix(4, [(0, 1), (2, 3)]))
    assert groups == ["nvlink-0", "nvlink-0", "nvlink-1", "nvlink-1"]


def test_groups_follow_links_over_several_hops() -> None:
    """GPUs joined through others (a cube mesh) share a group; groups count in GPU order."""
    groups = interconnect_groups(_matrix(5, [(3, 4), (0, 2), (2, 4)]))
    assert groups == ["nvlink-0", "", "nvlink-0", "nvlink-0", "nvlink-0"]


def test_gpus_without_nvlink_have_no_group() -> None:
    """A GPU NVLink joins to nothing is its own group (empty), as are all GPUs of a PCIe box."""
    assert interconnect_groups(_matrix(3, [])) == ["", "", ""]
    assert interconnect_groups([]) == []


@pytest.mark.parametrize(
    ("readings", "health", "words"),
    [
        (HealthReadings(), resources_pb2.DEVICE_HEALTH_HEALTHY, ""),
        (
            HealthReadings(retired_pages_pending=True),
            resources_pb2.DEVICE_HEALTH_DEGRADED,
            "pages pending retirement",
        ),
        (
            HealthReadings(row_remap_pending=True),
            resources_pb2.DEVICE_HEALTH_DEGRADED,
            "rows pending remapping",
        ),
        (
            HealthReadings(failed_queries=("Temperature: GPU is lost",)),
            resources_pb2.DEVICE_HEALTH_DEGRADED,
            "NVML query failed: Temperature: GPU is lost",
        ),
        (
            HealthReadings(row_remap_pending=True, row_remap_failed=True),
            resources_pb2.DEVICE_HEALTH_UNHEALTHY,
            "row remapping failed",
        ),
        (
            HealthReadings(critical_xids=(48,)),
            resources_pb2.DEVICE_HEALTH_UNHEALTHY,
            "Xid 48 (double-bit ECC error): reset or service the GPU",
        ),
        (
            HealthReadings(row_remap_failed=True, critical_xids=(64, 79)),
            resources_pb2.DEVICE_HEALTH_UNHEALTHY,
            "row remapping failed: the GPU needs service; Xid 64 (ECC page retirement or row "
            "remapping failed); Xid 79 (fallen off the bus): reset or service the GPU",
        ),
    ],
)
def test_health_follows_readings(
    readings: HealthReadings, health: resources_pb2.DeviceHealth.ValueType, words: str
) -> None:
    """Pending retirement or remapping and failing queries degrade; a failed remap is fatal."""
    got, reason = gpu_health(readings)
    assert got == health
    assert words in reason
    assert bool(reason) == (health != resources_pb2.DEVICE_HEALTH_HEALTHY)


def test_every_reason_is_kept() -> None:
    """Several problems are all named, in one reason."""
    _, reason = gpu_health(HealthReadings(retired_pages_pending=True, failed_queries=("Ecc: x",)))
    assert "pages pending retirement" in reason
    assert "Ecc: x" in reason


@pytest.mark.parametrize(
    ("error", "problems"),
    [
        (pynvml.NVML_ERROR_LIBRARY_NOT_FOUND, ()),
        (pynvml.NVML_ERROR_DRIVER_NOT_LOADED, ()),
        (
            pynvml.NVML_ERROR_LIB_RM_VERSION_MISMATCH,
            ("NVML cannot start: RM has detected an NVML/RM version mismatch.",),
        ),
    ],
)
def test_nvml_that_cannot_start(
    monkeypatch: pytest.MonkeyPatch, error: int, problems: tuple[str, ...]
) -> None:
    """No driver means no GPUs and nothing wrong; a driver NVML cannot use is a problem."""

    def fail() -> None:
        raise pynvml.NVMLError(error)

    monkeypatch.setattr(pynvml, "nvmlInit", fail)
    assert scan_nvidia_gpus() == Scan(problems=problems)


# --- MIG and Xid events over a stand-in for NVML ---------------------------------------------

_XID = pynvml.nvmlEventTypeXidCriticalError


def _profile(index: int, name: str, slices: int, count: int, memory_mb: int) -> Any:
    """NVML's GPU instance profile info, the fields discovery reads; ``id`` is NVML's
    profile id, here the profile index plus 100 so the two cannot be confused."""
    return SimpleNamespace(
        id=index + 100,
        sliceCount=slices,
        instanceCount=count,
        memorySizeMB=memory_mb,
        name=f"MIG {name}".encode(),
    )


A100_PROFILES = {
    0: _profile(0, "1g.10gb", 1, 7, 9856),
    2: _profile(2, "3g.40gb", 3, 2, 40192),
    4: _profile(4, "7g.80gb", 7, 1, 80896),
}
"""Some of an A100 80GB's MIG profiles, as its NVML describes them."""


@dataclass
class StandInGpu:
    """One GPU as the stand-in NVML describes it."""

    uuid: str
    mig: tuple[int, int] | None = None
    """(current, pending) MIG mode; None: a GPU without MIG (NVML_ERROR_NOT_SUPPORTED)."""
    profiles: dict[int, Any] = field(default_factory=dict)
    """Profile index -> profile info, for the profiles the GPU offers."""
    instances: dict[int, int] = field(default_factory=dict)
    """NVML profile id -> GPU instances of it that exist."""
    events: bool = True
    """Whether the GPU can be registered for events (False: NVML_ERROR_NOT_SUPPORTED)."""
    fail: dict[str, int] = field(default_factory=dict)
    """NVML function name -> the error it raises on this GPU."""


class StandInNvml:
    """A STAND-IN for NVML, not NVIDIA's library: a few dozen lines answering the calls
    discovery makes (init, count, handle, UUID, name, memory, MIG mode, GPU instance profiles
    and instances, MIG devices and their UUIDs, event sets) from ``StandInGpu`` descriptions;
    every other ``nvml*`` function of pynvml raises NVML_ERROR_NOT_SUPPORTED, as a GPU without
    those features does. Its behaviour follows NVML's documentation, not a recording of a real
    driver: handles are ctypes device pointers (a MIG device's: its GPU's plus 1 plus its
    index), an event set only receives the Xids of GPUs registered with it after they were
    registered, ``nvmlEventSetWait`` with nothing queued raises NVML_ERROR_TIMEOUT, and
    nvmlInit/nvmlShutdown are counted as NVML counts them.
    """

    def __init__(self, gpus: list[StandInGpu], *, event_sets: bool = True) -> None:
        self.gpus = gpus
        self.event_sets = event_sets
        self.inits = 0
        self.sets: dict[int, list[tuple[int, int]]] = {}  # set -> queued (gpu, xid)
        self.registered: dict[int, set[int]] = {}  # set -> gpus registered with it
        self.set_creations = 0

    def install(self, monkeypatch: pytest.MonkeyPatch) -> None:
        """Replaces every nvml* function of pynvml: with the stand-in's or a not-supported one."""
        for name, _fn in inspect.getmembers(pynvml, inspect.isfunction):
            if name.startswith("nvml"):
                monkeypatch.setattr(pynvml, name, getattr(self, name, _not_supported(name)))

    def xid(self, gpu: int, xid: int) -> None:
        """The driver reports an Xid on GPU ``gpu``: every set it is registered with gets it."""
        for events, gpus in self.registered.items():
            if gpu in gpus:
                self.sets[events].append((gpu, xid))

    def _gpu(self, handle: Any) -> tuple[int, StandInGpu]:
        if not self.inits:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_UNINITIALIZED)
        index = (ctypes.cast(handle, ctypes.c_void_p).value or 0) // 0x100 - 1
        return index, self.gpus[index]

    def _mig(self, handle: Any) -> tuple[StandInGpu, int, int]:
        """A MIG device handle (its GPU's + 1 + its index): the GPU, the instance's NVML
        profile id and its number among that profile's instances."""
        gpu = self._gpu(handle)[1]
        k = (ctypes.cast(handle, ctypes.c_void_p).value or 0) % 0x100 - 1
        made = [(profile, n) for profile, count in gpu.instances.items() for n in range(count)]
        return gpu, *made[k]

    def _call(self, handle: Any, name: str) -> StandInGpu:
        gpu = self._gpu(handle)[1]
        if name in gpu.fail:
            raise pynvml.NVMLError(gpu.fail[name])
        return gpu

    def nvmlInit(self) -> None:
        self.inits += 1

    def nvmlShutdown(self) -> None:
        if not self.inits:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_UNINITIALIZED)
        self.inits -= 1
        if not self.inits:  # NVML frees every event set with its last reference
            self.sets.clear()
            self.registered.clear()

    def nvmlSystemGetDriverVersion(self) -> str:
        return "550.54.15"

    def nvmlSystemGetCudaDriverVersion(self) -> int:
        return 12040

    def nvmlDeviceGetCount(self) -> int:
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> Any:
        if not self.inits:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_UNINITIALIZED)
        return ctypes.cast(ctypes.c_void_p(0x100 * (index + 1)), pynvml.c_nvmlDevice_t)

    def nvmlDeviceGetUUID(self, handle: Any) -> str:
        if (ctypes.cast(handle, ctypes.c_void_p).value or 0) % 0x100:
            gpu, profile, n = self._mig(handle)
            return f"MIG-{gpu.uuid}-{profile}-{n}"
        return self._gpu(handle)[1].uuid

    def nvmlDeviceGetMaxMigDeviceCount(self, handle: Any) -> int:
        gpu = self._call(handle, "nvmlDeviceGetMaxMigDeviceCount")
        if gpu.mig is None:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return 7

    def nvmlDeviceGetMigDeviceHandleByIndex(self, handle: Any, index: int) -> Any:
        gpu = self._gpu(handle)[1]
        if index >= sum(gpu.instances.values()):
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_FOUND)
        base = ctypes.cast(handle, ctypes.c_void_p).value or 0
        return ctypes.cast(ctypes.c_void_p(base + 1 + index), pynvml.c_nvmlDevice_t)

    def nvmlDeviceGetGpuInstanceId(self, mig: Any) -> int:
        _, profile, n = self._mig(mig)
        return profile * 10 + n

    def nvmlDeviceGetGpuInstanceById(self, handle: Any, instance_id: int) -> Any:
        return SimpleNamespace(profile=instance_id // 10)

    def nvmlGpuInstanceGetInfo(self, instance: Any) -> Any:
        return SimpleNamespace(profileId=instance.profile)

    def nvmlDeviceGetName(self, handle: Any) -> str:
        return "NVIDIA A100-SXM4-80GB"

    def nvmlDeviceGetMemoryInfo(self, handle: Any) -> Any:
        return SimpleNamespace(total=80 << 30, free=79 << 30, used=1 << 30)

    def nvmlDeviceGetMigMode(self, handle: Any) -> list[int]:
        gpu = self._call(handle, "nvmlDeviceGetMigMode")
        if gpu.mig is None:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return list(gpu.mig)

    def nvmlDeviceGetGpuInstanceProfileInfo(self, handle: Any, profile: int) -> Any:
        gpu = self._call(handle, "nvmlDeviceGetGpuInstanceProfileInfo")
        if gpu.mig is None or profile not in gpu.profiles:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return gpu.profiles[profile]

    def nvmlDeviceGetGpuInstances(self, handle: Any, profile_id: int, refs: Any, count: Any) -> int:
        gpu = self._call(handle, "nvmlDeviceGetGpuInstances")
        if gpu.mig is None or gpu.mig[0] != pynvml.NVML_DEVICE_MIG_ENABLE:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)
        made = gpu.instances.get(profile_id, 0)
        if made > len(refs):
            raise pynvml.NVMLError(pynvml.NVML_ERROR_INSUFFICIENT_SIZE)
        count.contents.value = made
        return 0  # NVML_SUCCESS

    def nvmlEventSetCreate(self) -> int:
        if not self.inits:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_UNINITIALIZED)
        if not self.event_sets:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)
        self.set_creations += 1
        events = 1000 + self.set_creations
        self.sets[events], self.registered[events] = [], set()
        return events

    def nvmlDeviceRegisterEvents(self, handle: Any, types: int, events: int) -> None:
        index, gpu = self._gpu(handle)
        if not gpu.events:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)
        if events not in self.sets:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        assert types & _XID
        self.registered[events].add(index)

    def nvmlEventSetWait(self, events: int, timeout_ms: int) -> Any:
        assert timeout_ms == 0, "discovery must never wait for events"
        if events not in self.sets:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        if not self.sets[events]:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_TIMEOUT)
        gpu, xid = self.sets[events].pop(0)
        return SimpleNamespace(
            device=self.nvmlDeviceGetHandleByIndex(gpu),
            eventType=_XID,
            eventData=xid,
            gpuInstanceId=0,
            computeInstanceId=0,
        )

    def nvmlEventSetFree(self, events: int) -> None:
        self.sets.pop(events)
        self.registered.pop(events)


def _not_supported(name: str) -> Callable[..., Any]:
    def call(*_args: Any) -> Any:
        raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)

    call.__name__ = name
    return call


@pytest.fixture
def xids() -> Iterator[XidWatch]:
    """A watch of its own for each test, closed afterwards."""
    watch = XidWatch()
    yield watch
    watch.close()


def _scan(
    monkeypatch: pytest.MonkeyPatch, xids: XidWatch, *gpus: StandInGpu
) -> list[resources_pb2.Device]:
    nvml = StandInNvml(list(gpus))
    nvml.install(monkeypatch)
    scan = scan_nvidia_gpus(xids=xids)
    assert scan.problems == ()
    return list(scan.devices)


def test_stand_in_gpu_without_mig_or_events_is_as_before(
    monkeypatch: pytest.MonkeyPatch, xids: XidWatch
) -> None:
    """A GPU NVML says has no MIG and no events: healthy, no MIG attributes, no partitions."""
    (device,) = _scan(monkeypatch, xids, StandInGpu("GPU-a", events=False))
    assert device.id == "GPU-a"
    assert device.health == resources_pb2.DEVICE_HEALTH_HEALTHY, device.health_reason
    assert not device.partitions
    assert not {"mig_mode", "mig_mode_pending", "mig_gpu_instances", "last_xid"} & set(
        device.attributes
    )


def test_mig_mode_and_pending_change_are_attributes(
    monkeypatch: pytest.MonkeyPatch, xids: XidWatch
) -> None:
    """MIG off with a change to on waiting for a reset: both modes, and no partitions yet."""
    off, on = pynvml.NVML_DEVICE_MIG_DISABLE, pynvml.NVML_DEVICE_MIG_ENABLE
    pending, plain = _scan(
        monkeypatch,
        xids,
        StandInGpu("GPU-a", mig=(off, on), profiles=A100_PROFILES),
        StandInGpu("GPU-b", mig=(off, off), profiles=A100_PROFILES),
    )
    assert pending.attributes["mig_mode"] == "disabled"
    assert pending.attributes["mig_mode_pending"] == "enabled"
    assert plain.attributes["mig_mode"] == "disabled"
    assert "mig_mode_pending" not in plain.attributes
    assert not pending.partitions
    assert not plain.partitions


def test_mig_without_instances_offers_every_profile(
    monkeypatch: pytest.MonkeyPatch, xids: XidWatch
) -> None:
    """MIG on and no GPU instances yet: each profile with the instances the GPU holds of it."""
    on = pynvml.NVML_DEVICE_MIG_ENABLE
    (device,) = _scan(monkeypatch, xids, StandInGpu("GPU-a", mig=(on, on), profiles=A100_PROFILES))
    assert device.attributes["mig_mode"] == "enabled"
    assert device.attributes["mig_gpu_instances"] == "0"
    assert list(device.partitions) == [
        resources_pb2.PartitionProfile(profile="1g.10gb", total=7, free=7, memory_mib=9856),
        resources_pb2.PartitionProfile(profile="3g.40gb", total=2, free=2, memory_mib=40192),
        resources_pb2.PartitionProfile(profile="7g.80gb", total=1, free=1, memory_mib=80896),
    ]
    assert device.health == resources_pb2.DEVICE_HEALTH_HEALTHY


def test_existing_gpu_instances_are_the_slots(
    monkeypatch: pytest.MonkeyPatch, xids: XidWatch
) -> None:
    """A GPU already cut (three 1g.10gb and one 3g.40gb instances): those are its slots."""
    on = pynvml.NVML_DEVICE_MIG_ENABLE
    gpu = StandInGpu("GPU-a", mig=(on, on), profiles=A100_PROFILES, instances={100: 3, 102: 1})
    (device,) = _scan(monkeypatch, xids, gpu)
    assert device.attributes["mig_gpu_instances"] == "4"
    small = [f"MIG-GPU-a-100-{n}" for n in range(3)]
    assert list(device.partitions) == [
        resources_pb2.PartitionProfile(
            profile="1g.10gb", total=3, free=3, memory_mib=9856, instances=small
        ),
        resources_pb2.PartitionProfile(
            profile="3g.40gb", total=1, free=1, memory_mib=40192, instances=["MIG-GPU-a-102-0"]
        ),
    ]


def test_failing_mig_queries_degrade_the_gpu(
    monkeypatch: pytest.MonkeyPatch, xids: XidWatch
) -> None:
    """A MIG query failing for another reason than support degrades the GPU, naming it."""
    on = pynvml.NVML_DEVICE_MIG_ENABLE
    unknown = pynvml.NVML_ERROR_UNKNOWN
    mode, instances = _scan(
        monkeypatch,
        xids,
        StandInGpu("GPU-a", mig=(on, on), fail={"nvmlDeviceGetMigMode": unknown}),
        StandInGpu(
            "GPU-b",
            mig=(on, on),
            profiles=A100_PROFILES,
            fail={"nvmlDeviceGetGpuInstances": unknown},
        ),
    )
    assert mode.health == resources_pb2.DEVICE_HEALTH_DEGRADED
    assert "NVML query failed: MigMode: Unknown Error" in mode.health_reason
    assert not mode.partitions
    assert instances.health == resources_pb2.DEVICE_HEALTH_DEGRADED
    assert "NVML query failed: GpuInstances: Unknown Error" in instances.health_reason
    assert [p.total for p in instances.partitions] == [7, 2, 1]  # none found: the offer


def test_critical_xid_makes_the_gpu_unhealthy_until_restart(
    monkeypatch: pytest.MonkeyPatch, xids: XidWatch
) -> None:
    """Xids between discoveries: a critical one (79) makes its GPU unhealthy at the next scan
    and stays; another (13) is only recorded; Xids before the first scan are not seen."""
    nvml = StandInNvml([StandInGpu("GPU-a"), StandInGpu("GPU-b")])
    nvml.install(monkeypatch)
    nvml.xid(0, 79)  # nothing is registered yet: lost, as NVML loses it
    first = scan_nvidia_gpus(xids=xids).devices
    assert all(d.health == resources_pb2.DEVICE_HEALTH_HEALTHY for d in first)
    nvml.xid(1, 13)
    nvml.xid(0, 79)
    nvml.xid(0, 79)
    a, b = scan_nvidia_gpus(xids=xids).devices
    assert a.health == resources_pb2.DEVICE_HEALTH_UNHEALTHY
    assert a.health_reason == "Xid 79 (fallen off the bus): reset or service the GPU"
    assert "last_xid" not in a.attributes
    assert b.health == resources_pb2.DEVICE_HEALTH_HEALTHY
    assert b.attributes["last_xid"] == "13"
    a, b = scan_nvidia_gpus(xids=xids).devices  # no new events: the same
    assert a.health == resources_pb2.DEVICE_HEALTH_UNHEALTHY
    assert b.attributes["last_xid"] == "13"
    assert nvml.set_creations == 1
    assert nvml.inits == 1  # the watch's reference keeps the event set alive
    xids.close()
    assert nvml.inits == 0
    assert not nvml.sets


def test_gpus_without_event_sets_are_as_before(
    monkeypatch: pytest.MonkeyPatch, xids: XidWatch
) -> None:
    """A driver with no event sets: GPUs healthy, no NVML reference kept, not asked again."""
    nvml = StandInNvml([StandInGpu("GPU-a")], event_sets=False)
    nvml.install(monkeypatch)
    for _ in range(2):
        (device,) = scan_nvidia_gpus(xids=xids).devices
        assert device.health == resources_pb2.DEVICE_HEALTH_HEALTHY
        assert nvml.inits == 0
    calls: list[int] = []
    monkeypatch.setattr(pynvml, "nvmlEventSetCreate", lambda: calls.append(1))
    scan_nvidia_gpus(xids=xids)
    assert not calls
