"""A real single-host Slurm cluster in a folder: munged, slurmctld and slurmd on free ports.

For ``fedctl demo --slurm`` and the Slurm tests. It installs nothing: it needs Debian's
``slurm-wlm`` and ``munge`` and root (slurmd starts jobs as their users). Everything it writes
(configs, munge key and socket, state, spool, logs, fake GPU device files) stays in its folder,
and every Slurm command finds it through ``SLURM_CONF``.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import stat
import subprocess
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import psutil

READY_TIMEOUT_S = 30.0
STOP_TIMEOUT_S = 10.0
MAX_SOCKET_PATH = 100  # sun_path holds 108 bytes
BINARIES = ("munged", "mungekey", "slurmctld", "slurmd", "sbatch", "scontrol", "squeue")


class SlurmClusterError(RuntimeError):
    """The cluster did not come up; the message ends with the daemons' logs."""


@dataclass(frozen=True, slots=True)
class LocalNode:
    """The one node of the cluster: this machine, as Slurm should describe it."""

    name: str = "fed-node-1"
    cpus: int = 8
    memory_mib: int = 16000
    gpus: Mapping[str, int] = field(default_factory=lambda: {"a100": 2})
    """GRES ``gpu`` types and counts; each GPU is a fake character device in the folder."""


def missing_binaries() -> list[str]:
    """The Slurm and munge programs not on PATH (the daemons live in /usr/sbin)."""
    return [name for name in BINARIES if shutil.which(name) is None]


