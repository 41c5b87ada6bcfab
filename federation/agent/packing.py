"""Bin-packing of task replicas onto a site's nodes and devices, for the embedded core.

Pure functions over ``Node`` protos and a ``Usage`` tally; nothing here holds state or runs.
A replica asks for whole devices (``count``), a share of one shareable device (``fraction``) or
one slot of a partition profile (``partition``); ``federation.agent.usage`` says how these
modes exclude each other. Devices match as the coordinator's CapacityFit matches them: kind,
vendor, models, memory and the CEL selector, which sees the attributes the coordinator builds
(``federation.placement.snapshot.device_attributes``), evaluated once per distinct device.
"""

from __future__ import annotations

import functools
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import Any, NamedTuple

from federation.agent.discovery import device_kind_name
from federation.agent.usage import Slot, Usage, shares_fit
from federation.api.v1 import jobs_pb2, resources_pb2
from federation.placement.devices import device_attributes, device_speeds
from federation.programs import missing

__all__ = [
    "Placed",
    "Slot",
    "Usage",
    "describe_request",
    "fragmentation",
    "place",
    "place_as_estimated",
    "request_problem",
    "task_speed",
]

_EPS = 1e-9
_USABLE_HEALTH = frozenset(
    {resources_pb2.DEVICE_HEALTH_HEALTHY, resources_pb2.DEVICE_HEALTH_UNSPECIFIED}
)

GANG_MIX: tuple[tuple[int, int], ...] = ((2, 12), (4, 10), (8, 8))
"""The representative workload that packing keeps room for: gangs of 2, 4 and 8 devices on one
node, weighted by how often each comes (per cent of jobs, Microsoft Philly's mix; single
devices, the other 70 %, fit any free device and so never find a node fragmented)."""

# See ``_fit``: how tight the chosen device is, the fragmentation the choice adds, how scarce
# the model it takes, then the devices, cpu and memory left over and the node name.
_Rank = tuple[tuple[bool, float], int, int, int, float, int, str]
# Devices missing, cpu and memory missing, then the node name: the node that comes closest.
_Shortfall = tuple[int, float, int, str]


class _Fit(NamedTuple):
    """A replica fits on a node: the lowest rank is the best fit."""

    rank: _Rank
    slot: Slot


class _Miss(NamedTuple):
    """A replica does not fit on a node: the lowest shortfall is the node that comes closest."""

    shortfall: _Shortfall
    why: str


@dataclass(frozen=True, slots=True)
class _Pick:
    """The devices one replica would get on a node, or what the node lacks."""

    positions: tuple[int, ...] = ()
    tightness: tuple[bool, float] = (False, 0.0)
    """Lower is a tighter fit: (device not yet used in this mode, share the device keeps)."""
    plenty: int = 0
    """Free devices at the site of the scarcest model this pick may take (see ``_fit``)."""
    missing: int = 0
    """Devices short of the request; 0 when it fits."""
    have: str = ""
    """What the node has, for the decline reason."""


def _usable(device: resources_pb2.Device) -> bool:
    return device.health in _USABLE_HEALTH


Speed = Callable[[resources_pb2.Device], float]
"""A device's speed for the task's workload class (``federation.placement.estimates``)."""


def task_speed(spec: jobs_pb2.TaskSpec) -> Speed:
    """How fast each device runs ``spec``, as the coordinator's estimates read speeds."""
    speeds = device_speeds(spec.workload_class or "training", spec.speed.items())
    return lambda device: speeds(device.model, device.tflops_fp16)


class _Matcher:
    """Which usable devices a request accepts; the selector runs once per distinct device.
    With ``min_speed``, only devices at least that fast (by ``speed``)."""

    def __init__(
        self, acc: jobs_pb2.AcceleratorRequest, speed: Speed | None = None, min_speed: float = 0.0
    ) -> None:
        self._acc = acc
        if acc.selector:
            selectors().compile_selector(acc.selector)
        self._speed = speed
        self._min_speed = min_speed * (1 - _EPS)  # the estimate's float, read back

    def __call__(self, device: resources_pb2.Device) -> bool:
        acc = self._acc
        if not (
            _usable(device)
            and acc.kind in (resources_pb2.DEVICE_KIND_UNSPECIFIED, device.kind)
            and (not acc.vendor or acc.vendor.lower() == device.vendor.lower())
            and (not acc.models or device.model in acc.models)
            and device.memory_total_mib >= acc.min_memory_mib
            and (self._speed is None or self._speed(device) >= self._min_speed)
        ):
            return False
        if not acc.selector:
            return True
        return bool(selectors().selector_matches(acc.selector, [device_attributes(device)])[0])


