"""``fed-coordinator``: run the federation coordinator."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import gc
import json
import os
import signal
import sys
from pathlib import Path
from typing import Any

import structlog

from federation import __version__, tracing
from federation.config import ConfigError, build, read_toml
from federation.coordinator.config import CoordinatorConfig, check_settings
from federation.coordinator.server import ListenError, start_coordinator
from federation.coordinator.services import placement_framework
from federation.logging import LEVELS, configure_logging
from federation.metrics import serve_metrics
from federation.placement.compat import CompatError
from federation.placement.loading import UnknownPluginError
from federation.security.pki import PkiLayout, load_issuer
from federation.store import StoreError

log = structlog.get_logger()


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="fed-coordinator", description=__doc__)
    p.add_argument("--version", action="version", version=f"fed-coordinator {__version__}")
    p.add_argument("--config", type=Path, help="TOML config file")
    p.add_argument("--pki-dir", type=Path, help="folder made by 'fedctl pki init'")
    p.add_argument("--data-dir", type=Path, help="where the embedded store lives")
    p.add_argument("--listen", help="mTLS address, e.g. 0.0.0.0:7070 (port 0: any free)")
    p.add_argument("--join-listen", help="join (server-TLS only) address")
    p.add_argument("--metrics-listen", help="serve Prometheus /metrics here, e.g. :9464")
    p.add_argument("--otlp-endpoint", help="send spans to this OTLP/gRPC collector, http://h:p")
    p.add_argument("--store", choices=["sqlite", "etcd"], help="default sqlite (embedded)")
    p.add_argument("--etcd-endpoints", help="comma-separated etcd members, host:port")
    p.add_argument("--etcd-prefix", help="key prefix in etcd (default /federation)")
    p.add_argument("--advertise", help="host:port clients and agents dial for --listen")
    p.add_argument("--leader-lease-s", type=float, help="leader lease ttl with etcd (default 3)")
    p.add_argument(
        "--heartbeat-interval-s", type=float, help="agents' heartbeat period (default 3)"
    )
    p.add_argument(
        "--missed-heartbeats",
        type=int,
        help="heartbeats missed before a site is UNREACHABLE (default 3)",
    )
    p.add_argument("--ready-file", type=Path, help="write the bound ports here as JSON")
    p.add_argument("--log-level", default="info", type=str.lower, choices=LEVELS)
    p.add_argument("--log-json", action="store_true", default=None, help="JSON logs")
    return p.parse_args(argv)


def load_config(args: argparse.Namespace) -> CoordinatorConfig:
    values: dict[str, Any] = read_toml(args.config) if args.config else {}
    source = str(args.config) if args.config else "flags"
    known = [f.name for f in dataclasses.fields(CoordinatorConfig)] + ["pki_dir"]
    if unknown := sorted(values.keys() - set(known)):
        # Before anything else: a misspelt key must not surface as some other setting missing.
        raise ConfigError(f"{source}: unknown setting {unknown[0]}; known: {', '.join(known)}")
    folder = args.config.parent if args.config else None  # relative paths: beside the file
    pki_dir = args.pki_dir or values.pop("pki_dir", None)
    if pki_dir:
        layout = PkiLayout(Path(folder or ".", pki_dir) if not args.pki_dir else args.pki_dir)
        values |= {
            "ca_cert": layout.ca_cert,
            "ca_key": layout.ca_key,
            "cert": layout.server_cert,
            "key": layout.server_key,
        }
    overrides = {
        "data_dir": args.data_dir,
        "listen": args.listen,
        "join_listen": args.join_listen,
        "metrics_listen": args.metrics_listen,
        "otlp_endpoint": args.otlp_endpoint,
        "store": args.store,
        "etcd_endpoints": _split(args.etcd_endpoints),
        "etcd_prefix": args.etcd_prefix,
        "advertise": args.advertise,
        "leader_lease_s": args.leader_lease_s,
        "heartbeat_interval_s": args.heartbeat_interval_s,
        "missed_heartbeats": args.missed_heartbeats,
    }
    values |= {k: v for k, v in overrides.items() if v is not None}
    missing = {"data_dir", "ca_cert", "ca_key", "cert", "key"} - values.keys()
    if missing:
        raise ConfigError(
            f"missing settings: {', '.join(sorted(missing))}. To fix: pass --pki-dir and "
            "--data-dir, or set them (pki_dir, or ca_cert, ca_key, cert and key) in --config"
        )
    config = build(CoordinatorConfig, values, source=source, folder=folder)
    check_settings(config, source=source)
    return config


def _split(value: str | None) -> list[str] | None:
    return None if value is None else [v.strip() for v in value.split(",") if v.strip()]


async def serve(config: CoordinatorConfig, ready_file: Path | None) -> None:
    # The metrics port first: when it is taken, nothing (the store above all) is touched yet.
    metrics_port = serve_metrics(config.metrics_listen) if config.metrics_listen else None
    try:  # then the CA, before the store: a PKI missing a file is one line, nothing written
        load_issuer(config.ca_cert, config.ca_key, config.issuing_cert)
    except (OSError, ValueError) as err:
        raise ConfigError(str(err)) from None
    if config.otlp_endpoint:
        tracing.configure(
            config.otlp_endpoint, config.otlp_service, instance=config.advertise or config.listen
        )
    coordinator = await start_coordinator(config)
    ports: dict[str, int | str] = {
        "port": coordinator.port,
        "join_port": coordinator.join_port,
        "advertise": coordinator.me.address,
    }
    if metrics_port is not None:
        ports["metrics_port"] = metrics_port
    if ready_file:
        tmp = ready_file.with_suffix(".tmp")
        tmp.write_text(json.dumps(ports))
        tmp.replace(ready_file)
    # What start-up built (modules, protobuf descriptors, servers, recovered jobs) lives as
    # long as the process: keep it out of the collector's full passes, each of which would
    # otherwise stall the event loop for tens of ms (a p99 latency of its own).
    gc.freeze()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    log.info("coordinator_stopping")
    await coordinator.stop()
    tracing.shutdown()  # sends the spans still buffered


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    os.umask(0o077)  # archives, backups, keys: what the coordinator writes is its own
    configure_logging(json=args.log_json, level=args.log_level)
    try:
        config = load_config(args)
        placement_framework(config)  # a plugin that cannot be loaded or trusted: exit 2
    except (ConfigError, UnknownPluginError, CompatError, OSError) as err:
        print(f"fed-coordinator: {err}", file=sys.stderr)
        sys.exit(2)
    try:
        asyncio.run(serve(config, args.ready_file))
    except (StoreError, ListenError, ConfigError) as err:
        print(f"fed-coordinator: {err}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
