"""The Slurm core answers offers and commits as every core does (``agent.decisions``)."""

from __future__ import annotations

import pytest
from agent.decisions import CASES, Case, play

from .cores import MakeCore

pytestmark = pytest.mark.xdist_group("slurm")


@pytest.mark.parametrize("case", [pytest.param(c, id=name) for name, c in CASES.items()])
async def test_slurm_core_decides_as_every_core(make_core: MakeCore, case: Case) -> None:
    harness = await make_core()
    assert await play(harness.core, case) == case.answers
