"""Config files are checked by type and range, and a refusal names the file and the key path.

The daemons say what is wrong in one line on stderr and exit non-zero, before they write
anything; a metrics port that is taken is refused the same way.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from federation.agent.config import AgentConfig
from federation.agent.main import load_config as load_agent_config
from federation.agent.main import parse_args as parse_agent_args
from federation.agent.state_lock import hold_state_dir
from federation.config import ConfigError
from federation.coordinator.__main__ import load_config, parse_args
from federation.coordinator.config import CoordinatorConfig
from federation.security.pki import init_pki

REPO = Path(__file__).resolve().parent.parent
AGENT = 'site = "s"\ncoordinator = "c:7070"\nca = "ca.pem"\nstate_dir = "state"\n'


def coordinator(path: Path, toml: str) -> CoordinatorConfig:
    path.write_text(toml)
    return load_config(
        parse_args(["--pki-dir", "pki", "--data-dir", "data", "--config", str(path)])
    )


def agent(path: Path, toml: str, *flags: str) -> AgentConfig:
    path.write_text(AGENT + toml)
    return load_agent_config(
        parse_agent_args(["--config", str(path), *flags], "fed-edge-agent", "edge"), "edge"
    )


@pytest.mark.parametrize(
    ("toml", "message"),
    [
        ('offer_timeout_s = "5"', "offer_timeout_s must be a number, not '5'"),
        ("offer_timeout_s = true", "offer_timeout_s must be a number, not True"),
        ("heartbeat_interval_s = -1", "heartbeat_interval_s must be positive, not -1.0"),
        ("missed_heartbeats = 0", "missed_heartbeats must be at least 1, not 0"),
        ("missed_heartbeats = 2.5", "missed_heartbeats must be an integer, not 2.5"),
        ("client_streams = -1", "client_streams must be 0 or more, not -1"),
        ("leader_lease_s = nan", "leader_lease_s must be a finite number, not nan"),
        ("etcd_history_s = inf", "etcd_history_s must be a finite number, not inf"),
        ('metrics_listen = "127.0.0.1:70000"', r"metrics_listen must be host:port with a port in"),
        ('advertise = "coord:0"', r"advertise must be host:port with a port in 1\.\.65535"),
        ('listen = "7070"', "listen must be host:port"),
        ('otlp_endpoint = "127.0.0.1:4317"', r"otlp_endpoint must be http://host:port or https"),
        ('otlp_endpoint = "grpc://c:4317"', r"otlp_endpoint must be http://host:port or https"),
        ('otlp_endpoint = "http://c:0"', r"otlp_endpoint must be http://host:port or https"),
        ('store = "zookeeper"', "store must be one of sqlite, etcd, not 'zookeeper'"),
        ("max_spec_bytes = 10", r"max_spec_bytes must be in 1024\.\.1048576, not 10"),
        ('etcd_endpoints = "e:2379"', "etcd_endpoints must be an array, not 'e:2379'"),
        ("etcd_endpoints = [1]", r"etcd_endpoints\[0\] must be a string, not 1"),
        ("compat_table = 3", "compat_table must be a path, not 3"),
        ("[placement_scores]\nCost = -1", "placement_scores.Cost must be 0 or more, not -1.0"),
        ('[placement_scores]\nCost = "high"', "placement_scores.Cost must be a number"),
        ('listen_adress = "a:1"', "unknown setting listen_adress; known: data_dir"),
    ],
)
def test_bad_coordinator_settings_name_the_key(tmp_path: Path, toml: str, message: str) -> None:
    """A wrong type or a value out of range is refused with the file and the key."""
    path = tmp_path / "coordinator.toml"
    with pytest.raises(ConfigError, match=message) as caught:
        coordinator(path, toml)
    assert str(caught.value).startswith(f"{path}: ")


def test_bad_flags_are_refused_too() -> None:
    """Flags go through the same checks: argparse takes "nan" as a float."""
    args = parse_args(["--pki-dir", "p", "--data-dir", "d", "--heartbeat-interval-s", "nan"])
    with pytest.raises(ConfigError, match="flags: heartbeat_interval_s must be a finite number"):
        load_config(args)


@pytest.mark.parametrize(
    ("toml", "message"),
    [
        ('discover_host = "no"', "discover_host must be true or false, not 'no'"),
        ("discover_host = 0", "discover_host must be true or false, not 0"),
        ('domain = "moon"', "domain must be one of edge, datacenter, cloud, not 'moon'"),
        ("kill_grace_s = -0.5", "kill_grace_s must be 0 or more, not -0.5"),
        ("rediscover_interval_s = 0", "rediscover_interval_s must be positive, not 0.0"),
        ("[datasets]\nimagenet = -5", "datasets.imagenet must be 0 or more, not -5"),
        ("[labels]\nrack = 7", "labels.rack must be a string, not 7"),
        ("[slurm]\npoll_interval_s = -2", "slurm.poll_interval_s must be positive, not -2.0"),
        ("[slurm]\nextra_sbatch_args = ['-x', 3]", r"slurm.extra_sbatch_args\[1\] must be a str"),
        ("[slurm]\npartiton = 'gpu'", "unknown setting slurm.partiton; known: partition"),
        ("[slurm.gres.a100]\nmemory_mib = -1", "slurm.gres.a100.memory_mib must be 0 or more"),
        ("[slurm.gres.a100]\nmemory_mib = '80GB'", "slurm.gres.a100.memory_mib must be an int"),
        ("slurm = 1", "slurm must be a table"),
        ('otlp_endpoint = "collector"', r"otlp_endpoint must be http://host:port or https"),
        ("probe_payload_bytes = 0", r"probe_payload_bytes must be in 1\.\.268435456, not 0"),
    ],
)
def test_bad_agent_settings_name_the_key_path(tmp_path: Path, toml: str, message: str) -> None:
    """Nested tables and arrays are checked too, and the error names the full key path."""
    path = tmp_path / "agent.toml"
    with pytest.raises(ConfigError, match=message) as caught:
        agent(path, toml)
    assert str(caught.value).startswith(f"{path}: ")


def test_relative_paths_lie_beside_the_config_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Paths in the file resolve against its folder, paths in flags against the working
    directory; either way the loaded config holds absolute paths."""
    (tmp_path / "etc").mkdir()
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    config = agent(Path("../etc/agent.toml"), '[slurm]\nconf = "slurm.conf"\n')
    etc = tmp_path / "etc"
    assert (config.state_dir, config.ca, config.slurm.conf) == (
        etc / "state",
        etc / "ca.pem",
        etc / "slurm.conf",
    )
    config = agent(Path("../etc/agent.toml"), "", "--state-dir", "mine")
    assert config.state_dir == tmp_path / "elsewhere" / "mine"


