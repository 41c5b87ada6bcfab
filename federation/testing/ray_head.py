"""A real Ray head (``ray start --head --block``) on this machine, for the Ray core's tests.

The head declares ``GPU_A100`` devices as a custom resource: the machine has no GPU, so they
are declared inventory (``RayDevice.declared``), as an inventory file declares hardware to an
embedded site. The ``ray`` program comes from the ``ray`` extra, beside the interpreter.

With ``worker_types``, the head runs Ray's autoscaler with its fake multi-node provider
(``RAY_FAKE_CLUSTER=1``, ``--autoscaling-config``): a node it "launches" is one more raylet on
this machine (about 0.3 GiB each: keep ``max_workers`` small), started in a few seconds. The
wheel lacks the provider's defaults file (``fake_multi_node/example.yaml``), so the config
loads the provider as an ``external`` one and states every field itself.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from federation.agent.config import RayDevice, RaySettings
from federation.testing.etcd import free_ports, stop_process

START_TIMEOUT_S = 60.0
FAKE_PROVIDER = "ray.autoscaler._private.fake_multi_node.node_provider.FakeMultiNodeProvider"
FAKE_OBJECT_STORE_BYTES = 80 * 1024 * 1024
"""Each fake node's object store (Ray's least is 75 MiB): this host's memory is shared."""
QUICK_NODE_CHECKS = {
    "RAY_health_check_initial_delay_ms": "1000",
    "RAY_health_check_period_ms": "1000",
    "RAY_health_check_timeout_ms": "2000",
    "RAY_health_check_failure_threshold": "3",
}
"""The GCS's health checks of the nodes: 3 failed checks a second apart, so a node is found
dead a few seconds after its raylet died (Ray's defaults: 5 checks 3 s apart, after 5 s)."""


@dataclass(frozen=True)
class FakeNodeType:
    """A worker node type of the fake autoscaler: its Ray resources and how many may run."""

    resources: dict[str, float]
    max_workers: int = 1


def fake_autoscaling_config(
    gcs_address: str,
    head_cpus: int,
    worker_types: dict[str, FakeNodeType],
    idle_timeout_s: float,
) -> dict[str, Any]:
    """An autoscaling config for Ray's fake multi-node provider on the head at ``gcs_address``."""
    types: dict[str, Any] = {
        "ray.head.default": {"resources": {"CPU": head_cpus}, "node_config": {}, "max_workers": 0}
    }
    for name, worker in worker_types.items():
        types[name] = {
            "resources": {"object_store_memory": FAKE_OBJECT_STORE_BYTES, **worker.resources},
            "node_config": {},
            "min_workers": 0,
            "max_workers": worker.max_workers,
        }
    return {
        "cluster_name": "federation-fake",
        "max_workers": sum(w.max_workers for w in worker_types.values()),
        "upscaling_speed": 1.0,
        "idle_timeout_minutes": idle_timeout_s / 60,
        "provider": {
            "type": "external",
            "module": FAKE_PROVIDER,
            "gcs_address": gcs_address,
            "use_node_id_as_ip": True,
            "disable_node_updaters": True,
            "disable_launch_config_check": True,
        },
        "available_node_types": types,
        "head_node_type": "ray.head.default",
        "auth": {"ssh_user": "ubuntu"},
        "docker": {},
        **{
            key: []
            for key in (
                "initialization_commands",
                "setup_commands",
                "head_setup_commands",
                "worker_setup_commands",
                "head_start_ray_commands",
                "worker_start_ray_commands",
                "cluster_synced_files",
                "rsync_exclude",
                "rsync_filter",
            )
        },
        "file_mounts": {},
        "file_mounts_sync_continuously": False,
    }


def ray_binary() -> str | None:
    """The ``ray`` program beside this interpreter or on PATH, if Ray is installed."""
    beside = Path(sys.executable).parent / "ray"
    if beside.is_file():
        return str(beside)
    return shutil.which("ray")


