"""Per-identity limits: a request rate, a job rate, and concurrent streams.

One tenant must not be able to take the coordinator from the others by sheer volume. Every
client identity gets its own token buckets (requests, and jobs submitted) and a count of open
streams; past a limit the call is refused with ``RESOURCE_EXHAUSTED`` and a ``RetryInfo`` saying
when a token will be there again. Sites are not throttled here: each has one stream, and a new
one replaces the old.

A refusal is held before it is sent (up to ``hold_s``, and the retry hint shrinks by as much):
a client that ignores retry hints and loops would otherwise make the coordinator refuse
thousands of calls a second, and refusing costs TLS, parsing and a turn of the event loop that
other tenants' calls wait behind. Held refusals per identity are bounded; past that, they are
sent at once.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from federation.errors import ResourceExhaustedError
from federation.security.identity import Identity


@dataclass(frozen=True, slots=True)
class ThrottleLimits:
    """How much one client identity may ask for; zero turns a limit off."""

    requests_per_s: float = 200.0
    """Sustained RPCs per second per identity."""
    request_burst: float = 400.0
    """RPCs an idle identity may send at once."""
    jobs_per_s: float = 50.0
    """Sustained jobs submitted per second per identity (SubmitJobs counts each spec)."""
    job_burst: float = 1000.0
    """Jobs an idle identity may submit at once (one full SubmitJobs batch)."""
    streams: int = 32
    """Streams (WatchJobs) one identity may hold open at once."""
    bytes_per_s: float = 4 << 20
    """Sustained request and reply bytes per second per identity: large requests cost their
    checks, large replies their reading and encoding."""
    byte_burst: float = 16 << 20
    """Request and reply bytes an idle identity may move at once."""
    hold_s: float = 1.0
    """Longest a refusal is held before it is sent."""
    max_held: int = 64
    """Refusals one identity may have held at once; further ones are sent at once."""


class RateLimitedError(ResourceExhaustedError):
    """An identity went past one of its limits; ``retry_after_s`` says when to try again."""

    reason = "RATE_LIMITED"

    def __init__(self, who: Identity, limit: str, fix: str, retry_after_s: float) -> None:
        super().__init__(
            f"{who} {limit}. To fix: retry after {retry_after_s:.2f}s{fix}",
            retry_after_s=f"{retry_after_s:.3f}",
        )
        self.who, self.limit, self.fix = who, limit, fix
        self.retry_after_s = retry_after_s

    def waited(self, seconds: float) -> RateLimitedError:
        """The same refusal, ``seconds`` later."""
        left = max(0.0, self.retry_after_s - seconds)
        return RateLimitedError(self.who, self.limit, self.fix, left)


@dataclass(slots=True)
class _Bucket:
    tokens: float
    at: float


@dataclass(slots=True)
class _Rate:
    per_s: float
    burst: float
    buckets: dict[Identity, _Bucket] = field(default_factory=dict)

    def take(self, who: Identity, cost: float, now: float) -> float:
        """Take ``cost`` tokens; 0.0 when granted, else seconds until they would be there."""
        if self.per_s <= 0:
            return 0.0
        bucket = self.buckets.get(who)
        if bucket is None:
            bucket = self.buckets[who] = _Bucket(self.burst, now)
        bucket.tokens = min(self.burst, bucket.tokens + (now - bucket.at) * self.per_s)
        bucket.at = now
        cost = min(cost, self.burst)  # a batch larger than the burst waits for a full bucket
        if bucket.tokens >= cost - 1e-9:  # refilled by float steps: allow for rounding
            bucket.tokens -= cost
            return 0.0
        return (cost - bucket.tokens) / self.per_s

    def charge(self, who: Identity, cost: float, now: float) -> None:
        """Take ``cost`` tokens after the fact, into debt down to one burst below zero."""
        if self.per_s <= 0:
            return
        bucket = self.buckets.get(who)
        if bucket is None:
            bucket = self.buckets[who] = _Bucket(self.burst, now)
        bucket.tokens = min(self.burst, bucket.tokens + (now - bucket.at) * self.per_s)
        bucket.at = now
        bucket.tokens = max(-self.burst, bucket.tokens - cost)


class Throttle:
    """The limits of every client identity, kept in memory (they restart with the process)."""

    def __init__(self, limits: ThrottleLimits, clock: Callable[[], float] = time.monotonic) -> None:
        self.limits = limits
        self._clock = clock
        self._requests = _Rate(limits.requests_per_s, limits.request_burst)
        self._jobs = _Rate(limits.jobs_per_s, limits.job_burst)
        self._bytes = _Rate(limits.bytes_per_s, limits.byte_burst)
        self._streams: dict[Identity, int] = {}
        self._held: dict[Identity, int] = {}

    def admit(self, who: Identity, jobs: int = 0, size: int = 0) -> None:
        """Count one request of ``size`` bytes submitting ``jobs`` jobs; raise
        ``RateLimitedError`` past a limit."""
        now = self._clock()
        limits = self.limits
        wait = self._requests.take(who, 1.0, now)
        if wait:
            raise RateLimitedError(
                who,
                f"sends more than {limits.requests_per_s:g} requests per second",
                ", or batch jobs with SubmitJobs",
                wait,
            )
        if size and (wait := self._bytes.take(who, float(size), now)):
            raise RateLimitedError(
                who,
                f"moves more than {limits.bytes_per_s:g} request and reply bytes per second",
                ", or send smaller requests and ask for smaller pages",
                wait,
            )
        if jobs and (wait := self._jobs.take(who, float(jobs), now)):
            raise RateLimitedError(
                who, f"submits more than {limits.jobs_per_s:g} jobs per second", "", wait
            )

    def charge_reply(self, who: Identity, size: int) -> None:
        """Count a reply of ``size`` bytes against ``who``'s byte rate: a small request for a
        large page costs what it sends back, and later requests wait for it."""
        self._bytes.charge(who, float(size), self._clock())

    def open_stream(self, who: Identity) -> None:
        """Count a stream opened by ``who``; raise ``RateLimitedError`` past the limit."""
        held = self._streams.get(who, 0)
        if self.limits.streams and held >= self.limits.streams:
            raise RateLimitedError(
                who,
                f"already holds {held} open streams, the most allowed",
                ", and close watches you no longer read or watch several jobs in one stream",
                1.0,
            )
        self._streams[who] = held + 1

    async def hold(self, refusal: RateLimitedError) -> RateLimitedError:
        """Wait out as much of ``refusal``'s retry time as allowed; the refusal to send then."""
        who, pause = refusal.who, min(refusal.retry_after_s, self.limits.hold_s)
        held = self._held.get(who, 0)
        if pause <= 0 or held >= self.limits.max_held:
            return refusal
        self._held[who] = held + 1
        try:
            await asyncio.sleep(pause)
        finally:
            if (left := self._held[who] - 1) > 0:
                self._held[who] = left
            else:
                del self._held[who]
        return refusal.waited(pause)

    def close_stream(self, who: Identity) -> None:
        """Count a stream of ``who`` closed."""
        held = self._streams.get(who, 0) - 1
        if held > 0:
            self._streams[who] = held
        else:
            self._streams.pop(who, None)
