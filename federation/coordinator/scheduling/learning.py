"""Speeds learned from finished tasks: how fast each device model really runs each workload.

The speed table (``federation/placement/data/speed.yaml``) is where estimates start. Every task
that succeeds on devices says how fast its device model ran its workload class: its estimated
duration (seconds on the reference device) over the seconds it ran. An exponentially weighted
mean of the logarithm of that speed, per (workload class, model), replaces the table's entry
once a few tasks agree, and its spread is the expected error estimates carry. A task's own
``speed`` overrides still win.

The same mean is kept per (site, workload class, model) for tasks that name their site: a
site's hardware or software can be slower than its model's typical speed. Its ratio to the
model's mean is the site's correction factor (``site_factor``); ``overrides(..., site=...)``
gives the speeds to estimate with at that site.

The learned state lives in the leader's memory and in the store under ``/learning/``
(``LearningSaver`` writes what changed every ``SAVE_INTERVAL_S`` or after
``SAVE_AFTER_UPDATES`` tasks, never once per task), and ``load`` reads it back when a term
starts: learned speeds survive a restart and a change of leader, less the tasks of the last
unsaved interval.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import time
from collections.abc import Mapping
from dataclasses import dataclass
from urllib.parse import quote, unquote

import structlog

from federation.metrics import RUN_TIME_RATIO
from federation.store import Put, Store

log = structlog.get_logger()

WEIGHT = 0.2
"""Weight of the newest task in the running mean: about the last ten tasks count."""
MIN_TASKS = 3
"""Tasks of a (workload class, model), or of a site's, before what they say is used."""
PREFIX = "/learning/"
"""Model keys are ``/learning/<workload class>/<model>``; a site's, that key then ``/<site>``
(each part percent-encoded), holding JSON ``{"tasks", "mean", "variance"}``."""
SAVE_INTERVAL_S = 30.0
"""``LearningSaver`` writes what changed at least this often..."""
SAVE_AFTER_UPDATES = 100
"""...or sooner once this many tasks were learned from since the last write..."""
MIN_SAVE_GAP_S = 1.0
"""...but never twice within this long."""
MAX_PUTS_PER_COMMIT = 100
"""etcd refuses a transaction of more than --max-txn-ops (128 by default) operations."""
FINAL_SAVE_TIMEOUT_S = 2.0
"""How long a stopping saver may spend on its last write."""

_Key = tuple[str, str, str]
"""(workload class, model, site); site "" for the model's own mean."""


@dataclass(slots=True)
class _Speed:
    tasks: int
    mean: float
    """Of log(speed)."""
    variance: float

    def add(self, value: float) -> None:
        delta = value - self.mean
        self.tasks += 1
        self.mean += WEIGHT * delta
        self.variance = (1 - WEIGHT) * (self.variance + WEIGHT * delta * delta)

    def to_bytes(self) -> bytes:
        return json.dumps(
            {"tasks": self.tasks, "mean": self.mean, "variance": self.variance},
            separators=(",", ":"),
        ).encode()

    @classmethod
    def from_bytes(cls, value: bytes) -> _Speed:
        doc = json.loads(value)
        speed = cls(int(doc["tasks"]), float(doc["mean"]), float(doc["variance"]))
        if speed.tasks < 1 or not (math.isfinite(speed.mean) and math.isfinite(speed.variance)):
            raise ValueError("not a learned speed")
        if speed.variance < 0:
            raise ValueError("negative variance")
        return speed


def store_key(workload_class: str, model: str, site: str = "") -> str:
    """Where the mean of (workload class, model), or of one site's, is stored."""
    parts = [workload_class or "training", model, *([site] if site else [])]
    return PREFIX + "/".join(quote(p, safe="") for p in parts)


def _parse_key(key: str) -> _Key | None:
    parts = [unquote(p) for p in key.removeprefix(PREFIX).split("/")]
    if len(parts) == 2 and all(parts):
        return parts[0], parts[1], ""
    if len(parts) == 3 and all(parts):
        return parts[0], parts[1], parts[2]
    return None