@dataclass
class LocalRayHead:
    """One Ray head node with ``cpus`` CPUs and ``a100s`` declared ``GPU_A100`` devices; with
    ``worker_types``, the fake autoscaler launches those (removing them once idle for
    ``idle_timeout_s``)."""

    cpus: int = 4
    a100s: int = 2
    worker_types: dict[str, FakeNodeType] | None = None
    idle_timeout_s: float = 6.0
    quick_node_checks: bool = False
    """Find a dead node in a few seconds rather than Ray's 15-18 s (``QUICK_NODE_CHECKS``)."""
    process: subprocess.Popen[bytes] | None = None
    address: str = ""
    dashboard: str = ""
    temp_dir: str = ""
    gcs_port: int = 0

    def start(self) -> None:
        binary = ray_binary()
        if binary is None:
            raise RuntimeError("Ray is not installed (the ray extra)")
        gcs, dashboard, agent, client = free_ports(4)
        # Short: Ray's sockets live under it, and a socket path must stay under 108 bytes.
        self.temp_dir = tempfile.mkdtemp(prefix="ray", dir="/tmp")
        self.address, self.dashboard = f"127.0.0.1:{gcs}", f"http://127.0.0.1:{dashboard}"
        command = [
            binary,
            "start",
            "--head",
            "--block",
            f"--port={gcs}",
            "--node-ip-address=127.0.0.1",
            f"--dashboard-port={dashboard}",
            # Not Ray's fixed defaults, which another head on this machine may hold.
            f"--dashboard-agent-listen-port={agent}",
            f"--ray-client-server-port={client}",
            "--dashboard-host=127.0.0.1",
            "--include-dashboard=true",
            f"--num-cpus={self.cpus}",
            "--num-gpus=0",
            *([f"--resources={json.dumps({'GPU_A100': self.a100s})}"] if self.a100s else []),
            f"--temp-dir={self.temp_dir}",
            "--disable-usage-stats",
        ]
        self.gcs_port = gcs
        env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0"}
        if self.quick_node_checks:
            env.update(QUICK_NODE_CHECKS)
        if self.worker_types is not None:
            config = Path(self.temp_dir) / "autoscaling.yaml"
            config.write_text(
                yaml.safe_dump(
                    fake_autoscaling_config(
                        self.address, self.cpus, self.worker_types, self.idle_timeout_s
                    )
                )
            )
            command.append(f"--autoscaling-config={config}")
            env["RAY_FAKE_CLUSTER"] = "1"
        self.process = subprocess.Popen(
            command,
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:  # the Jobs API takes jobs once the dashboard and its node agent are up
            if self.process.poll() is not None:
                raise RuntimeError(f"ray start exited with {self.process.returncode}")
            try:
                with urllib.request.urlopen(f"{self.dashboard}/api/version", timeout=1):
                    break
            except OSError:
                if time.monotonic() > deadline:
                    raise RuntimeError("the Ray dashboard did not answer") from None
                time.sleep(0.2)
        self._first_job(deadline)

    def _first_job(self, deadline: float) -> None:
        from ray.job_submission import JobStatus, JobSubmissionClient

        client = JobSubmissionClient(self.dashboard)
        while True:
            try:
                job = client.submit_job(entrypoint="true", entrypoint_num_cpus=0)
                break
            except RuntimeError:  # "No available agent to submit job" at first
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)
        while client.get_job_status(job) not in (JobStatus.SUCCEEDED, JobStatus.FAILED):
            if time.monotonic() > deadline:
                raise RuntimeError("the Ray head ran no job")
            time.sleep(0.1)

    def settings(self, **overrides: object) -> RaySettings:
        """Settings for a core on this head; ``GPU_A100`` devices are declared A100-80GB."""
        values: dict[str, object] = {
            "address": self.address,
            "dashboard": self.dashboard,
            "python": sys.executable,
            "poll_interval_s": 0.25,
            "devices": {
                "GPU_A100": RayDevice(
                    model="A100-80GB", vendor="nvidia", memory_mib=81920, declared=True
                )
            },
        }
        values.update(overrides)
        return RaySettings(**values)  # type: ignore[arg-type]

    def stop(self) -> None:
        """Stops the head and every process it started.

        ``ray start --block`` leaves its processes running when it is stopped, and some of them
        start sessions of their own: each is found by this head's temp dir in its command line.
        """
        stop_process(self.process)
        for signum in (signal.SIGTERM, signal.SIGKILL):
            pids = self._pids()
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signum)
            deadline = time.monotonic() + 5.0
            while self._pids() and time.monotonic() < deadline:
                time.sleep(0.1)
        shutil.rmtree(self.temp_dir, ignore_errors=True)

    def kill_node(self, node_id: str) -> int:
        """Kills the raylet of the Ray node ``node_id`` (a node the fake autoscaler started, say)
        as a machine that dies would: its workers end with it and Ray marks the node dead.
        Returns the raylet's pid."""
        flag = f"--node_id={node_id}".encode()
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                command = (entry / "cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if flag in command and command[0].endswith(b"raylet"):
                os.kill(int(entry.name), signal.SIGKILL)
                return int(entry.name)
        raise LookupError(f"no raylet of Ray node {node_id} runs here")

    def _pids(self) -> list[int]:
        """This head's processes: those naming its temp dir, and those given its GCS address
        (Ray's client server names neither its temp dir nor the head's IP as we gave it)."""
        gcs = f":{self.gcs_port}".encode()
        pids = []
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                command = (entry / "cmdline").read_bytes()
            except OSError:
                continue
            given = any(
                arg.startswith(b"--address=") and arg.endswith(gcs) for arg in command.split(b"\0")
            )
            if self.temp_dir.encode() in command or (self.gcs_port and given):
                pids.append(int(entry.name))
        return pids
