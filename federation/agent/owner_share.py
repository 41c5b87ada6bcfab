"""Room a site keeps for its owner's tenants (``[owner_share]`` of the agent's config): other
tenants' tasks may together hold only what is left of each resource it names. The site checks
every offer against it (``federation.resources.owner_share_refusal``) and publishes it in its
view, so that the coordinator offers other tenants only what is left."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from federation.agent.usage import Slot
from federation.api.v1 import resources_pb2
from federation.config import ConfigError, at_least
from federation.resources import CPU, KINDS, MEMORY, add, resource_problem


@dataclass(frozen=True, slots=True)
class OwnerShareSettings:
    """The ``[owner_share]`` table of an agent config."""

    tenants: list[str] = field(default_factory=list)
    """The site owner's tenants: the room is kept for them."""
    keep: dict[str, float] = field(default_factory=dict, metadata=at_least(0))
    """Resource ("cpu", "memory_mib", "gpu", "gpu/A100-80GB") → amount kept for them."""


def check_owner_share(settings: OwnerShareSettings, *, source: str) -> None:
    """Refuse resources no one counts, and room kept for no one (the rest ``build`` checks)."""
    for resource in settings.keep:
        if problem := resource_problem(resource):
            raise ConfigError(f"{source}: owner_share.keep.{resource}: {problem}")
    if settings.keep and not settings.tenants:
        raise ConfigError(
            f"{source}: owner_share.tenants is empty: name the tenants the room is kept for"
        )


def owner_share(settings: OwnerShareSettings) -> resources_pb2.OwnerShare:
    return resources_pb2.OwnerShare(tenants=settings.tenants, keep=settings.keep)


def held(slots: Iterable[Slot], nodes: Mapping[str, resources_pb2.Node]) -> dict[str, float]:
    """What ``slots`` hold, by resource as owner shares (and quotas) count it: a share of a
    device counts as its fraction."""
    out: dict[str, float] = {}
    for slot in slots:
        add(out, [(CPU, slot.cpu), (MEMORY, slot.memory_mib)])
        node = nodes.get(slot.node)
        devices = [node.devices[p] for p in slot.device_positions] if node is not None else []
        for device in devices:
            if (kind := KINDS.get(device.kind)) is not None:
                amount = slot.fraction or 1.0
                add(out, [(kind, amount), (f"{kind}/{device.model}", amount)])
    return out
