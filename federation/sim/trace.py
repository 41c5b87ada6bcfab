"""Trace files (CSV): one row per job or per task of a job, read into ``TraceTask`` values.

Only ``submit_s`` and ``duration_s`` are required; every other column may be missing or empty
(``COLUMNS`` has their defaults). Errors name the file, the line and the column.
"""

from __future__ import annotations

import csv
import io
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from federation.api.v1 import resources_pb2
from federation.jobspec import parse_domain
from federation.placement.devices import speed_table
from federation.placement.request import Input, Request
from federation.sim.fields import InputFileError, read_text
from federation.sim.topology import KIND_NAMES, KNOWN_MODELS, Topology

REQUIRED = ("submit_s", "duration_s")
# Column -> what it means (docs/simulator.md's table is written from the same facts).
COLUMNS: dict[str, str] = {
    "job_id": "rows sharing an id are the tasks of one job (default: one job per row)",
    "task": "task name within the job (default: main)",
    "submit_s": "seconds from the start of the trace (required)",
    "duration_s": "run time on a device of speed 1.0 (A100-80GB) (required)",
    "replicas": "gang size; each replica on one node, all at one site (default 1)",
    "cpu": "cores per replica (default 1)",
    "memory_mib": "memory per replica (default 1024)",
    "accelerator_count": "whole devices per replica (default 0)",
    "accelerator_fraction": "share of one shareable device per replica, (0, 1] (default 0)",
    "accelerator_kind": "GPU, NPU, MLU, FPGA or DPU (default GPU)",
    "accelerator_models": "acceptable models, |-separated (default: any)",
    "priority": "priority or QoS class, reported per class (default 0)",
    "dataset": "input dataset (default: none)",
    "input_bytes": "bytes read (default: the size its holder declares)",
    "dataset_site": "where the dataset is, when no site of the topology declares it",
    "deadline_s": "seconds after submit by which it should finish (default: none)",
    "workload_class": "row of the speed table: training or inference (default training)",
    "domains": "allowed domains, |-separated: edge, datacenter, cloud (default: any)",
    "max_cost_usd": "budget; sites whose estimated cost is higher are filtered out",
    "tenant": "tenant that submits the job (default: the queue's; none without a queue)",
    "queue": "queue of the topology the job waits in (default: the tenant's only queue)",
    "priority_class": "priority class of the topology; sets the job's priority (default: none)",
    "checkpoint_interval_s": "seconds of run between checkpoints (default 0: none)",
}
SHARING = ("tenant", "queue", "priority_class", "checkpoint_interval_s")
"""Columns about queues and preemption: written only when some task sets them."""


@dataclass(frozen=True, slots=True)
class TraceTask:
    """One task of the trace; ``line`` is its line in the file (for messages)."""

    line: int
    job_id: str
    task: str
    submit_s: float
    duration_s: float
    replicas: int = 1
    cpu: float = 1.0
    memory_mib: float = 1024.0
    accelerator_count: int = 0
    accelerator_fraction: float = 0.0
    accelerator_kind: int = resources_pb2.DEVICE_KIND_GPU
    accelerator_models: frozenset[str] = frozenset()
    priority: int = 0
    dataset: str = ""
    input_bytes: int = 0
    dataset_site: str = ""
    deadline_s: float = 0.0
    workload_class: str = "training"
    domains: frozenset[int] = frozenset()
    max_cost_usd: float = 0.0
    tenant: str = ""
    queue: str = ""
    priority_class: str = ""
    checkpoint_interval_s: float = 0.0
    """Seconds of run between two checkpoints; a preempted task loses the run since its last
    (0: it never checkpoints, so it loses all of it)."""

    def request(self, sequence: int, duration_s: float | None = None) -> Request:
        """The placement request, with the scheduler's view of the duration."""
        wants = self.accelerator_count or self.accelerator_fraction
        inputs = (Input(self.dataset, self.input_bytes, self.dataset_site),) if self.dataset else ()
        return Request(
            replicas=self.replicas,
            cpu=self.cpu,
            memory_mib=self.memory_mib,
            accelerator_kind=self.accelerator_kind if wants else 0,
            accelerator_count=self.accelerator_count,
            accelerator_models=self.accelerator_models,
            accelerator_vendor="",
            accelerator_min_memory_mib=0.0,
            domains=self.domains,
            regions=frozenset(),
            sites=frozenset(),
            node_labels=(),
            fraction=self.accelerator_fraction,
            inputs=inputs,
            duration_s=self.duration_s if duration_s is None else duration_s,
            workload_class=self.workload_class,
            max_cost_usd=self.max_cost_usd,
            deadline_s=self.deadline_s,
            sequence=sequence,
        )


