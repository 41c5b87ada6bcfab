"""Which ranked sites each negotiation round offers a task to."""

from __future__ import annotations


def offer_rounds(candidates: int, offers_at_once: int) -> list[tuple[int, int]]:
    """The ``[first, stop)`` slices of the ranked sites that each negotiation round offers to.

    The first round offers the best site alone: it usually accepts, and an offer holds
    capacity at a site until it is committed or released, so offering more sites at once would
    reserve every job several times over and make the others decline their own offers. Once
    the best site has declined, later rounds offer ``offers_at_once`` sites at a time, so a run
    of declines costs few round trips.
    """
    rounds = [(0, min(1, candidates))] if candidates else []
    step = max(1, offers_at_once)
    rounds += [(first, min(first + step, candidates)) for first in range(1, candidates, step)]
    return rounds
