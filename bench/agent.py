"""What a site agent costs a small edge box: its install, its import time, its memory idle,
and each running replica's supervisor, on an agent-only install.

The wheel built from this tree is installed with its base dependencies alone (no extras, no
pip) into a fresh virtual environment; the agent is imported and run from there, away from
the source tree. Baselines in the same run: a bare ``python -I -c pass`` (start-up and memory
of the interpreter alone) and the empty environment. A real coordinator (from this
environment) and one agent (from the agent-only one) run on loopback; the agent is measured
once connected and idle, then while it runs N replicas that sleep (their supervisors' memory,
apart from the replicas' own: resident, and private, which leaves out the pages every
supervisor shares with the spawner that forked it, the others and the agent; and the
spawner's, one per agent).

    python bench/agent.py [--replicas 4] [--json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from federation.client import Client
from federation.local import LocalFederation
from federation.testing.cluster import cpu_site

AGENT_MODULES = "import federation.agent.main, federation.agent.embedded_core, edge_agent"


def startup_s(python: str, code: str, repeat: int = 5) -> float:
    """Median wall time of ``python -c code`` in a fresh interpreter, away from the sources."""
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        subprocess.run([python, "-c", code], check=True, capture_output=True, cwd="/")
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def bare_rss_mib() -> float:
    """The resident set of an idle interpreter, for comparison."""
    with subprocess.Popen([sys.executable, "-I", "-c", "import time; time.sleep(5)"]) as bare:
        time.sleep(0.5)
        found = rss_mib(bare.pid)
        bare.kill()
    return found


def tree_mb(root: Path) -> float:
    """Bytes of the files under ``root``, in MB (10^6)."""
    files = (p for p in root.rglob("*") if p.is_file() and not p.is_symlink())
    return sum(p.stat().st_size for p in files) / 1e6


def agent_only_install(root: Path) -> tuple[Path, float, float]:
    """A fresh virtual environment holding the wheel built from this tree and its base
    dependencies (no pip): its python, its size and the empty environment's, in MB. Raises
    where the wheel cannot be built or the package index cannot be reached."""
    repo = Path(__file__).resolve().parent.parent
    venv, wheels = root / "agent-venv", root / "wheels"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    empty = tree_mb(venv)
    pip = [sys.executable, "-m", "pip", "--quiet", "--disable-pip-version-check"]
    subprocess.run([*pip, "wheel", "--no-deps", "-w", str(wheels), str(repo)], check=True)
    (wheel,) = wheels.glob("fedplane-*.whl")
    python = venv / "bin" / "python"
    # Not PYTHONPATH: a source tree on it would pass for fedplane installed already.
    alone = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    subprocess.run([*pip, "--python", str(python), "install", str(wheel)], check=True, env=alone)
    return python, tree_mb(venv), empty


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def private_mib(pid: int) -> float:
    """What ``pid`` alone holds (its private pages, USS): the memory it frees by exiting.
    Pages it shares with the agent and the other supervisors (the interpreter's library,
    libc) count once for them all, not once per replica as in its resident set."""
    private = 0
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
        if line.startswith(("Private_Clean:", "Private_Dirty:")):
            private += int(line.split()[1])
    return private / 1024


def children(pid: int) -> list[int]:
    """The children of process ``pid``, whichever of its threads started them."""
    return [
        int(child)
        for thread in Path(f"/proc/{pid}/task").iterdir()
        for child in (thread / "children").read_text().split()
    ]


def spawner(agent_pid: int) -> int | None:
    """The agent's spawner, its child that forks the supervisors, once started."""
    for child in children(agent_pid):
        if b"supervisor.serve(" in Path(f"/proc/{child}/cmdline").read_bytes():
            return child
    return None


def supervisors(agent_pid: int) -> list[int]:
    """The replica supervisors that have started their replica: the spawner's children, each
    with a child of its own (one not yet watching its replica would be measured short)."""
    forks = spawner(agent_pid)
    return [child for child in children(forks) if children(child)] if forks else []


async def measure(replicas: int) -> dict[str, float | None]:
    with tempfile.TemporaryDirectory(prefix="bench-agent-") as root:
        python, installed, empty = agent_only_install(Path(root))
        python_s = startup_s(str(python), "pass")
        agent_s = startup_s(str(python), AGENT_MODULES)
        bare = bare_rss_mib()
        site = cpu_site("bench-agent", stop_tasks_on_exit=True)
        fed = LocalFederation(Path(root) / "fed", [site], agent_python=str(python))
        # The agent runs as `python -m edge_agent` in this process's folder, which goes first
        # on its sys.path: started from the source tree it would run the tree's modules, not
        # the installed wheel's.
        here = os.getcwd()
        os.chdir(root)
        try:
            await fed.start()
        finally:
            os.chdir(here)
        try:
            agent = fed.processes["bench-agent"].pid
            await asyncio.sleep(2)  # a few heartbeats: the agent settles after its hello
            idle = rss_mib(agent)
            async with Client(fed.address, fed.operator().tls) as client:
                task = {
                    "name": "t",
                    "command": [sys.executable, "-c", "import time; time.sleep(600)"],
                    "replicas": replicas,
                    "resources": {"cpu": 0.5, "memory_mib": 16},
                }
                job = await client.submit({"name": "sleepers", "tasks": [task]})
                for _ in range(600):  # a minute at most
                    if len(supervisors(agent)) >= replicas:
                        break
                    await asyncio.sleep(0.1)
                else:
                    raise RuntimeError("the replicas did not start")
                await asyncio.sleep(1)  # each supervisor in its loop, the replica's output read
                watching = supervisors(agent)
                per_replica = statistics.median(rss_mib(pid) for pid in watching)
                per_replica_private = statistics.median(private_mib(pid) for pid in watching)
                forks = spawner(agent)
                assert forks is not None  # it forked the supervisors
                spawner_rss = rss_mib(forks)
                await client.cancel(job.id)
        finally:
            fed.stop()
    return {
        "import_s": agent_s - python_s,
        "python_start_s": python_s,
        "idle_rss_mib": idle,
        "bare_python_rss_mib": bare,
        "per_replica_rss_mib": per_replica,
        "per_replica_private_mib": per_replica_private,
        "spawner_rss_mib": spawner_rss,
        "install_mb": installed,
        "empty_venv_mb": empty,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--replicas", type=int, default=4)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    result = asyncio.run(measure(args.replicas))
    if args.json:
        json.dump(result, sys.stdout, indent=2)
        print()
        return
    print(f"{'figure':<22} {'agent':>9} {'bare python':>12}")
    print(f"{'import / start s':<22} {result['import_s']:>9.3f} {result['python_start_s']:>12.3f}")
    print(
        f"{'idle RSS MiB':<22} {result['idle_rss_mib']:>9.1f} "
        f"{result['bare_python_rss_mib']:>12.1f}"
    )
    print(f"{'per replica RSS MiB':<22} {result['per_replica_rss_mib']:>9.1f} {'':>12}")
    print(f"{'per replica own MiB':<22} {result['per_replica_private_mib']:>9.1f} {'':>12}")
    print(f"{'spawner RSS MiB':<22} {result['spawner_rss_mib']:>9.1f} {'':>12}")
    installed, empty = result["install_mb"], result["empty_venv_mb"]
    shown = f"{installed:>9.1f}" if installed is not None else f"{'n/a':>9}"
    print(f"{'install MB':<22} {shown} {empty or 0:>12.1f}  (beside: an empty venv)")


if __name__ == "__main__":
    main()