def free_port() -> int:
    """A TCP port free on loopback right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class LocalSlurmCluster:
    """Writes the configs, starts the daemons, waits for the node to be idle, stops them.

    Args:
        root: Folder for everything the cluster writes.
        node: The node to declare (GRES types and counts, CPUs, memory).
        partition: Name of the one (default) partition.
        partition_options: More ``PartitionName`` settings, e.g. ``{"MaxTime": "60"}``.
        conf_lines: More slurm.conf lines.
        cred_expire_s: Lifetime of job credentials, which is also how long Slurm waits before
            it starts a job it requeued again; 0 leaves Slurm's default (120 s).
    """

    def __init__(
        self,
        root: Path,
        *,
        node: LocalNode | None = None,
        partition: str = "gpu",
        partition_options: Mapping[str, str] | None = None,
        conf_lines: tuple[str, ...] = (),
        cred_expire_s: int = 0,
    ) -> None:
        self.root = root
        self.node = node or LocalNode()
        self.partition = partition
        self._partition_options = dict(partition_options or {})
        self._conf_lines = conf_lines
        self._cred_expire_s = cred_expire_s
        self._processes: dict[str, subprocess.Popen[bytes]] = {}
        self.host = socket.gethostname().split(".")[0]

    @property
    def conf(self) -> Path:
        """The slurm.conf every command needs (as SLURM_CONF)."""
        return self.root / "slurm.conf"

    @property
    def env(self) -> dict[str, str]:
        """This process's environment, pointed at the cluster."""
        return {**os.environ, "SLURM_CONF": str(self.conf)}

    def write_config(self) -> None:
        """Writes slurm.conf, gres.conf and cgroup.conf, fake GPU devices and a munge key."""
        for sub in ("state", "spool", "log", "dev", "munge"):
            (self.root / sub).mkdir(parents=True, exist_ok=True)
        gres_lines, devices = [], 0
        for gpu_type, count in self.node.gpus.items():
            first = devices
            for _ in range(count):
                device = self.root / "dev" / f"gpu{devices}"
                if not device.exists():
                    os.mknod(device, stat.S_IFCHR | 0o600, os.makedev(1, 3))  # as /dev/null
                devices += 1
            last = devices - 1
            files = f"{self.root}/dev/gpu" + (f"[{first}-{last}]" if last > first else f"{first}")
            gres_lines.append(f"NodeName={self.node.name} Name=gpu Type={gpu_type} File={files}")
        gres = ",".join(f"gpu:{t}:{n}" for t, n in self.node.gpus.items())
        options = {"Default": "YES", "State": "UP", "DefMemPerCPU": "100"}
        options |= self._partition_options
        partition = " ".join(f"{k}={v}" for k, v in options.items())
        lines = [
            "ClusterName=federation",
            f"SlurmctldHost={self.host}(127.0.0.1)",
            f"SlurmctldPort={free_port()}",
            f"SlurmdPort={free_port()}",
            "SlurmUser=root",
            "SlurmdUser=root",
            "AuthType=auth/munge",
            "CredType=cred/munge",
            f"AuthInfo=socket={self.root}/munge/munge.socket"
            + (f",cred_expire={self._cred_expire_s}" if self._cred_expire_s else ""),
            f"StateSaveLocation={self.root}/state",
            f"SlurmdSpoolDir={self.root}/spool",
            f"SlurmctldPidFile={self.root}/slurmctld.pid",
            f"SlurmdPidFile={self.root}/slurmd.pid",
            f"SlurmctldLogFile={self.root}/log/slurmctld.log",
            f"SlurmdLogFile={self.root}/log/slurmd.log",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_Core_Memory",
            "GresTypes=gpu",
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "JobAcctGatherType=jobacct_gather/none",
            "AccountingStorageType=accounting_storage/none",
            "JobCompType=jobcomp/none",
            "MpiDefault=none",
            "SchedulerType=sched/backfill",
            "SlurmdParameters=config_overrides",
            "ReturnToService=2",
            "KillWait=2",
            "MessageTimeout=5",
            "MailProg=/bin/true",
            *self._conf_lines,
            f"NodeName={self.node.name} NodeHostname={self.host} NodeAddr=127.0.0.1 "
            f"CPUs={self.node.cpus} RealMemory={self.node.memory_mib} Gres={gres} State=UNKNOWN",
            f"PartitionName={self.partition} Nodes={self.node.name} {partition}",
        ]
        self.conf.write_text("\n".join(lines) + "\n")
        (self.root / "gres.conf").write_text("\n".join(gres_lines) + "\n")
        (self.root / "cgroup.conf").write_text("CgroupPlugin=autodetect\n")
        key = self.root / "munge" / "munge.key"
        if not key.exists():
            key.write_bytes(os.urandom(128))
            key.chmod(0o600)

    def start(self) -> None:
        """Starts munged, slurmctld and slurmd, then waits until the node is idle.

        Raises:
            SlurmClusterError: A daemon exited or the node did not become idle in time.
        """
        munge = self.root / "munge"
        if len(str(munge / "munge.socket")) > MAX_SOCKET_PATH:
            raise SlurmClusterError(
                f"{self.root} is too deep for a Unix socket; use a shorter path"
            )
        self.write_config()
        self._spawn(
            "munged",
            [
                "munged",
                "--foreground",
                "--force",
                f"--socket={munge}/munge.socket",
                f"--key-file={munge}/munge.key",
                f"--pid-file={munge}/munged.pid",
                f"--seed-file={munge}/munged.seed",
                f"--log-file={self.root}/log/munged.log",
            ],
        )
        self._wait(lambda: (munge / "munge.socket").exists(), "munged socket")
        self._spawn("slurmctld", ["slurmctld", "-D", "-c"])
        self._spawn("slurmd", ["slurmd", "-D", "-N", self.node.name])
        self._wait(self._node_idle, f"node {self.node.name} idle")

    def _node_idle(self) -> bool:
        result = subprocess.run(
            ["sinfo", "-h", "-n", self.node.name, "-o", "%T"],
            env=self.env,
            capture_output=True,
            text=True,
            timeout=10,
            check=False,
        )
        return result.returncode == 0 and result.stdout.strip() == "idle"

    def _spawn(self, name: str, argv: list[str]) -> None:
        with (self.root / "log" / f"{name}.out").open("ab") as log:
            self._processes[name] = subprocess.Popen(
                argv, env=self.env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )

    def _wait(self, ready: Callable[[], bool], what: str) -> None:
        deadline = time.monotonic() + READY_TIMEOUT_S
        while not ready():
            for name, proc in self._processes.items():
                if proc.poll() is not None:
                    raise SlurmClusterError(f"{name} exited with {proc.returncode}{self._logs()}")
            if time.monotonic() > deadline:
                raise SlurmClusterError(f"no {what} after {READY_TIMEOUT_S:g}s{self._logs()}")
            time.sleep(0.1)

    def _logs(self) -> str:
        tails = []
        for path in sorted((self.root / "log").glob("*")):
            text = path.read_text(errors="replace")[-1500:]
            tails.append(f"\n--- {path.name}\n{text}")
        return "".join(tails)

    def run(self, *argv: str) -> str:
        """Runs a Slurm command against the cluster and returns what it printed.

        Raises:
            SlurmClusterError: The command failed; with Slurm's message.
        """
        result = subprocess.run(
            argv, env=self.env, capture_output=True, text=True, timeout=30, check=False
        )
        if result.returncode != 0:
            raise SlurmClusterError(f"{' '.join(argv)}: {result.stderr.strip()}")
        return result.stdout

    def stop(self) -> None:
        """Kills every job's processes, then stops slurmd, slurmctld, munged (SIGTERM, SIGKILL)."""
        if "slurmctld" in self._processes:
            with contextlib.suppress(subprocess.SubprocessError, OSError):
                subprocess.run(
                    ["scancel", "--full", "--signal=KILL", f"--partition={self.partition}"],
                    env=self.env,
                    capture_output=True,
                    timeout=10,
                    check=False,
                )
        for name in ("slurmd", "slurmctld", "munged"):
            proc = self._processes.pop(name, None)
            if proc is None or proc.poll() is not None:
                continue
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self._kill_job_steps()

    def _kill_job_steps(self) -> None:
        """Kills slurmstepd processes of this cluster left behind (they outlive slurmd)."""
        for proc in psutil.process_iter(["name"]):
            if proc.info["name"] != "slurmstepd":
                continue
            with contextlib.suppress(psutil.Error):
                if proc.environ().get("SLURM_CONF") == str(self.conf):
                    proc.kill()
