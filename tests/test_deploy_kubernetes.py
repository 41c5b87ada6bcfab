"""deploy/kubernetes/: every manifest is valid for Kubernetes KUBERNETES_VERSION against the
schemas kubernetes-validate bundles (strict: an unknown field fails too), and the coordinator
config in the ConfigMap loads into the coordinator's settings."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import time
import tomllib
from pathlib import Path
from typing import Any

import pytest
import yaml
from deploy_tools import DEPLOY, missing

from federation.config import build
from federation.coordinator.config import CoordinatorConfig
from federation.security.pki import init_pki, load_issuer

KUBERNETES_VERSION = "1.30.0"
MANIFESTS = sorted((DEPLOY / "kubernetes").glob("*.yaml"))


def documents() -> list[tuple[Path, dict[str, Any]]]:
    return [(path, doc) for path in MANIFESTS for doc in yaml.safe_load_all(path.read_text())]


@pytest.mark.parametrize(
    "doc", [doc for _, doc in documents()], ids=lambda d: f"{d['kind']}/{d['metadata']['name']}"
)
def test_manifest_is_valid_for_kubernetes(doc: dict[str, Any]) -> None:
    try:
        import kubernetes_validate  # type: ignore[import-untyped]
    except ImportError:
        missing("kubernetes-validate is not installed (pip install -e '.[dev]')")
    kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)


def test_the_coordinator_group() -> None:
    by_kind = {doc["kind"]: doc for _, doc in documents()}
    assert {"StatefulSet", "Service", "ConfigMap", "PodDisruptionBudget"} <= by_kind.keys()
    spec = by_kind["StatefulSet"]["spec"]
    assert spec["replicas"] == 3
    assert by_kind["PodDisruptionBudget"]["spec"]["minAvailable"] == 2
    (container,) = spec["template"]["spec"]["containers"]
    assert container["resources"]["requests"]
    assert {"readinessProbe", "livenessProbe"} <= container.keys()
    secrets = {
        v["secret"]["secretName"] for v in spec["template"]["spec"]["volumes"] if "secret" in v
    }
    assert secrets == {"federation-pki", "federation-etcd-client"}


def test_configmap_config_loads() -> None:
    (config_map,) = (doc for _, doc in documents() if doc["kind"] == "ConfigMap")
    raw = tomllib.loads(config_map["data"]["coordinator.toml"])
    config = build(CoordinatorConfig, raw, source="ConfigMap federation-coordinator")
    assert config.store == "etcd"
    assert len(config.etcd_endpoints) == 3


def test_the_pki_secret_as_documented_signs_site_certificates(tmp_path: Path) -> None:
    """The files the manifest's `kubectl create secret` names, mounted where its ConfigMap says,
    are a PKI the coordinator loads: a missing issuing.pem once crash-looped it."""
    text = (DEPLOY / "kubernetes" / "coordinator.yaml").read_text()
    command = re.search(r"create secret generic federation-pki(.*?)#\s*fedctl", text, re.S)
    assert command is not None
    named = re.findall(r"--from-file=(\S+)", command.group(1))
    made = init_pki(tmp_path / "pki", server_sans=["federation-coordinator"])
    mounted = tmp_path / "etc-federation-pki"
    mounted.mkdir()
    for name in named:
        shutil.copy(made.dir / name, mounted / name)
    (config_map,) = (doc for _, doc in documents() if doc["kind"] == "ConfigMap")
    raw = tomllib.loads(config_map["data"]["coordinator.toml"])
    paths = {k: mounted / Path(raw[k]).name for k in ("ca_cert", "ca_key", "cert", "key")}
    assert all(Path(raw[k]).parent == Path("/etc/federation/pki") for k in paths)
    issuer = load_issuer(paths["ca_cert"], paths["ca_key"], None)
    assert issuer.cert.subject == load_issuer(made.ca_cert, made.ca_key, None).cert.subject


def test_the_pki_secret_as_documented_starts_a_coordinator(tmp_path: Path) -> None:
    """A coordinator started on exactly the Secret's files, with the ConfigMap's settings,
    serves: here on the embedded store (no etcd) and loopback ports, the only changes."""
    text = (DEPLOY / "kubernetes" / "coordinator.yaml").read_text()
    command = re.search(r"create secret generic federation-pki(.*?)#\s*fedctl", text, re.S)
    assert command is not None
    made = init_pki(tmp_path / "pki", server_sans=["federation-coordinator"])
    mounted = tmp_path / "etc-federation-pki"
    mounted.mkdir()
    for name in re.findall(r"--from-file=(\S+)", command.group(1)):
        shutil.copy(made.dir / name, mounted / name)
    (config_map,) = (doc for _, doc in documents() if doc["kind"] == "ConfigMap")
    toml = config_map["data"]["coordinator.toml"].replace("/etc/federation/pki", str(mounted))
    toml = re.sub(r"^(store|etcd_\w+) = .*\n", "", toml, flags=re.M)
    toml = toml.replace("/var/lib/federation", str(tmp_path / "data"))
    for port in ("7070", "7071", "9464"):
        toml = toml.replace(f"0.0.0.0:{port}", "127.0.0.1:0")
    config = tmp_path / "coordinator.toml"
    config.write_text(toml)
    ready = tmp_path / "ready.json"
    argv = [sys.executable, "-m", "federation.coordinator", "--config", str(config)]
    with subprocess.Popen(
        [*argv, "--ready-file", str(ready)], stderr=subprocess.PIPE, text=True
    ) as coordinator:
        try:
            deadline = time.monotonic() + 60
            while not ready.exists() and coordinator.poll() is None:
                assert time.monotonic() < deadline, "the coordinator did not get ready"
                time.sleep(0.1)
            assert ready.exists(), coordinator.stderr.read() if coordinator.stderr else ""
            assert json.loads(ready.read_text())["port"] > 0
        finally:
            coordinator.terminate()
            coordinator.wait(timeout=30)
