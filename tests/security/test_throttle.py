"""Per-identity limits: token buckets for requests and jobs, and a count of open streams."""

from __future__ import annotations

import pytest

from federation.security.identity import Identity, Role
from federation.security.throttle import RateLimitedError, Throttle, ThrottleLimits

A = Identity(Role.TENANT, "team-a")
B = Identity(Role.TENANT, "team-b")


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_requests_past_the_burst_wait_for_the_rate() -> None:
    """An idle identity may send its burst at once; then one per 1/rate seconds."""
    clock = Clock()
    throttle = Throttle(ThrottleLimits(requests_per_s=10, request_burst=3), clock)
    for _ in range(3):
        throttle.admit(A)
    with pytest.raises(RateLimitedError) as caught:
        throttle.admit(A)
    assert caught.value.retry_after_s == pytest.approx(0.1)
    clock.now += 0.1
    throttle.admit(A)


def test_identities_have_buckets_of_their_own() -> None:
    """One identity at its limit does not slow another."""
    throttle = Throttle(ThrottleLimits(requests_per_s=1, request_burst=1), Clock())
    throttle.admit(A)
    with pytest.raises(RateLimitedError):
        throttle.admit(A)
    throttle.admit(B)


def test_jobs_count_each_spec_of_a_batch() -> None:
    """A batch takes one request token and a job token per spec; a refused batch takes none."""
    clock = Clock()
    throttle = Throttle(ThrottleLimits(jobs_per_s=100, job_burst=150), clock)
    throttle.admit(A, jobs=100)
    with pytest.raises(RateLimitedError, match="jobs per second") as caught:
        throttle.admit(A, jobs=100)
    assert caught.value.retry_after_s == pytest.approx(0.5)
    throttle.admit(A, jobs=50)


def test_a_batch_larger_than_the_burst_waits_for_a_full_bucket() -> None:
    """A batch bigger than the burst is not refused forever: it needs a full bucket."""
    clock = Clock()
    throttle = Throttle(ThrottleLimits(jobs_per_s=10, job_burst=20), clock)
    throttle.admit(A, jobs=1000)
    with pytest.raises(RateLimitedError):
        throttle.admit(A, jobs=1000)
    clock.now += 2.0
    throttle.admit(A, jobs=1000)


def test_zero_turns_a_limit_off() -> None:
    """Rates and streams of zero are unlimited."""
    throttle = Throttle(ThrottleLimits(requests_per_s=0, jobs_per_s=0, streams=0), Clock())
    for _ in range(10_000):
        throttle.admit(A, jobs=10_000)
        throttle.open_stream(A)


def test_streams_are_counted_until_closed() -> None:
    """An identity holding its most streams is refused another until one closes."""
    throttle = Throttle(ThrottleLimits(streams=2), Clock())
    throttle.open_stream(A)
    throttle.open_stream(A)
    with pytest.raises(RateLimitedError, match="2 open streams"):
        throttle.open_stream(A)
    throttle.open_stream(B)
    throttle.close_stream(A)
    throttle.open_stream(A)


def test_request_bytes_have_a_rate_of_their_own() -> None:
    """Large requests spend the byte bucket: past it, even a request allowed by count waits
    for the bytes it would bring."""
    clock = Clock()
    limits = ThrottleLimits(
        requests_per_s=100, request_burst=100, bytes_per_s=1000, byte_burst=3000
    )
    throttle = Throttle(limits, clock)
    throttle.admit(A, size=2000)
    throttle.admit(A, size=1000)
    with pytest.raises(RateLimitedError, match="request bytes per second") as caught:
        throttle.admit(A, size=500)
    assert caught.value.retry_after_s == pytest.approx(0.5)
    throttle.admit(B, size=3000)  # another identity's bytes are its own
    clock.now += 0.5
    throttle.admit(A, size=500)