class _Row:
    """One CSV row, read column by column with errors that name the file, line and column."""

    def __init__(self, source: str, line: int, row: dict[str, str]) -> None:
        self.source, self.line, self.row = source, line, row

    def fail(self, column: str, problem: str) -> InputFileError:
        """An error about ``column`` of this row."""
        return InputFileError(f"{self.source}:{self.line}: column {column!r}: {problem}")

    def text(self, column: str, default: str = "") -> str:
        """The cell, stripped; ``default`` when missing or empty."""
        return (self.row.get(column) or "").strip() or default

    def number(
        self, column: str, default: float | None = None, *, upper: float = math.inf
    ) -> float:
        """A finite number in [0, upper]; required unless ``default`` is given."""
        text = self.text(column)
        if not text:
            if default is None:
                raise self.fail(column, "is required")
            return default
        try:
            value = float(text)
        except ValueError:
            raise self.fail(column, f"not a number: {text!r}") from None
        if not math.isfinite(value) or value < 0 or value > upper:
            bound = f"between 0 and {upper:g}" if math.isfinite(upper) else ">= 0"
            raise self.fail(column, f"must be {bound}, got {text!r}")
        return value

    def integer(self, column: str, default: int, *, minimum: int = 0, signed: bool = False) -> int:
        """A whole number (>= minimum unless ``signed``); ``default`` when empty."""
        text = self.text(column)
        if not text:
            return default
        try:
            value = float(text)
        except ValueError:
            raise self.fail(column, f"not a whole number: {text!r}") from None
        if not value.is_integer() or (value < minimum and not signed):
            raise self.fail(column, f"must be a whole number >= {minimum}, got {text!r}")
        return int(value)

    def names(self, column: str) -> frozenset[str]:
        """A ``|``-separated list."""
        return frozenset(p.strip() for p in self.text(column).split("|") if p.strip())


def load_trace(path: Path) -> list[TraceTask]:
    """Read and check a trace file; tasks come back in submit order."""
    reader = csv.DictReader(io.StringIO(read_text(path), newline=""))
    header = [h.strip() for h in reader.fieldnames or []]
    reader.fieldnames = header
    _check_header(str(path), header)
    rows = [_task(_Row(str(path), n, row)) for n, row in enumerate(reader, start=2)]
    if not rows:
        raise InputFileError(f"{path}: no rows")
    seen: dict[tuple[str, str], int] = {}
    first: dict[str, TraceTask] = {}
    for t in rows:
        key = (t.job_id, t.task)
        if key in seen:
            raise InputFileError(
                f"{path}:{t.line}: task {t.task!r} of job {t.job_id!r} repeats line {seen[key]}"
            )
        seen[key] = t.line
        # Queues and classes belong to the job, as in a job spec: its rows must agree.
        job = first.setdefault(t.job_id, t)
        for column in ("tenant", "queue", "priority_class"):
            if getattr(t, column) != getattr(job, column):
                raise InputFileError(
                    f"{path}:{t.line}: column {column!r}: {getattr(t, column)!r}, but job "
                    f"{t.job_id!r} has {getattr(job, column)!r} on line {job.line}"
                )
    return sorted(rows, key=lambda t: (t.submit_s, t.line))


def _check_header(source: str, header: Sequence[str]) -> None:
    missing = [c for c in REQUIRED if c not in header]
    if missing:
        raise InputFileError(f"{source}:1: missing column(s) {', '.join(missing)}")
    unknown = [c for c in header if c not in COLUMNS]
    if unknown:
        raise InputFileError(
            f"{source}:1: unknown column(s) {', '.join(unknown)} (known: {', '.join(COLUMNS)})"
        )


