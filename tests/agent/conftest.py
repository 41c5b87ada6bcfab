"""Fixtures shared by the agent tests."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from .beacon import Beacon


@pytest.fixture
async def beacon() -> AsyncIterator[Beacon]:
    """A listening beacon, closed after the test."""
    b = Beacon()
    await b.start()
    yield b
    await b.stop()
