"""The agent runs on the base install alone: it imports nothing of the coordinator extra
(numpy, CEL, aetcd, rich, gRPC health and reflection), and without CEL it declines a task
with a device selector, saying what to install."""

from __future__ import annotations

import subprocess
import sys

import pytest

from federation.agent import packing
from federation.api.v1 import jobs_pb2
from federation.programs import COORDINATOR_EXTRA

BLOCKED = f"""
import sys
class Block:
    def find_spec(self, name, path=None, target=None):
        if name.split('.')[0] in {COORDINATOR_EXTRA!r}:
            raise ImportError(f"{{name}} is not installed on an agent host")
sys.meta_path.insert(0, Block())
import edge_agent.__main__, datacenter_agent.__main__
import federation.agent.main, federation.agent.embedded_core
print("imported")
"""


def test_the_agent_imports_nothing_of_the_coordinator_extra() -> None:
    """A finder refuses every module of the extra (grpc and structlog try two of them and
    go on without): the agents' modules import all the same."""
    done = subprocess.run([sys.executable, "-c", BLOCKED], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "imported"


def test_without_cel_a_selector_is_declined_naming_the_extra(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(packing, "selectors_installed", lambda: False)
    acc = jobs_pb2.AcceleratorRequest(kind=1, count=1, selector='device.model == "H100"')
    assert "install fedplane[cel]" in packing.request_problem(acc)
    assert packing.request_problem(jobs_pb2.AcceleratorRequest(kind=1, count=1)) == ""
