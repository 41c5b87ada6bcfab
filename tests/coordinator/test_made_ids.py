"""Ids the coordinator makes never repeat, even when its random draw does within one
millisecond (24 random bits collide within a large batch)."""

from __future__ import annotations

import secrets

import pytest

from federation.coordinator.jobs import records as jobs


def test_a_repeated_random_part_is_drawn_again(monkeypatch: pytest.MonkeyPatch) -> None:
    real = secrets.token_bytes
    blocks = iter([bytes(3 * 1024)])  # the first block: the same random part a thousand times

    def draws(n: int) -> bytes:
        return next(blocks, None) or real(n)

    monkeypatch.setattr(jobs.secrets, "token_bytes", draws)
    monkeypatch.setattr(jobs.time, "time", lambda: 1_800_000_000.0)
    jobs._ID_SUFFIXES.clear()
    made = [jobs.new_job_id() for _ in range(3)]
    assert made[0] == "j-1a3185c5000-000000"
    assert len(set(made)) == 3, made
    assert all(m.startswith("j-1a3185c5000-") for m in made)