def selectors() -> ModuleType:
    """CEL selectors, loaded when a task first has one: an agent whose tasks name none does
    not load CEL, numpy or the placement framework."""
    from federation.placement import selectors as loaded

    return loaded


@functools.cache
def selectors_installed() -> bool:
    """Whether this host can evaluate selectors: an agent-only install has neither CEL nor
    numpy (the ``cel`` extra brings both)."""
    return not missing(("cel", "numpy"))


def fragmentation(free: int) -> int:
    """How badly a node with ``free`` whole devices free serves ``GANG_MIX``: per gang size, the
    free devices no gang of that size can use (``free % size``), weighted by how often such
    gangs come. Fragmentation gradient descent's measure (Weng et al., ATC '23) for whole
    devices; the simulator computes the same over arrays."""
    return sum(weight * (free % size) for size, weight in GANG_MIX)


def describe_request(acc: jobs_pb2.AcceleratorRequest) -> str:
    """E.g. ``"4 NPU (huawei)"``, ``"0.5 of a shareable GPU"`` or ``"a GPU partition 1g.10gb"``."""
    kind = device_kind_name(acc.kind) if acc.kind else "device"
    qualifiers = [acc.vendor] if acc.vendor else []
    if acc.models:
        qualifiers.append("model " + " or ".join(acc.models))
    if acc.min_memory_mib:
        qualifiers.append(f">= {acc.min_memory_mib} MiB")
    if acc.selector:
        qualifiers.append(f"matching {acc.selector!r}")
    if acc.same_interconnect and acc.count > 1:
        qualifiers.append("in one interconnect group")
    if acc.fraction:
        head = f"{acc.fraction:g} of a shareable {kind}"
        if acc.memory_mib:
            head += f" and {acc.memory_mib} MiB of its memory"
    elif acc.partition:
        head = f"a {kind} partition {acc.partition}"
    else:
        head = f"{acc.count} {kind}"
    return head + (f" ({', '.join(qualifiers)})" if qualifiers else "")


def request_problem(acc: jobs_pb2.AcceleratorRequest) -> str:
    """Why an accelerator request can never be placed (the coordinator checks this too), or ""."""
    if sum(bool(x) for x in (acc.count, acc.fraction, acc.partition)) > 1:
        return "asks for more than one of count, fraction and partition"
    if acc.fraction and not 0 < acc.fraction <= 1:
        return f"invalid fraction {acc.fraction:g}: must be in (0, 1]"
    if acc.memory_mib and not acc.fraction:
        return "asks for share memory without a fraction"
    if acc.selector:
        if not selectors_installed():
            return (
                "this site's agent cannot evaluate device selectors: CEL is not installed "
                "here (install fedplane[cel] on it)"
            )
        cel = selectors()
        try:
            cel.compile_selector(acc.selector)
        except cel.SelectorError as err:
            return f"invalid selector: {err}"
    return ""


@dataclass(frozen=True, slots=True)
class Placed:
    """Where a task's replicas go, and how long it runs there."""

    slots: tuple[Slot, ...]
    run_s: float
    """The task's estimated duration on the slowest device it got (a gang runs at the pace
    of its slowest replica); 0 when it got no devices or has no estimated duration."""
    device_model: str = ""
    """The model of that slowest device; "" when it got none."""


