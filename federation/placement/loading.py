"""Placement plugins from outside the project, and how they are kept from harming a cycle.

A profile names a plugin by its built-in name, by the name it is published under in the
entry-point group ``fedplane.placement.filters`` or ``fedplane.placement.scorers``, or as
``module:Class``. One from outside is checked when the coordinator starts: it must load,
construct without arguments, have a name and the method of its kind, and answer a sample
federation within the framework's contract (``trial``). While the coordinator runs it is
``Contained``: a plugin that raises, breaks the contract or runs past its time budget is
disabled (it then passes every site, or scores every site alike) and the cycle goes on.
"""

from __future__ import annotations

import importlib
import time
from collections.abc import Callable, Mapping
from importlib.metadata import entry_points
from typing import Any

import numpy as np
import numpy.typing as npt
import structlog

from federation.api.v1 import jobs_pb2, resources_pb2
from federation.placement.framework import FilterPlugin, PluginContractError, ScorePlugin, Verdict
from federation.placement.request import Request
from federation.placement.snapshot import SiteInput, Snapshot, build_snapshot

log = structlog.get_logger()

FILTER_GROUP = "fedplane.placement.filters"
SCORER_GROUP = "fedplane.placement.scorers"
BUDGET_S = 0.1
"""How long one call of a plugin from outside may take before it is disabled."""

Disabled = Callable[[str, str], None]
"""Told (plugin name, why) when a plugin from outside is disabled."""


class UnknownPluginError(ValueError):
    """A profile names a plugin that cannot be found, loaded or trusted."""


def find(name: str, builtin: Mapping[str, type[Any]], group: str, kind: str) -> type[Any] | None:
    """The class ``name`` stands for; None for a built-in one (it is in ``builtin``)."""
    if name in builtin:
        return None
    if ":" in name:
        module_name, _, attribute = name.partition(":")
        try:
            found: Any = getattr(importlib.import_module(module_name), attribute)
        except Exception as err:  # a third party's import may raise anything
            raise UnknownPluginError(
                f"{kind} plugin {name!r} cannot be loaded: {type(err).__name__}: {err}"
            ) from None
        return _plugin_class(name, found, kind)
    published = entry_points(group=group, name=name)
    if not published:
        raise UnknownPluginError(
            f"unknown {kind} plugin {name!r}; built in: {sorted(builtin)}; none is published "
            f"under that name in the entry-point group {group}, and module:Class names one "
            "by its import path"
        )
    try:
        loaded = next(iter(published)).load()
    except Exception as err:
        raise UnknownPluginError(
            f"{kind} plugin {name!r} ({group}) cannot be loaded: {type(err).__name__}: {err}"
        ) from None
    return _plugin_class(name, loaded, kind)


def _plugin_class(name: str, found: object, kind: str) -> type[Any]:
    method = "filter" if kind == "filter" else "score"
    if not isinstance(found, type):
        raise UnknownPluginError(f"{kind} plugin {name!r} is not a class")
    if not callable(getattr(found, method, None)):
        raise UnknownPluginError(f"{kind} plugin {name!r} has no {method}() method")
    return found


def construct(name: str, cls: type[Any], kind: str) -> Any:
    """An instance of a plugin from outside, tried on the sample federation."""
    try:
        plugin = cls()
    except Exception as err:
        raise UnknownPluginError(
            f"{kind} plugin {name!r} cannot be made without arguments: {type(err).__name__}: {err}"
        ) from None
    label = getattr(plugin, "name", None)
    if not isinstance(label, str) or not label:
        raise UnknownPluginError(f"{kind} plugin {name!r} has no name (a class attribute str)")
    try:
        trial(plugin, kind)
    except Exception as err:
        raise UnknownPluginError(
            f"{kind} plugin {name!r} failed on a sample federation: {type(err).__name__}: {err}"
        ) from None
    return plugin


def trial(plugin: Any, kind: str) -> None:
    """Run ``plugin`` once on a small sample federation and check its answer's contract."""
    snap, request = _sample()
    if kind == "filter":
        _checked_verdict(plugin.name, plugin.filter(request, snap), snap)
    else:
        feasible = np.arange(snap.n_sites, dtype=np.int64)
        _checked_scores(plugin.name, plugin.score(request, snap, feasible), feasible)


def _checked_verdict(name: str, verdict: object, snap: Snapshot) -> Verdict:
    if not isinstance(verdict, Verdict):
        raise PluginContractError(name, f"filter returned {type(verdict).__name__}, not a Verdict")
    mask = verdict.mask
    if not isinstance(mask, np.ndarray) or mask.shape != (snap.n_sites,) or mask.dtype != bool:
        raise PluginContractError(name, "filter mask has the wrong shape or dtype")
    return verdict


