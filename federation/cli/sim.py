"""``fedctl sim``: replay a trace over a topology under several placement policies.

``fedctl sim generate`` writes a topology and a trace synthesised from measured public data.
"""

from __future__ import annotations

import argparse
import io
import json
import math
import os
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from federation.cli.connection import CliError
from federation.cli.output import output_of
from federation.cli.render import FedctlConsole
from federation.config import ConfigError
from federation.placement.loading import UnknownPluginError
from federation.placement.registry import build_framework
from federation.sim.engine import SimConfig
from federation.sim.fields import InputFileError
from federation.sim.generate import DATA, Knobs, describe, generate, write_topology
from federation.sim.policies import (
    CONFIGURED,
    DEFAULT_POLICIES,
    PROFILES,
    UnknownPolicyError,
    configured_profile,
    profile,
)
from federation.sim.replay import PolicyProgress, replay
from federation.sim.report import (
    print_tables,
    warnings,
    write_json,
    write_plots,
    write_records,
)
from federation.sim.topology import load_topology
from federation.sim.trace import load_trace, write_trace

WHOLE_WIDTH = 100_000
"""Columns of the console the tables print to when piped: more than any table needs."""

_DEFAULTS = SimConfig()
_KNOBS = Knobs()
KNOB_HELP = {
    "load": "offered load: device-seconds asked for / device-seconds the fleet has",
    "input_share": "share of jobs that read a dataset",
    "datasets": "datasets held at edge and datacenter sites",
    "dataset_gb": "median dataset size in GB (log-normal)",
    "fraction_share": "share of 1-GPU jobs asking for 1/4 or 1/2 of a shareable GPU",
    "cpu_share": "share of jobs with no accelerator",
    "gang_share": "share of 8-GPU jobs that are 2 replicas of 8",
    "priority_share": "share of jobs with priority 100",
    "deadline_share": "share of jobs with a deadline of 2-5x their measured run time",
    "reference_speed": "speed (A100 = 1) of the devices the run times were measured on",
    "max_runtime_h": "cap on sampled run times, hours",
    "edge_decline_rate": "share of offers edge sites decline despite room",
    "edge_scale": "measured bandwidth scale for links touching an edge site",
}


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Register ``fedctl sim`` and ``fedctl sim generate``."""
    policies = "; ".join(f"{name}: {p.summary}" for name, p in PROFILES.items())
    sim = sub.add_parser(
        "sim",
        help="replay a trace over a topology and compare placement policies",
        description=__doc__,
        epilog=f"policies: {policies}",
    )
    sim.add_argument("--topology", type=Path, help="topology file (YAML)")
    sim.add_argument("--trace", type=Path, help="trace file (CSV)")
    sim.add_argument(
        "--policies",
        default=",".join(DEFAULT_POLICIES),
        help="comma-separated policies (default: all)",
    )
    sim.add_argument(
        "--placement-config",
        type=Path,
        metavar="TOML",
        help=f"also replay the placement profile of this coordinator config as policy "
        f"{CONFIGURED!r} (placement_filters and placement_scores, plugins from outside the "
        "project included)",
    )
    sim.add_argument("--seed", type=int, default=0, help="seeds estimate errors and declines")
    sim.add_argument("--plots", type=Path, metavar="DIR", help="write PNG plots here")
    sim.add_argument("--records", type=Path, metavar="CSV", help="write one row per task here")
    sim.add_argument(
        "--estimate-error",
        type=float,
        default=0.0,
        metavar="SIGMA",
        help="log-normal error on the durations the scheduler sees (default 0: exact)",
    )
    sim.add_argument(
        "--learn",
        action="store_true",
        help="learn device speeds from finished tasks and estimate with them, as the "
        "coordinator does (default: the speed table throughout)",
    )
    sim.add_argument(
        "--offers-at-once",
        type=int,
        default=_DEFAULTS.offers_at_once,
        metavar="N",
        help="sites offered at once after the best declined (coordinator default %(default)s)",
    )
    sim.add_argument(
        "--max-offers",
        type=int,
        default=_DEFAULTS.max_offers_per_round,
        metavar="N",
        help="sites tried per round before the task waits (coordinator default %(default)s)",
    )
    sim.set_defaults(func=cmd_sim)
    nested = sim.add_subparsers(dest="sim_command", metavar="generate")
    gen = nested.add_parser(
        "generate",
        help="write a topology and a trace made from measured public data",
        description="Writes DIR/topology.yaml and DIR/trace.csv.",
    )
    gen.add_argument("--out", type=Path, required=True, metavar="DIR", help="output folder")
    gen.add_argument("--seed", type=int, default=0, help="the same seed writes the same files")
    gen.add_argument(
        "--data", type=Path, default=DATA, help="folder of measured data (default: the shipped one)"
    )
    gen.add_argument("--jobs", type=int, default=_KNOBS.jobs, help="jobs in the trace")
    gen.add_argument("--nodes", type=int, default=_KNOBS.nodes, help="machines in the fleet")
    gen.add_argument("--sites", type=int, default=_KNOBS.sites, help="sites they spread over")
    gen.add_argument(
        "--domains",
        default=",".join(f"{d}={s:g}" for d, s in _KNOBS.domains.items()),
        help="share of sites per domain, e.g. edge=0.2,datacenter=0.5,cloud=0.3",
    )
    for name, text in KNOB_HELP.items():
        default = getattr(_KNOBS, name)
        gen.add_argument(
            "--" + name.replace("_", "-"),
            type=type(default),
            default=default,
            metavar="N",
            help=f"{text} (default {default:g})",
        )
    gen.set_defaults(func=cmd_generate)


def _domains(text: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for part in text.split(","):
        name, _, share = part.partition("=")
        try:
            out[name.strip()] = float(share)
        except ValueError:
            raise CliError(f"--domains: expected NAME=SHARE, got {part!r}") from None
    return out


def _at_least(option: str, value: int, minimum: int) -> None:
    if value < minimum:
        raise CliError(f"{option}: must be a whole number >= {minimum}, got {value}")


def _writable(option: str, path: Path, *, folder: bool) -> None:
    """Refuse an output path that could not be written, before any work is done."""
    if folder and path.exists() and not path.is_dir():
        raise CliError(f"{option}: {path} exists and is not a folder")
    if not folder and path.is_dir():
        raise CliError(f"{option}: {path} is a folder; give a file name")
    parent = path.parent
    if not parent.exists():
        raise CliError(f"{option}: cannot write {path}: folder {parent} does not exist")
    if not parent.is_dir():
        raise CliError(f"{option}: cannot write {path}: {parent} is not a folder")
    target = path if path.exists() else parent
    if not os.access(target, os.W_OK | (os.X_OK if target.is_dir() else 0)):
        raise CliError(f"{option}: cannot write {path}: permission denied")


def cmd_generate(args: argparse.Namespace) -> int:
    """Write a generated topology and trace."""
    names = [f.name for f in Knobs.__dataclass_fields__.values() if f.name != "domains"]
    knobs = Knobs(domains=_domains(args.domains), **{n: getattr(args, n) for n in names})
    _at_least("--seed", args.seed, 0)
    try:
        args.out.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise CliError(f"--out: cannot make {args.out}: {err.strerror}") from None
    try:
        topology, tasks = generate(knobs, args.seed, args.data, args.out)
    except (InputFileError, ValueError) as err:
        raise CliError(str(err)) from None
    write_topology(args.out / "topology.yaml", topology)
    write_trace(args.out / "trace.csv", tasks)
    stream = sys.stderr if output_of(args).is_data else sys.stdout
    print(f"wrote {args.out / 'topology.yaml'}: {describe(topology)}", file=stream)
    print(f"wrote {args.out / 'trace.csv'}: {len(tasks)} jobs", file=stream)
    return 0


@contextmanager
def _progress(enabled: bool, policies: list[str]) -> Iterator[PolicyProgress | None]:
    if not enabled:
        yield None
        return
    columns = (
        TextColumn("{task.description:<16}", markup=False),  # policy names are not markup
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
    )
    with Progress(*columns, console=Console(stderr=True), transient=True) as bar:
        ids = {name: bar.add_task(name, total=None) for name in policies}

        def update(policy: str, done: int, total: int) -> None:
            bar.update(ids[policy], completed=done, total=total)

        yield update


def _can_draw() -> bool:
    """Whether matplotlib is installed: the ``sim`` extra, left out of the base install."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def _policies(text: str) -> list[str]:
    """The policies named, each known and named once."""
    policies = [p.strip() for p in text.split(",") if p.strip()]
    if not policies:
        raise CliError(f"--policies: name at least one of {', '.join(PROFILES)}")
    for name in policies:
        try:
            profile(name)
        except UnknownPolicyError as err:
            raise CliError(f"--policies: {err}") from None
    twice = sorted({p for p in policies if policies.count(p) > 1})
    if twice:
        raise CliError(f"--policies: named more than once: {', '.join(twice)}")
    return policies


