"""Per-identity limits: token buckets for requests and jobs, and a count of open streams."""

from __future__ import annotations

import asyncio

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
    with pytest.raises(RateLimitedError, match="request and reply bytes per second") as caught:
        throttle.admit(A, size=500)
    assert caught.value.retry_after_s == pytest.approx(0.5)
    throttle.admit(B, size=3000)  # another identity's bytes are its own
    clock.now += 0.5
    throttle.admit(A, size=500)


async def test_a_refusal_is_held_and_its_retry_hint_shrinks_by_as_much() -> None:
    """A client that ignores retry hints gets each refusal only after a wait, so it cannot
    make the coordinator refuse in a tight loop; the hint then says what is left to wait."""
    throttle = Throttle(ThrottleLimits(requests_per_s=2, request_burst=1, hold_s=0.05))
    throttle.admit(A)
    with pytest.raises(RateLimitedError) as caught:
        throttle.admit(A)
    assert caught.value.retry_after_s == pytest.approx(0.5, abs=0.01)
    loop = asyncio.get_running_loop()
    start = loop.time()
    sent = await throttle.hold(caught.value)
    assert loop.time() - start >= 0.05
    assert sent.retry_after_s == pytest.approx(caught.value.retry_after_s - 0.05)
    assert "retry after 0.45s" in str(sent)


async def test_held_refusals_are_bounded_per_identity() -> None:
    """Past ``max_held`` held refusals of one identity, more are sent at once; another
    identity's are still held."""
    throttle = Throttle(ThrottleLimits(requests_per_s=1, request_burst=1, hold_s=10, max_held=2))
    throttle.admit(A)
    throttle.admit(B)
    refusals = []
    for who in (A, A, A, B):
        with pytest.raises(RateLimitedError) as caught:
            throttle.admit(who)
        refusals.append(caught.value)
    held = [asyncio.ensure_future(throttle.hold(r)) for r in refusals[:2]]
    await asyncio.sleep(0.01)
    assert await asyncio.wait_for(throttle.hold(refusals[2]), 1) is refusals[2]
    other = asyncio.ensure_future(throttle.hold(refusals[3]))
    await asyncio.sleep(0.01)
    assert not other.done()
    assert not any(h.done() for h in held)
    for task in (*held, other):
        task.cancel()
    await asyncio.gather(*held, other, return_exceptions=True)
    assert throttle._held == {}


def test_a_large_reply_costs_its_bytes() -> None:
    """A small request for a large page is charged what it sends back: the identity's next
    request waits until its byte rate has paid for the reply."""
    clock = Clock()
    throttle = Throttle(ThrottleLimits(bytes_per_s=1000, byte_burst=2000), clock)
    throttle.admit(A, size=10)
    throttle.charge_reply(A, 5000)  # into debt, down to one burst below zero
    with pytest.raises(RateLimitedError, match="request and reply bytes") as caught:
        throttle.admit(A, size=10)
    assert caught.value.retry_after_s == pytest.approx(2.01)
    throttle.admit(B, size=10)  # another identity pays nothing for it
    clock.now += 2.01
    throttle.admit(A, size=10)