def place_as_estimated(
    nodes: Iterable[resources_pb2.Node],
    spec: jobs_pb2.TaskSpec,
    usage: Usage,
    speed: float,
    levels: Sequence[str] = (),
) -> Placed | str:
    """Places a task on devices at least ``speed`` fast, the speed the coordinator's estimate
    assumed, where it fits so; else on any matching devices, with the longer run time that
    gives (the coordinator compares it with other sites' answers). ``speed`` 0: no promise.
    ``levels``: the site's topology levels (``place``).
    """
    nodes = list(nodes)
    fast = task_speed(spec)
    placed = (
        place(nodes, spec, usage, speed=fast, min_speed=speed, levels=levels) if speed > 0 else ""
    )
    if isinstance(placed, str):
        placed = place(nodes, spec, usage, levels=levels)
    if isinstance(placed, str):
        return placed
    by_name = {node.name: node for node in nodes}
    got = [by_name[slot.node].devices[pos] for slot in placed for pos in slot.device_positions]
    if not got:
        return Placed(placed, 0.0)
    slowest = min(got, key=fast)
    speed, duration = fast(slowest), spec.estimated_duration_s
    run_s = duration / speed if speed > 0 and duration > 0 else 0.0
    return Placed(placed, run_s, slowest.model)


def place(
    nodes: Iterable[resources_pb2.Node],
    spec: jobs_pb2.TaskSpec,
    usage: Usage,
    *,
    speed: Speed | None = None,
    min_speed: float = 0.0,
    levels: Sequence[str] = (),
) -> tuple[Slot, ...] | str:
    """Places every replica of a gang at once, or says why it does not fit.

    Each replica goes to the schedulable node where it fits best by ``_fit``'s rank: on partly
    used devices first, then where it fragments the site least (so a small task fills a partly
    used node rather than break up an idle one a gang could take), then on the most plentiful
    model (the scarce one is kept for tasks that need it), then best fit.

    Args:
        nodes: The site's nodes.
        spec: The task; ``replicas`` 0 means 1.
        usage: Capacity already held; not modified.
        speed: How fast each device runs the task, for ``min_speed``.
        min_speed: Only devices at least this fast.
        levels: The site's topology levels, widest first (node labels: ``block``, ``rack``):
            among nodes that rank alike on themselves, a replica goes to the one in the
            value of each level with the fewest free whole devices (the fullest block, then
            rack), so whole values stay free for tasks that require one.

    With ``spec.topology``, the replicas go to the nodes of one value of the required level
    (``_at_one``), and where they fit so to one value of the preferred level.

    Returns:
        One slot per replica, or the reason the gang was declined.
    """
    if problem := request_problem(spec.resources.accelerator):
        return problem
    schedulable = [node for node in nodes if node.schedulable]
    if not schedulable:
        return "no schedulable nodes"
    matches = _Matcher(spec.resources.accelerator, speed, min_speed)
    required, preferred = spec.topology.required, spec.topology.preferred
    if required:
        return _at_one(required, preferred, schedulable, spec, usage, matches, levels)
    if preferred:
        found = _at_one(preferred, "", schedulable, spec, usage, matches, levels)
        if not isinstance(found, str):
            return found
    return _among(schedulable, spec, usage, matches, levels)


def _at_one(
    level: str,
    preferred: str,
    nodes: list[resources_pb2.Node],
    spec: jobs_pb2.TaskSpec,
    usage: Usage,
    matches: _Matcher,
    levels: Sequence[str],
) -> tuple[Slot, ...] | str:
    """Every replica on the nodes of one value of the node label ``level`` (one rack, say),
    and within it at one value of ``preferred`` where one has room. Of the values that fit,
    one where the preferred level is met first, then the one with the fewest free devices
    left, then the fewest free CPUs: the fullest rack takes the gang, so an empty one stays
    whole for a larger gang."""
    groups: dict[str, list[resources_pb2.Node]] = {}
    for node in nodes:
        if value := node.labels.get(level):
            groups.setdefault(value, []).append(node)
    if not groups:
        return f"no node has a {level} (node label {level!r})"
    fits: list[tuple[tuple[bool, int, float, str], tuple[Slot, ...]]] = []
    example = ""
    for value, members in sorted(groups.items()):
        found: tuple[Slot, ...] | str = ""
        if preferred:
            found = _at_one(preferred, "", members, spec, usage, matches, levels)
        missed_preferred = isinstance(found, str)
        if isinstance(found, str):
            found = _among(members, spec, usage, matches, levels)
        if isinstance(found, str):
            example = example or f"{level} {value}: {found}"
            continue
        fits.append(((missed_preferred, *_left_after(members, usage, found), value), found))
    if not fits:
        return f"no {level} has room for all {spec.replicas or 1} replicas ({example})"
    return min(fits, key=lambda fit: fit[0])[1]