def cmd_sim(args: argparse.Namespace) -> int:
    """Replay, then print tables or JSON and write plots."""
    if args.topology is None or args.trace is None:
        raise CliError("give --topology and --trace (or run 'fedctl sim generate --out DIR')")
    policies = _policies(args.policies)
    profiles = {}
    if args.placement_config is not None:
        try:
            profiles[CONFIGURED] = configured_profile(args.placement_config)
            build_framework(profiles[CONFIGURED].filters, profiles[CONFIGURED].scorers)
        except (ConfigError, UnknownPluginError, OSError) as err:
            raise CliError(f"--placement-config: {err}") from None
        policies.append(CONFIGURED)
    _at_least("--seed", args.seed, 0)
    _at_least("--offers-at-once", args.offers_at_once, 1)
    _at_least("--max-offers", args.max_offers, 1)
    if not (math.isfinite(args.estimate_error) and args.estimate_error >= 0):
        raise CliError(f"--estimate-error: must be a number >= 0, got {args.estimate_error:g}")
    if args.plots:
        _writable("--plots", args.plots, folder=True)
        if not _can_draw():
            raise CliError(
                "--plots draws with matplotlib, which this install lacks. "
                "To fix: pip install 'fedplane[sim]'"
            )
    if args.records:
        _writable("--records", args.records, folder=False)
        inputs = {args.trace.resolve(), args.topology.resolve()}
        if args.records.resolve() in inputs:
            raise CliError(f"--records: {args.records} is an input file; it would be overwritten")
    out = output_of(args)
    config = SimConfig(
        offers_at_once=args.offers_at_once,
        max_offers_per_round=args.max_offers,
        seed=args.seed,
        learn=args.learn,
    )
    started = time.perf_counter()
    try:
        topology = load_topology(args.topology)
        tasks = load_trace(args.trace)
        with _progress(sys.stderr.isatty(), policies) as progress:
            result = replay(
                topology,
                tasks,
                policies,
                seed=args.seed,
                estimate_error=args.estimate_error,
                config=config,
                trace_source=str(args.trace),
                progress=progress,
                profiles=profiles,
            )
    except (InputFileError, UnknownPolicyError) as err:
        raise CliError(str(err)) from None
    if out.is_data:
        if out.format == "yaml":
            doc = io.StringIO()
            write_json(result, doc)
            out.data(json.loads(doc.getvalue()))
        else:
            write_json(result, sys.stdout)
        for line in warnings(result):
            print(line, file=sys.stderr)
    else:
        # Piped, no line is cut or wrapped: a console wider than any table, which rich does
        # not pad to its width (tables keep their natural width).
        wide = None if sys.stdout.isatty() else WHOLE_WIDTH
        print_tables(result, FedctlConsole(width=wide))
    if args.records:
        write_records(result, args.records)
    if args.plots:
        for path in write_plots(result, args.plots):
            print(f"wrote {path}", file=sys.stderr)
    replays = ", ".join(f"{name} {seconds:.1f}s" for name, seconds in result.wall_s.items())
    total = time.perf_counter() - started
    print(f"replay wall time: {replays}; {total:.1f}s in all", file=sys.stderr)
    return 0