def run(module: str, config: Path) -> subprocess.CompletedProcess[str]:
    """Start a daemon the way its console script does."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run(
        [sys.executable, "-m", module, "--config", str(config)],
        cwd=config.parent,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )


def coordinator_toml(root: Path, extra: str) -> Path:
    path = root / "coordinator.toml"
    path.write_text(
        'data_dir = "data"\nca_cert = "ca.pem"\nca_key = "ca-key.pem"\ncert = "c.pem"\n'
        f'key = "c-key.pem"\n{extra}\n'
    )
    return path


def test_a_refused_config_is_one_line_and_writes_nothing(tmp_path: Path) -> None:
    """The command exits 2 with one line naming the file and key, and no traceback."""
    done = run("federation.coordinator", coordinator_toml(tmp_path, 'offer_timeout_s = "5"'))
    assert done.returncode == 2
    assert done.stderr.splitlines() == [
        f"fed-coordinator: {tmp_path / 'coordinator.toml'}: offer_timeout_s must be a number, "
        "not '5'"
    ]
    assert not (tmp_path / "data").exists()


@pytest.fixture
def taken_port() -> Iterator[int]:
    """A port something else listens on."""
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        yield holder.getsockname()[1]


@pytest.mark.parametrize("module", ["federation.coordinator", "edge_agent"])
def test_a_metrics_port_in_use_is_one_line(tmp_path: Path, taken_port: int, module: str) -> None:
    """A taken metrics port stops the daemon with one line, before it writes anything."""
    listen = f'metrics_listen = "127.0.0.1:{taken_port}"'
    if module == "edge_agent":
        config = tmp_path / "agent.toml"
        config.write_text(f"{AGENT}discover_host = false\n{listen}\n")
        written = tmp_path / "state"
    else:
        config = coordinator_toml(tmp_path, listen)
        written = tmp_path / "data"
    done = run(module, config)
    assert done.returncode == 2, done.stderr
    [line] = done.stderr.splitlines()
    assert f"metrics_listen 127.0.0.1:{taken_port}: cannot listen" in line
    assert not written.exists()


def test_a_held_state_folder_is_named_before_a_taken_metrics_port(
    tmp_path: Path, taken_port: int
) -> None:
    """A second agent on a state folder says so, naming the first, though the first also holds
    the metrics port they were both given."""
    config = tmp_path / "agent.toml"
    config.write_text(f'{AGENT}discover_host = false\nmetrics_listen = "127.0.0.1:{taken_port}"\n')
    with hold_state_dir(tmp_path / "state"):
        done = run("edge_agent", config)
    assert done.returncode == 2, done.stderr
    [line] = done.stderr.splitlines()
    assert line.startswith(
        f"fed-edge-agent: another agent (pid {os.getpid()}) is already running on state folder "
        f"{tmp_path / 'state'}. "
    )


@pytest.mark.parametrize("module", ["federation.coordinator", "edge_agent", "datacenter_agent"])
def test_an_unknown_log_level_is_a_usage_error_not_a_traceback(module: str) -> None:
    run = subprocess.run(
        [sys.executable, "-m", module, "--log-level", "bogus"], capture_output=True, text=True
    )
    assert run.returncode == 2
    assert "argument --log-level: invalid choice: 'bogus'" in run.stderr
    assert "Traceback" not in run.stderr


def test_an_unknown_key_is_named_before_anything_is_missing(tmp_path: Path) -> None:
    """A misspelt key alone in a file is what the error names, not the settings it left out."""
    path = tmp_path / "c.toml"
    path.write_text('pki_dirx = "pki"\n')
    with pytest.raises(ConfigError, match=r"c\.toml: unknown setting pki_dirx; known: .*pki_dir"):
        load_config(parse_args(["--config", str(path)]))


def test_pki_dir_in_the_config_file_names_its_four_files(tmp_path: Path) -> None:
    """As ``--pki-dir`` does; relative to the file's folder."""
    path = tmp_path / "c.toml"
    path.write_text('pki_dir = "pki"\ndata_dir = "data"\n')
    config = load_config(parse_args(["--config", str(path)]))
    assert config.ca_cert == tmp_path / "pki" / "ca.pem"
    assert config.cert.parent == config.key.parent == tmp_path / "pki"
    assert config.data_dir == tmp_path / "data"


def test_a_pki_without_its_issuing_certificate_is_one_line(tmp_path: Path) -> None:
    """The CA key beside the root's certificate but not the issuing CA's: exit 2 saying which
    file is missing, not a traceback (a Secret that left issuing.pem out crash-looped)."""
    made = init_pki(tmp_path / "made", server_sans=["localhost"])
    for name in ("ca.pem", "ca-key.pem", "coordinator.pem", "coordinator-key.pem"):
        shutil.copy(made.dir / name, tmp_path / name)
    config = tmp_path / "coordinator.toml"
    config.write_text(
        'data_dir = "data"\nca_cert = "ca.pem"\nca_key = "ca-key.pem"\n'
        'cert = "coordinator.pem"\nkey = "coordinator-key.pem"\n'
    )
    done = run("federation.coordinator", config)
    assert done.returncode == 2, done.stderr
    [line] = done.stderr.splitlines()
    assert f"there is no {tmp_path / 'issuing.pem'}. To fix: put issuing.pem" in line
    assert not (tmp_path / "data").exists()