def _by_level(fit: _Fit, fullness: list[dict[str, int]]) -> tuple[Any, ...]:
    """``fit``'s rank with, after tightness and fragmentation, the free devices of its node's
    value of each level: the fullest block, then rack, first."""
    free = [per_node[fit.slot.node] for per_node in fullness]
    return (*fit.rank[:2], free, *fit.rank[2:])


def _free_per_level(
    nodes: list[resources_pb2.Node], usage: Usage, levels: Sequence[str]
) -> list[dict[str, int]]:
    """Per level, for each node: the free whole devices of the nodes in its value of the level
    (a node without the label is alone in its value)."""
    free = {
        node.name: sum(
            1
            for pos, device in enumerate(node.devices)
            if _usable(device) and usage.is_whole_free((node.name, pos))
        )
        for node in nodes
    }
    out = []
    for level in levels:
        value_of = {n.name: n.labels.get(level) or f"node:{n.name}" for n in nodes}
        per_value: Counter[str] = Counter()
        for name, value in value_of.items():
            per_value[value] += free[name]
        out.append({name: per_value[value] for name, value in value_of.items()})
    return out


def _left_after(
    nodes: list[resources_pb2.Node], usage: Usage, slots: tuple[Slot, ...]
) -> tuple[int, float]:
    """Free whole devices and free CPUs ``nodes`` would keep after ``slots``."""
    devices = sum(
        1
        for node in nodes
        for pos, device in enumerate(node.devices)
        if _usable(device) and usage.is_whole_free((node.name, pos))
    )
    devices -= sum(len(slot.device_positions) for slot in slots)
    cpus = sum(node.cpu_cores - usage.cpu[node.name] for node in nodes)
    return devices, cpus - sum(slot.cpu for slot in slots)


def _among(
    schedulable: list[resources_pb2.Node],
    spec: jobs_pb2.TaskSpec,
    usage: Usage,
    matches: _Matcher,
    levels: Sequence[str] = (),
) -> tuple[Slot, ...] | str:
    """Every replica on ``schedulable``, each where it fits best by ``_fit``'s rank (with
    ``levels``, the fullest value of each level first among nodes that rank alike on
    tightness and fragmentation)."""
    replicas = spec.replicas or 1
    tentative = usage.copy()
    slots: list[Slot] = []
    for placed in range(replicas):
        plenty = _plenty(schedulable, tentative)
        outcomes = [_fit(node, spec.resources, tentative, matches, plenty) for node in schedulable]
        fits = [outcome for outcome in outcomes if isinstance(outcome, _Fit)]
        if not fits:
            reason = min(outcome for outcome in outcomes if isinstance(outcome, _Miss)).why
            return f"only {placed} of {replicas} replicas fit; {reason}" if placed else reason
        if levels:
            fullness = _free_per_level(schedulable, tentative, levels)
            slot = min(fits, key=lambda fit: _by_level(fit, fullness)).slot
        else:
            slot = min(fits, key=lambda fit: fit.rank).slot
        tentative.add(slot)
        slots.append(slot)
    return tuple(slots)


def _plenty(nodes: Iterable[resources_pb2.Node], usage: Usage) -> Counter[str]:
    """Whole devices free per model on ``nodes``: how plentiful each model is at the site."""
    return Counter(
        device.model
        for node in nodes
        for pos, device in enumerate(node.devices)
        if _usable(device) and usage.is_whole_free((node.name, pos))
    )