class SpeedLearner:
    """Learned speeds per (workload class, device model), and per site of each.

    Args:
        metrics: Record each task's measured over estimated run time
            (``federation_run_time_ratio``); the simulator turns it off.
    """

    def __init__(self, *, metrics: bool = True) -> None:
        self._speeds: dict[_Key, _Speed] = {}
        self._metrics = metrics
        self._dirty: set[_Key] = set()
        self.pending = 0
        """Tasks learned from since the last save."""
        self._updated = asyncio.Event()

    def observe(
        self,
        workload_class: str,
        model: str,
        duration_s: float,
        estimated_run_s: float,
        ran_s: float,
        site: str = "",
    ) -> None:
        """One task that succeeded: ``duration_s`` of reference work ran ``ran_s`` seconds on
        ``model`` (at ``site``, when given), where the estimate said ``estimated_run_s``."""
        if not (model and duration_s > 0 and ran_s > 0 and math.isfinite(duration_s / ran_s)):
            return
        workload_class = workload_class or "training"
        if estimated_run_s > 0 and self._metrics:
            RUN_TIME_RATIO.labels(workload_class).observe(ran_s / estimated_run_s)
        value = math.log(duration_s / ran_s)
        for key in [(workload_class, model, "")] + (
            [(workload_class, model, site)] if site else []
        ):
            known = self._speeds.get(key)
            if known is None:
                self._speeds[key] = _Speed(1, value, 0.0)
            else:
                known.add(value)
            self._dirty.add(key)
        self.pending += 1
        self._updated.set()

    def _known(self, workload_class: str, model: str, site: str = "") -> _Speed | None:
        known = self._speeds.get((workload_class or "training", model, site))
        return known if known is not None and known.tasks >= MIN_TASKS else None

    def speed(self, workload_class: str, model: str, site: str = "") -> float | None:
        """The learned speed (at ``site``: the model's times the site's factor), or None while
        too few tasks finished."""
        known = self._known(workload_class, model)
        if known is None:
            return None
        return math.exp(known.mean) * (self.site_factor(site, workload_class, model) if site else 1)

    def site_factor(self, site: str, workload_class: str, model: str) -> float:
        """How fast ``model`` runs ``workload_class`` at ``site`` against its learned speed
        over all sites (1.0 while either is unknown)."""
        mine, model_wide = (
            self._known(workload_class, model, site),
            self._known(workload_class, model),
        )
        if mine is None or model_wide is None:
            return 1.0
        return math.exp(mine.mean - model_wide.mean)

    def error(self, workload_class: str, model: str, site: str = "") -> float:
        """Expected relative error of a run time on ``model`` (at ``site``, where enough of its
        tasks finished), 0 while too few tasks."""
        known = (self._known(workload_class, model, site) if site else None) or self._known(
            workload_class, model
        )
        if known is None:
            return 0.0
        return math.expm1(math.sqrt(known.variance))

    def overrides(
        self, workload_class: str, own: Mapping[str, float], site: str = ""
    ) -> dict[str, float]:
        """Speeds to estimate with: the learned ones (at ``site``, with its factors), under
        the task's own overrides."""
        wanted = workload_class or "training"
        learned = {
            model: math.exp(s.mean)
            for (wc, model, at), s in self._speeds.items()
            if wc == wanted and not at and s.tasks >= MIN_TASKS
        }
        if site:
            learned = {m: v * self.site_factor(site, wanted, m) for m, v in learned.items()}
        return {**learned, **own}

    def learned(self) -> dict[str, dict[str, float]]:
        """Every learned speed in use: workload class -> model -> speed."""
        out: dict[str, dict[str, float]] = {}
        for (wc, model, site), s in sorted(self._speeds.items()):
            if not site and s.tasks >= MIN_TASKS:
                out.setdefault(wc, {})[model] = math.exp(s.mean)
        return out

    # Persistence.

    async def load(self, store: Store) -> int:
        """Replace what this learner knows by what ``store`` holds; the number of entries read.
        An entry that cannot be read is skipped (and logged), never fatal."""
        speeds: dict[_Key, _Speed] = {}
        start_after = ""
        while True:
            page = await store.range(PREFIX, start_after=start_after, limit=500)
            for kv in page:
                key = _parse_key(kv.key)
                try:
                    if key is None:
                        raise ValueError("unknown key")
                    speeds[key] = _Speed.from_bytes(kv.value)
                except (ValueError, KeyError, TypeError) as err:
                    log.warning("learned_speed_unreadable", key=kv.key, error=str(err))
            if len(page) < 500:
                break
            start_after = page[-1].key
        self._speeds = speeds
        self._dirty.clear()
        self.pending = 0
        return len(speeds)

    async def save(self, store: Store) -> int:
        """Write every entry changed since the last save, a few commits at most; the number
        written. What a failed commit held stays to be written next time."""
        keys = sorted(self._dirty)
        pending, self.pending = self.pending, 0
        self._dirty.clear()
        written = 0
        for first in range(0, len(keys), MAX_PUTS_PER_COMMIT):
            chunk = keys[first : first + MAX_PUTS_PER_COMMIT]
            try:
                await store.commit([Put(store_key(*k), self._speeds[k].to_bytes()) for k in chunk])
            except BaseException:
                self._dirty.update(keys[first:])
                self.pending += max(pending, 1)
                raise
            written += len(chunk)
        return written

    async def updated(self) -> None:
        """Wait until some task was learned from since the last call returned."""
        await self._updated.wait()
        self._updated.clear()


class LearningSaver:
    """Writes a learner's changes to the store in batches, for one term of leadership.

    ``run`` saves every ``interval_s`` when something changed, or sooner once ``batch`` tasks
    wait (never twice within ``min_gap_s``), and once more when cancelled. A failed write is
    logged and retried at the next turn.
    """

    def __init__(
        self,
        learner: SpeedLearner,
        store: Store,
        *,
        interval_s: float = SAVE_INTERVAL_S,
        batch: int = SAVE_AFTER_UPDATES,
        min_gap_s: float = MIN_SAVE_GAP_S,
    ) -> None:
        self._learner = learner
        self._store = store
        self._interval_s = interval_s
        self._batch = max(1, batch)
        self._min_gap_s = min_gap_s
        self.saves = 0
        """Commits made by this saver (for tests and logs)."""

    async def run(self) -> None:
        try:
            while True:
                await self._wait()
                await self._save()
        except asyncio.CancelledError:
            if self._learner.pending:
                with contextlib.suppress(Exception):
                    async with asyncio.timeout(FINAL_SAVE_TIMEOUT_S):
                        await self._save()
            raise

    async def _wait(self) -> None:
        """Until ``interval_s`` passed with something to write, or ``batch`` tasks wait."""
        started = time.monotonic()
        deadline = started + self._interval_s
        while True:
            left = deadline - time.monotonic()
            if self._learner.pending >= self._batch or (left <= 0 and self._learner.pending):
                break
            if left <= 0:
                deadline = time.monotonic() + self._interval_s
                left = self._interval_s
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(left):
                    await self._learner.updated()
        gap = started + self._min_gap_s - time.monotonic()
        if gap > 0:
            await asyncio.sleep(gap)

    async def _save(self) -> None:
        try:
            written = await self._learner.save(self._store)
        except asyncio.CancelledError:
            raise
        except Exception as err:
            log.warning("learned_speeds_not_saved", error=str(err))
            return
        if written:
            self.saves += 1
            log.debug("learned_speeds_saved", entries=written)