def _task(r: _Row) -> TraceTask:
    count = r.integer("accelerator_count", 0)
    fraction = r.number("accelerator_fraction", 0.0, upper=1.0)
    if count and fraction:
        raise r.fail("accelerator_fraction", "give accelerator_count or a fraction, not both")
    kind = r.text("accelerator_kind", "GPU").upper()
    if "DEVICE_KIND_" + kind not in KIND_NAMES:
        raise r.fail("accelerator_kind", f"unknown kind {kind!r} (GPU, NPU, MLU, FPGA, DPU)")
    workload_class = r.text("workload_class", "training")
    if workload_class not in speed_table():
        classes = ", ".join(sorted(speed_table()))
        raise r.fail("workload_class", f"unknown class {workload_class!r} ({classes})")
    domains: set[int] = set()
    for name in r.names("domains"):
        try:
            domains.add(parse_domain(name))
        except ValueError as err:
            raise r.fail("domains", str(err)) from None
    return TraceTask(
        line=r.line,
        job_id=r.text("job_id", f"job-{r.line - 1}"),
        task=r.text("task", "main"),
        submit_s=r.number("submit_s"),
        duration_s=r.number("duration_s"),
        replicas=r.integer("replicas", 1, minimum=1),
        cpu=r.number("cpu", 1.0),
        memory_mib=r.number("memory_mib", 1024.0),
        accelerator_count=count,
        accelerator_fraction=fraction,
        accelerator_kind=resources_pb2.DeviceKind.Value("DEVICE_KIND_" + kind),
        accelerator_models=r.names("accelerator_models"),
        priority=r.integer("priority", 0, signed=True),
        dataset=r.text("dataset"),
        input_bytes=r.integer("input_bytes", 0),
        dataset_site=r.text("dataset_site"),
        deadline_s=r.number("deadline_s", 0.0),
        workload_class=workload_class,
        domains=frozenset(domains),
        max_cost_usd=r.number("max_cost_usd", 0.0),
        tenant=r.text("tenant"),
        queue=r.text("queue"),
        priority_class=r.text("priority_class"),
        checkpoint_interval_s=r.number("checkpoint_interval_s", 0.0),
    )


def check_against(tasks: Iterable[TraceTask], topology: Topology, source: str) -> None:
    """Refuse inputs nobody holds, sites the topology lacks, and device models no site has
    (a task asking only for those would never run), naming the line."""
    names = {s.name for s in topology.sites}
    held = {d for s in topology.sites for d in (s.datasets or {})}
    models = topology.models
    for t in tasks:
        where = f"{source}:{t.line}"
        if t.accelerator_models and not t.accelerator_models & models:
            raise InputFileError(
                f"{where}: column 'accelerator_models': no site has "
                f"{_listing(t.accelerator_models)} (models in the topology: {_listing(models)})"
            )
        typos = sorted(t.accelerator_models - models - set(KNOWN_MODELS))
        if typos:
            raise InputFileError(
                f"{where}: column 'accelerator_models': {_listing(typos)}: not a known model "
                f"and no site has it (models in the topology: {_listing(models)})"
            )
        if t.dataset_site and t.dataset_site not in names:
            raise InputFileError(f"{where}: column 'dataset_site': unknown site {t.dataset_site!r}")
        if t.dataset and not t.dataset_site and t.dataset not in held:
            raise InputFileError(
                f"{where}: column 'dataset': no site holds {t.dataset!r}; declare it under a "
                "site's datasets in the topology, or give dataset_site and input_bytes"
            )
        if t.dataset_site and not t.input_bytes:
            site = next(s for s in topology.sites if s.name == t.dataset_site)
            if t.dataset not in (site.datasets or {}):
                raise InputFileError(f"{where}: column 'input_bytes': needed with dataset_site")


def _listing(names: Iterable[str]) -> str:
    return ", ".join(sorted(names)) or "none"


def write_trace(path: Path, tasks: Iterable[TraceTask]) -> None:
    """Write tasks in the trace format (the generator's output)."""
    kind_names = {
        int(v): k.removeprefix("DEVICE_KIND_") for k, v in resources_pb2.DeviceKind.items()
    }
    domain_names = {
        int(v): k.removeprefix("DOMAIN_").lower() for k, v in resources_pb2.Domain.items()
    }
    tasks = list(tasks)
    used = {c for c in SHARING for t in tasks if getattr(t, c)}
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=[c for c in COLUMNS if c not in SHARING or c in used])
        writer.writeheader()
        for t in tasks:
            sharing = {c: getattr(t, c) or "" for c in used}
            writer.writerow(
                {
                    "job_id": t.job_id,
                    "task": t.task,
                    "submit_s": f"{t.submit_s:.3f}",
                    "duration_s": f"{t.duration_s:.3f}",
                    "replicas": t.replicas,
                    "cpu": f"{t.cpu:g}",
                    "memory_mib": f"{t.memory_mib:g}",
                    "accelerator_count": t.accelerator_count,
                    "accelerator_fraction": f"{t.accelerator_fraction:g}",
                    "accelerator_kind": kind_names[t.accelerator_kind],
                    "accelerator_models": "|".join(sorted(t.accelerator_models)),
                    "priority": t.priority,
                    "dataset": t.dataset,
                    "input_bytes": t.input_bytes or "",
                    "dataset_site": t.dataset_site,
                    "deadline_s": f"{t.deadline_s:.3f}" if t.deadline_s else "",
                    "workload_class": t.workload_class,
                    "domains": "|".join(sorted(domain_names[d] for d in t.domains)),
                    "max_cost_usd": f"{t.max_cost_usd:g}" if t.max_cost_usd else "",
                    **sharing,
                }
            )