def _fit(
    node: resources_pb2.Node,
    res: jobs_pb2.ResourceRequest,
    usage: Usage,
    matches: _Matcher,
    plenty: Counter[str],
) -> _Fit | _Miss:
    """Places one replica on ``node`` and ranks the choice, or says what the node lacks.

    The rank, lowest first, weighs what the replica runs on against what it leaves behind.
    Every device ``matches`` accepts already keeps the offer's promise (``place_as_estimated``),
    so among them:

    1. tightness: a share or partition slot on a device already cut up before a fresh device;
    2. fragmentation added: ``fragmentation`` of the node's free whole devices after the pick
       minus before, so a 1-device task takes one of the 3 free on a partly used node
       (fragmentation falls) rather than one of an idle 8-device node that an 8-device gang
       could have had (it rises most);
    3. scarcity: the fewer devices of the scarcest matching model free at the site, the later
       the node, so a task that several models serve leaves the scarce (often fast) cards to
       the tasks that need them;
    4. best fit: whole devices, cpu and memory left over (fewest free devices first keeps
       CPU-only work off accelerator nodes), then the node name.
    """
    acc = res.accelerator
    whole_free = [
        pos
        for pos, device in enumerate(node.devices)
        if _usable(device) and usage.is_whole_free((node.name, pos))
    ]
    if acc.fraction:
        pick = _pick_share(node, acc, usage, matches, plenty)
    elif acc.partition:
        pick = _pick_partition(node, acc.partition, usage, matches, plenty)
    elif acc.count:
        matching = [p for p in whole_free if matches(node.devices[p])]
        pick = _pick_whole(node, acc, usage, matching, plenty)
    else:
        pick = _Pick()  # no accelerator asked for
    cpu_free = node.cpu_cores - usage.cpu[node.name]
    memory_free_mib = node.memory_mib - usage.memory_mib[node.name]
    shortfall: _Shortfall = (
        pick.missing,
        res.cpu - cpu_free if res.cpu > cpu_free + _EPS else 0.0,
        max(0, res.memory_mib - memory_free_mib),
        node.name,
    )
    best = f"best node {node.name} has"
    if shortfall[0]:
        return _Miss(shortfall, f"needs {describe_request(acc)} per replica; {best} {pick.have}")
    if shortfall[1]:
        return _Miss(shortfall, f"needs {res.cpu:g} CPU per replica; {best} {cpu_free:g} free")
    if shortfall[2]:
        why = f"needs {res.memory_mib} MiB memory per replica; {best} {memory_free_mib} MiB free"
        return _Miss(shortfall, why)
    taken = sum(usage.is_whole_free((node.name, pos)) for pos in pick.positions)
    rank: _Rank = (
        pick.tightness,
        fragmentation(len(whole_free) - taken) - fragmentation(len(whole_free)),
        -pick.plenty,
        len(whole_free) - acc.count,
        cpu_free - res.cpu,
        memory_free_mib - res.memory_mib,
        node.name,
    )
    instance = ""
    if acc.partition and pick.positions:
        pos = pick.positions[0]
        profile = next(
            (p for p in node.devices[pos].partitions if p.profile == acc.partition), None
        )
        if profile is not None:
            instance = usage.free_instance((node.name, pos), profile)
    slot = Slot(
        node.name,
        res.cpu,
        res.memory_mib,
        pick.positions,
        fraction=acc.fraction,
        device_memory_mib=acc.memory_mib if acc.fraction else 0,
        partition=acc.partition,
        instance=instance,
    )
    return _Fit(rank, slot)


def _group(node: resources_pb2.Node, pos: int) -> str:
    """A device's interconnect group; a device with none is a group of its own."""
    return node.devices[pos].interconnect_group or f"#{pos}"


def _pick_whole(
    node: resources_pb2.Node,
    acc: jobs_pb2.AcceleratorRequest,
    usage: Usage,
    matching: list[int],
    plenty: Counter[str],
) -> _Pick:
    """``acc.count`` free matching devices, all in one interconnect group when asked; the
    node's ``plenty`` is that of the scarcest model among them."""
    if acc.same_interconnect and acc.count > 1:
        per_group = Counter(_group(node, pos) for pos in matching)
        most = max(per_group.values(), default=0)
        if most < acc.count:
            return _Pick(missing=acc.count - most, have=f"at most {most} free in one group")
        matching = [pos for pos in matching if per_group[_group(node, pos)] >= acc.count]
    if len(matching) < acc.count:
        return _Pick(missing=acc.count - len(matching), have=f"{len(matching)} free")
    scarcest = min(plenty[node.devices[pos].model] for pos in matching)
    return _Pick(_choose_devices(node, matching, acc.count, usage, plenty), plenty=scarcest)


