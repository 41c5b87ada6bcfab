"""The resources a task holds while placed or running, as quotas count them."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from federation.api.v1 import jobs_pb2, queues_pb2
from federation.jobspec import domain_name
from federation.resources import CPU, KINDS, MEMORY

Demand = Mapping[str, float]


def demand(task: jobs_pb2.TaskSpec, models: Sequence[str] = ()) -> dict[str, float]:
    """What ``task`` holds with all its replicas: cores, memory, devices of its kind (a share
    counts as its fraction), and devices by model: ``models`` names the model of each device
    it was given (``TaskStatus.models``); without them, the one model it accepts, if only one."""
    replicas = task.replicas or 1
    res = task.resources
    out = {CPU: res.cpu * replicas, MEMORY: float(res.memory_mib * replicas)}
    acc = res.accelerator
    if (kind := kind_of(task)) is not None:
        devices = acc.count or acc.fraction or 1.0  # a partition: one slot of one device
        out[kind] = devices * replicas
        if models:
            each = 1.0 if acc.count else devices  # one entry per device given, or per share
            for model in models:
                out[f"{kind}/{model}"] = out.get(f"{kind}/{model}", 0.0) + each
        elif len(acc.models) == 1:
            out[f"{kind}/{acc.models[0]}"] = devices * replicas
    return out


def kind_of(task: jobs_pb2.TaskSpec) -> str | None:
    """The device kind ``task`` counts against ("gpu"), or None when it wants no device."""
    acc = task.resources.accelerator
    if acc.count or acc.fraction or acc.partition:
        return KINDS.get(acc.kind)
    return None


def at(holds: Demand, site: str, domain: str) -> dict[str, float]:
    """``holds`` counted also where they are held: at ``site`` and in ``domain`` (the keys
    that quotas scoped to a site or a domain count, see ``quota_key``)."""
    out = dict(holds)
    for resource, amount in holds.items():
        out[f"{resource}@site/{site}"] = amount
        if domain:
            out[f"{resource}@domain/{domain}"] = amount
    return out


def quota_key(quota: queues_pb2.Quota) -> str:
    """What ``quota`` counts: its resource, at its site or in its domain when it names one."""
    scope, name = _scope(quota)
    return f"{quota.resource}@{scope}/{name}" if scope else quota.resource


def quota_label(quota: queues_pb2.Quota) -> str:
    """``quota_key`` for people: "gpu", "gpu at site dc-1", "gpu in domain cloud"."""
    scope, name = _scope(quota)
    where = {"site": "at site", "domain": "in domain"}.get(scope)
    return f"{quota.resource} {where} {name}" if where else quota.resource


def _scope(quota: queues_pb2.Quota) -> tuple[str, str]:
    """("site", its name), ("domain", its name), or ("", "") for the whole federation."""
    if quota.site:
        return "site", quota.site
    if quota.domain:
        return "domain", domain_name(quota.domain)
    return "", ""
