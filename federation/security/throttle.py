"""Per-identity limits: a request rate, a job rate, and concurrent streams.

One tenant must not be able to take the coordinator from the others by sheer volume. Every
client identity gets its own token buckets (requests, and jobs submitted) and a count of open
streams; past a limit the call is refused with ``RESOURCE_EXHAUSTED`` and a ``RetryInfo`` saying
when a token will be there again. Sites are not throttled here: each has one stream, and a new
one replaces the old.
"""

from __future__ import annotations

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
    """Sustained request bytes per second per identity: large requests cost their checks."""
    byte_burst: float = 16 << 20
    """Request bytes an idle identity may send at once."""


class RateLimitedError(ResourceExhaustedError):
    """An identity went past one of its limits; ``retry_after_s`` says when to try again."""

    reason = "RATE_LIMITED"

    def __init__(self, message: str, retry_after_s: float) -> None:
        super().__init__(message, retry_after_s=f"{retry_after_s:.3f}")
        self.retry_after_s = retry_after_s


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


class Throttle:
    """The limits of every client identity, kept in memory (they restart with the process)."""

    def __init__(self, limits: ThrottleLimits, clock: Callable[[], float] = time.monotonic) -> None:
        self.limits = limits
        self._clock = clock
        self._requests = _Rate(limits.requests_per_s, limits.request_burst)
        self._jobs = _Rate(limits.jobs_per_s, limits.job_burst)
        self._bytes = _Rate(limits.bytes_per_s, limits.byte_burst)
        self._streams: dict[Identity, int] = {}

    def admit(self, who: Identity, jobs: int = 0, size: int = 0) -> None:
        """Count one request of ``size`` bytes submitting ``jobs`` jobs; raise
        ``RateLimitedError`` past a limit."""
        now = self._clock()
        wait = self._requests.take(who, 1.0, now)
        if wait:
            raise RateLimitedError(
                f"{who} sends more than {self.limits.requests_per_s:g} requests per second. "
                f"To fix: retry after {wait:.2f}s, or batch jobs with SubmitJobs",
                wait,
            )
        if size:
            wait = self._bytes.take(who, float(size), now)
            if wait:
                raise RateLimitedError(
                    f"{who} sends more than {self.limits.bytes_per_s:g} request bytes per "
                    f"second. To fix: retry after {wait:.2f}s, or send smaller requests",
                    wait,
                )
        if jobs:
            wait = self._jobs.take(who, float(jobs), now)
            if wait:
                raise RateLimitedError(
                    f"{who} submits more than {self.limits.jobs_per_s:g} jobs per second. "
                    f"To fix: retry after {wait:.2f}s",
                    wait,
                )

    def open_stream(self, who: Identity) -> None:
        """Count a stream opened by ``who``; raise ``RateLimitedError`` past the limit."""
        held = self._streams.get(who, 0)
        if self.limits.streams and held >= self.limits.streams:
            raise RateLimitedError(
                f"{who} already holds {held} open streams, the most allowed. To fix: close "
                "watches you no longer read, or watch several jobs in one stream",
                1.0,
            )
        self._streams[who] = held + 1

    def close_stream(self, who: Identity) -> None:
        """Count a stream of ``who`` closed."""
        held = self._streams.get(who, 0) - 1
        if held > 0:
            self._streams[who] = held
        else:
            self._streams.pop(who, None)