def _pick_share(
    node: resources_pb2.Node,
    acc: jobs_pb2.AcceleratorRequest,
    usage: Usage,
    matches: _Matcher,
    plenty: Counter[str],
) -> _Pick:
    """The shareable matching device with the least free share that still holds the share's
    fraction and its memory, then of the most plentiful model."""
    fraction = acc.fraction
    shared = [
        (usage.free_fraction((node.name, pos)), -plenty[device.model], device.index, pos)
        for pos, device in enumerate(node.devices)
        if device.shareable and matches(device)
    ]

    def memory_left(pos: int) -> int:
        return node.devices[pos].memory_total_mib - usage.device_memory[(node.name, pos)]

    fitting = [
        entry
        for entry in shared
        if shares_fit(entry[0], fraction) >= 1 and memory_left(entry[3]) >= acc.memory_mib
    ]
    if not fitting:
        if not shared:
            return _Pick(missing=1, have="no matching shareable device")
        most = max(entry[0] for entry in shared)
        if acc.memory_mib and any(shares_fit(entry[0], fraction) for entry in shared):
            memory = max(memory_left(entry[3]) for entry in shared)
            return _Pick(missing=1, have=f"at most {memory} MiB free on one shareable device")
        return _Pick(missing=1, have=f"at most {most:.4g} free on one shareable device")
    free, scarcity, _, pos = min(fitting)
    return _Pick((pos,), tightness=(False, free - fraction), plenty=-scarcity)


def _pick_partition(
    node: resources_pb2.Node, profile: str, usage: Usage, matches: _Matcher, plenty: Counter[str]
) -> _Pick:
    """A free slot of ``profile`` on a matching device, one already partitioned first, then of
    the most plentiful model."""
    offered: list[tuple[tuple[bool, float], int, int, int, int]] = []
    for pos, device in enumerate(node.devices):
        total = next((p.total for p in device.partitions if p.profile == profile), 0)
        if not total or not matches(device):
            continue
        ref = (node.name, pos)
        free = usage.partitions_free(ref, device.partitions)[profile]
        in_use = usage.slots_taken(ref) > 0
        scarcity = -plenty[device.model]
        offered.append(((not in_use, (free - 1) / total), scarcity, device.index, pos, free))
    fitting = [entry for entry in offered if entry[4] >= 1]
    if not fitting:
        if not offered:
            return _Pick(missing=1, have="no matching device with that profile")
        return _Pick(missing=1, have="0 free")
    tightness, scarcity, _, pos, _ = min(fitting)
    return _Pick((pos,), tightness=tightness, plenty=-scarcity)


def _choose_devices(
    node: resources_pb2.Node,
    candidates: list[int],
    count: int,
    usage: Usage,
    plenty: Counter[str],
) -> tuple[int, ...]:
    """Picks ``count`` devices among ``candidates``.

    A whole interconnect group that can hold them all comes first (one NVLink/HCCS domain per
    replica); then groups that already have allocations, the fullest first; then the model
    with the most devices free at the site; then lowest index.
    """
    if not count:
        return ()
    group = {pos: node.devices[pos].interconnect_group for pos in candidates}
    free_in_group = Counter(group.values())
    in_use = {
        node.devices[pos].interconnect_group for name, pos in usage.devices if name == node.name
    }
    in_use.discard("")

    def preference(pos: int) -> tuple[bool, bool, int, str, int, int]:
        g = group[pos]
        fits_whole = bool(g) and free_in_group[g] >= count
        return (
            not fits_whole,
            g not in in_use,
            free_in_group[g] if fits_whole else 0,
            g,
            -plenty[node.devices[pos].model],
            node.devices[pos].index,
        )

    return tuple(sorted(sorted(candidates, key=preference)[:count]))
