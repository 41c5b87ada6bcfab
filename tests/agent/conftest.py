"""Fixtures shared by the agent tests."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest

from federation.agent.embedded_core import EmbeddedCore
from federation.api.v1 import resources_pb2

from .beacon import Beacon
from .cores import Recorder


@pytest.fixture
async def beacon() -> AsyncIterator[Beacon]:
    """A listening beacon, closed after the test."""
    b = Beacon()
    await b.start()
    yield b
    await b.stop()


@pytest.fixture
def recorder() -> Recorder:
    """A fresh recorder of reports and changes."""
    return Recorder()


@pytest.fixture
async def make_core(
    tmp_path: Path, recorder: Recorder
) -> AsyncIterator[Callable[..., EmbeddedCore]]:
    """Builds cores wired to the recorder; shuts them down (killing children) afterwards."""
    cores: list[EmbeddedCore] = []

    def build(
        nodes: list[resources_pb2.Node], kill_grace_s: float = 2.0, **extra: Any
    ) -> EmbeddedCore:
        core = EmbeddedCore(
            nodes,
            site="site-a",
            work_dir=tmp_path / "work",
            on_status=recorder.on_status,
            on_change=recorder.on_change,
            kill_grace_s=kill_grace_s,
            **extra,
        )
        cores.append(core)
        return core

    yield build
    for core in cores:
        await core.shutdown(grace_s=0.5)