def _checked_scores(
    name: str, scores: object, feasible: npt.NDArray[np.int64]
) -> npt.NDArray[np.float64]:
    if not isinstance(scores, np.ndarray) or scores.shape != feasible.shape:
        raise PluginContractError(name, "scores have the wrong shape")
    checked = scores.astype(np.float64, copy=False)
    if not np.all(np.isfinite(checked) & (checked >= 0) & (checked <= 100)):
        raise PluginContractError(name, "score outside [0, 100]")
    return checked


def _sample() -> tuple[Snapshot, Request]:
    """Two sites, one with a GPU node, and a one-GPU task."""
    gpu = resources_pb2.Device(
        id="g0",
        kind=resources_pb2.DEVICE_KIND_GPU,
        vendor="nvidia",
        model="H100",
        memory_total_mib=81920,
        health=resources_pb2.DEVICE_HEALTH_HEALTHY,
    )
    views = [
        resources_pb2.SiteView(
            site="sample-a",
            domain=resources_pb2.DOMAIN_DATACENTER,
            region="sample",
            nodes=[resources_pb2.Node(name="n0", cpu_cores=8, cpu_free=8, schedulable=True)],
        ),
        resources_pb2.SiteView(
            site="sample-b",
            domain=resources_pb2.DOMAIN_CLOUD,
            region="sample",
            nodes=[
                resources_pb2.Node(
                    name="n0", cpu_cores=8, cpu_free=8, schedulable=True, devices=[gpu]
                )
            ],
        ),
    ]
    snap = build_snapshot([SiteInput(view=v, is_connected=True, is_cordoned=False) for v in views])
    task = jobs_pb2.TaskSpec(
        name="sample",
        command=["true"],
        resources=jobs_pb2.ResourceRequest(
            cpu=1,
            accelerator=jobs_pb2.AcceleratorRequest(kind=resources_pb2.DEVICE_KIND_GPU, count=1),
        ),
    )
    job = jobs_pb2.JobSpec(name="sample", tasks=[task])
    return snap, Request.from_spec(job, task)


class Contained:
    """A plugin from outside, disabled for good the first time it raises, breaks the
    framework's contract or takes longer than ``budget_s``."""

    def __init__(self, plugin: Any, budget_s: float, on_disabled: Disabled | None) -> None:
        self.plugin = plugin
        self.name: str = plugin.name
        self.budget_s = budget_s
        self.disabled = ""
        """Why it was disabled; empty while it runs."""
        self._on_disabled = on_disabled

    def _disable(self, why: str) -> None:
        self.disabled = why
        log.warning("placement_plugin_disabled", plugin=self.name, reason=why)
        if self._on_disabled is not None:
            self._on_disabled(self.name, why)

    def _run(self, call: Callable[[], Any], check: Callable[[Any], Any]) -> Any:
        """``check(call())``, or None when the plugin failed (it is disabled then)."""
        started = time.perf_counter()
        try:
            answer = check(call())
        except Exception as err:
            self._disable(f"{type(err).__name__}: {err}")
            return None
        took = time.perf_counter() - started
        if took > self.budget_s:
            # Its answer is used this once: it was in the contract, only late.
            self._disable(f"took {took * 1000:.0f} ms, over its {self.budget_s * 1000:.0f} ms")
        return answer


class ContainedFilter(Contained):
    """A filter from outside; disabled, it passes every site."""

    def filter(self, req: Request, snap: Snapshot) -> Verdict:
        if not self.disabled:
            verdict = self._run(
                lambda: self.plugin.filter(req, snap),
                lambda v: _checked_verdict(self.name, v, snap),
            )
            if verdict is not None:
                return verdict  # type: ignore[no-any-return]
        return Verdict(mask=np.ones(snap.n_sites, dtype=bool))


class ContainedScorer(Contained):
    """A scorer from outside; disabled, it scores every site alike (0), which ranks none."""

    def score(
        self, req: Request, snap: Snapshot, feasible: npt.NDArray[np.int64]
    ) -> npt.NDArray[np.float64]:
        if not self.disabled:
            scores = self._run(
                lambda: self.plugin.score(req, snap, feasible),
                lambda s: _checked_scores(self.name, s, feasible),
            )
            if scores is not None:
                return scores  # type: ignore[no-any-return]
        return np.zeros(len(feasible), dtype=np.float64)


def contained_filter(plugin: Any, budget_s: float, on_disabled: Disabled | None) -> FilterPlugin:
    out: FilterPlugin = ContainedFilter(plugin, budget_s, on_disabled)
    return out


def contained_scorer(plugin: Any, budget_s: float, on_disabled: Disabled | None) -> ScorePlugin:
    out: ScorePlugin = ContainedScorer(plugin, budget_s, on_disabled)
    return out
