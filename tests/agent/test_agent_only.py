"""The agent runs on the base install alone: it imports nothing of the coordinator extra
(numpy, CEL, aetcd, rich, gRPC health and reflection) nor what only a feature it is not
configured for needs, nor cryptography (a running agent neither, having joined and renewed),
a replica's supervisor imports next to nothing, and without CEL the agent declines a task
with a device selector, saying what to install."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from pathlib import Path

import pytest

from federation.agent import packing, supervisor
from federation.api.v1 import jobs_pb2
from federation.local import LocalFederation
from federation.programs import COORDINATOR_EXTRA
from federation.testing.cluster import cpu_site

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


LOADED = """
import sys
import edge_agent.__main__, datacenter_agent.__main__
import federation.agent.main, federation.agent.embedded_core
print("\\n".join(sorted(sys.modules)))
"""

NOT_ON_THE_AGENTS_PATH = (
    "numpy",
    "cel",
    "aetcd",
    "pynvml",  # with the first NVIDIA scan, on a host whose driver library loads
    "obstore",  # with a site's object store
    "opentelemetry",  # with otlp_endpoint
    "federation.coordinator",
    "federation.store",
    "federation.sim",
    "federation.cli",
    "cryptography",  # keys and CSRs are made, bundles and pairs checked, in a child process
)
PLACEMENT_THE_AGENT_READS = {
    "federation.placement",
    "federation.placement.compat",
    "federation.placement.devices",
    "federation.placement.selector_cost",
}


def test_the_agent_loads_nothing_it_does_not_run() -> None:
    """Imported here, where the coordinator extra is installed, the agents' modules load
    neither it (numpy, CEL) nor what only a configured feature needs (NVML's bindings, the S3
    client, tracing), nor a module of the coordinator, nor placement beyond the packers'."""
    done = subprocess.run([sys.executable, "-c", LOADED], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    loaded = done.stdout.split()
    assert "federation.agent.main" in loaded
    assert [
        m for m in loaded if any(m == p or m.startswith(p + ".") for p in NOT_ON_THE_AGENTS_PATH)
    ] == []
    placement = {m for m in loaded if m.startswith("federation.placement")}
    assert placement <= PLACEMENT_THE_AGENT_READS


def mapped_files(pid: int) -> str:
    """What ``pid`` has mapped: its libraries (and the files it maps)."""
    return Path(f"/proc/{pid}/maps").read_text()


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="reads /proc/PID/maps")
async def test_an_agent_that_joined_and_renewed_holds_no_cryptography(tmp_path: Path) -> None:
    """A real agent joins with a token, connects, and renews its certificate (10 s long, so
    due after about 7 s): its process has mapped no library of cryptography, which is about
    10 MiB of an agent's memory (what ``bench/agent.py`` measures as ``idle_rss_mib``)."""
    config = tmp_path / "coordinator.toml"
    config.write_text("site_certificate_lifetime_s = 10\n")
    fed = LocalFederation(
        tmp_path / "fed", [cpu_site("lean")], coordinator_args=["--config", str(config)]
    )
    try:
        await fed.start()
        cert = fed.root / "sites" / "lean" / "state" / "site.pem"
        joined = cert.read_bytes()
        deadline = time.monotonic() + 30
        while cert.read_bytes() == joined:
            assert time.monotonic() < deadline, "the agent did not renew its certificate"
            await asyncio.sleep(0.2)
        await fed.wait_connected()
        maps = mapped_files(fed.processes["lean"].pid)
    finally:
        fed.stop()
    assert "/cryptography/" not in maps


def test_a_replicas_supervisor_imports_little() -> None:
    """The spawner runs the supervisor's module as ``python -I -S``: the standard library alone,
    and none of its larger modules (every supervisor it forks holds what it imported)."""
    code = (
        f"import sys; sys.path.insert(0, {str(Path(supervisor.__file__).parent)!r}); "
        "import supervisor; print('\\n'.join(sorted(sys.modules)))"
    )
    done = subprocess.run([sys.executable, "-I", "-S", "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    loaded = done.stdout.split()
    assert "supervisor" in loaded
    heavy = {"typing", "federation", "asyncio", "subprocess", "json", "selectors", "enum"}
    heavy |= {"contextlib", "ctypes"}
    assert [m for m in loaded if m.split(".")[0] in heavy] == []


def test_without_cel_a_selector_is_declined_naming_the_extra(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(packing, "selectors_installed", lambda: False)
    acc = jobs_pb2.AcceleratorRequest(kind=1, count=1, selector='device.model == "H100"')
    assert "install fedplane[cel]" in packing.request_problem(acc)
    assert packing.request_problem(jobs_pb2.AcceleratorRequest(kind=1, count=1)) == ""
