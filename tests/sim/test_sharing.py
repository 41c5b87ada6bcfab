"""Queues, quotas, fair share and preemption in the replay, on cases small enough to work out
by hand. A100-80GB runs at speed 1.0, so a task's run time is its duration."""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest

from federation.coordinator.policy import sharing
from federation.sim.fields import InputFileError
from federation.sim.queues import jain_index
from federation.sim.replay import ReplayResult, replay
from federation.sim.runs import TaskRun
from federation.sim.topology import load_topology
from federation.sim.trace import TraceTask, load_trace, write_trace

from .conftest import write
from .test_input_checks import fedctl, refused

SITE = (
    "sites: [{name: dc, nodes: [{cpu: 64, memory_mib: 262144,"
    " devices: [{model: A100-80GB, count: %d}]}]}]\n"
)
"""One site, one node with the given number of GPUs (``SITE % 6``)."""
WEIGHTS_1_2 = """queues:
  - {name: a, tenant: team-a, weight: 1}
  - {name: b, tenant: team-b, weight: 2}
"""
URGENT = "priority_classes: {urgent: {value: 900, may_preempt: true}, batch: {value: -100}}\n"


def run(
    folder: Path, topology: str, rows: Iterable[str], header: str, policy: str = "greedy"
) -> ReplayResult:
    """Replay ``rows`` (CSV under ``header``) over ``topology`` under ``policy``."""
    topo = load_topology(write(folder, "t.yaml", topology))
    trace = write(folder, "trace.csv", "\n".join([header, *rows]) + "\n")
    return replay(topo, load_trace(trace), [policy])


def tenants(result: ReplayResult, policy: str = "greedy") -> dict[str, Any]:
    """The per-tenant figures of ``policy`` (JSON `sharing`)."""
    figures: dict[str, Any] = result.summary["policies"][policy]["sharing"]
    return figures


def runs(result: ReplayResult, prefix: str, policy: str = "greedy") -> list[TaskRun]:
    return [r for r in result.outcomes[policy].tasks if r.trace.job_id.startswith(prefix)]


def most_at_once(tasks: list[TaskRun]) -> int:
    """The most of ``tasks`` placed at one time (by their last placement)."""
    edges = sorted(
        itertools.chain.from_iterable(((r.placed_s, 1), (r.finished_s, -1)) for r in tasks),
        key=lambda e: (e[0], e[1]),  # an end frees before a start takes
    )
    return max(itertools.accumulate(step for _, step in edges))


def flood(tenant: str, jobs: int, duration_s: float = 100.0, submit_s: float = 0.0) -> list[str]:
    """``jobs`` one-GPU jobs of ``tenant``, named after it."""
    return [f"{tenant}-{n:02d},{submit_s},{duration_s},1,{tenant}" for n in range(jobs)]


HEADER = "job_id,submit_s,duration_s,accelerator_count,tenant"


def test_two_tenants_share_the_gpus_by_their_weights(tmp_path: Path) -> None:
    """Weights 1:2 over 6 GPUs: while both wait, team-a holds 2 and team-b 4 (dominant
    shares 1/3 and 2/3), though every job of team-a is ahead of team-b's in submission
    order; so their shares over their weights are equal, and Jain's index is 1."""
    rows = flood("team-a", 30) + flood("team-b", 30)
    result = run(tmp_path, SITE % 6 + WEIGHTS_1_2, rows, HEADER)
    figures = tenants(result)
    assert figures["contended_hours"] > 0
    shares = {name: t["mean_share"] for name, t in figures["tenants"].items()}
    assert shares == pytest.approx({"team-a": 1 / 3, "team-b": 2 / 3})
    assert figures["jain_index"] == pytest.approx(1.0)
    assert [t["weight"] for t in figures["tenants"].values()] == [1.0, 2.0]
    assert all(t["jobs_completed"] == 30 for t in figures["tenants"].values())


def test_without_fair_order_the_first_tenant_takes_everything(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The replay's order is the coordinator's fair order: replaced by the plain line, the
    same case gives team-a every GPU while both wait (so the test above can fail)."""

    def in_line(lines: Mapping[str, Iterable[Any]], share: object) -> Iterator[Any]:
        return itertools.chain.from_iterable(lines.values())

    monkeypatch.setattr(sharing, "fair_order", in_line)
    rows = flood("team-a", 30) + flood("team-b", 30)
    result = run(tmp_path, SITE % 6 + WEIGHTS_1_2, rows, HEADER)
    shares = {name: t["mean_share"] for name, t in tenants(result)["tenants"].items()}
    assert shares == pytest.approx({"team-a": 1.0, "team-b": 0.0})
    assert tenants(result)["jain_index"] == pytest.approx(0.5)


def test_jain_index_by_hand() -> None:
    """(sum x)^2 / (n sum x^2)."""
    assert jain_index([0.5, 0.5]) == 1.0
    assert jain_index([1.0, 0.0]) == 0.5
    assert jain_index([1, 2, 3, 4]) == pytest.approx(100 / 120)
    assert jain_index([0.0, 0.0]) is None
    assert jain_index([]) is None


def test_jain_index_of_a_replay_by_hand(tmp_path: Path) -> None:
    """Equal weights, but team-a's quota holds it to 2 of the 6 GPUs: shares 1/3 and 2/3, so
    Jain's index is 1 / (2 * (1/9 + 4/9)) = 0.9."""
    queues = """queues:
  - {name: a, tenant: team-a, quotas: [{resource: gpu, nominal: 2}]}
  - {name: b, tenant: team-b}
"""
    result = run(tmp_path, SITE % 6 + queues, flood("team-a", 20) + flood("team-b", 20), HEADER)
    figures = tenants(result)
    shares = [t["mean_share"] for t in figures["tenants"].values()]
    assert shares == pytest.approx([1 / 3, 2 / 3])
    assert figures["jain_index"] == pytest.approx(0.9)


@pytest.mark.parametrize(("borrowing", "most"), [(0, 2), (2, 4), (8, 6)])
def test_a_quota_holds_and_borrowing_stops_at_what_the_cohort_has(
    tmp_path: Path, borrowing: int, most: int
) -> None:
    """team-a's nominal quota is 2 GPUs; it may borrow up to ``borrowing`` more while team-b
    (nominal 4) leaves its own idle, never past the 6 the two have together."""
    quota = f"{{resource: gpu, nominal: 2, borrowing_limit: {borrowing}}}"
    queues = f"""queues:
  - {{name: a, tenant: team-a, quotas: [{quota}]}}
  - {{name: b, tenant: team-b, quotas: [{{resource: gpu, nominal: 4}}]}}
"""
    result = run(tmp_path, SITE % 8 + queues, flood("team-a", 12), HEADER)
    assert most_at_once(runs(result, "team-a")) == most
    assert tenants(result)["tenants"]["team-a"]["jobs_completed"] == 12


def test_a_queue_within_its_nominal_quota_takes_back_what_another_borrowed(
    tmp_path: Path,
) -> None:
    """team-a borrows all 6 GPUs while team-b is idle; team-b's jobs arrive at t=150 (after
    the minimum run of 120 s for borrowed quota) and each stops one of team-a's to get its
    nominal 4 at once. Arriving at t=100, they wait for that minimum: they start at 120."""
    queues = """queues:
  - {name: a, tenant: team-a, quotas: [{resource: gpu, nominal: 2, borrowing_limit: 4}]}
  - {name: b, tenant: team-b, quotas: [{resource: gpu, nominal: 4}]}
"""
    rows = flood("team-a", 6, duration_s=1000) + flood("team-b", 4, submit_s=150)
    result = run(tmp_path, SITE % 6 + queues, rows, HEADER)
    assert [r.started_s for r in runs(result, "team-b")] == [150.0] * 4
    figures = tenants(result)["tenants"]
    assert figures["team-a"]["preemptions"] == 4
    assert figures["team-b"]["preemptions"] == 0
    # Without checkpoints the 4 stopped tasks lose their 150 s of run each.
    assert figures["team-a"]["device_hours_lost"] == pytest.approx(4 * 150 / 3600)
    rows = flood("team-a", 6, duration_s=1000) + flood("team-b", 4, submit_s=100)
    result = run(tmp_path, SITE % 6 + queues, rows, HEADER)
    assert [r.started_s for r in runs(result, "team-b")] == [120.0] * 4
    assert tenants(result)["tenants"]["team-a"]["preemptions"] == 4


def test_nominal_quotas_together_are_never_exceeded_where_gpus_are_left_over(
    tmp_path: Path,
) -> None:
    """8 GPUs, nominal quotas of 2 and 4. team-a borrows 2 while team-b is idle; team-b's 4
    arrive at t=150: 2 start at once on the idle GPUs, and 2 of team-a's are taken back for
    the other 2, though 2 GPUs are free: the two queues never hold more than their 6."""
    queues = """queues:
  - {name: a, tenant: team-a, quotas: [{resource: gpu, nominal: 2, borrowing_limit: 2}]}
  - {name: b, tenant: team-b, quotas: [{resource: gpu, nominal: 4}]}
"""
    rows = flood("team-a", 4, duration_s=1000) + flood("team-b", 4, submit_s=150)
    result = run(tmp_path, SITE % 8 + queues, rows, HEADER)
    assert most_at_once(runs(result, "team-")) == 6
    assert [r.started_s for r in runs(result, "team-b")] == [150.0] * 4
    figures = tenants(result)["tenants"]
    assert figures["team-a"]["preemptions"] == 2
    assert figures["team-b"]["preemptions"] == 0


def test_borrowed_quota_is_not_taken_back_from_a_task_still_moving_its_input(
    tmp_path: Path,
) -> None:
    """team-a borrows 4 GPUs for tasks whose input takes 200 s to arrive; team-b's arrive at
    150. A task placed but not started has run nothing: it is taken back once it has run the
    120 s minimum (at 320), not at once while its input still moves."""
    topology = """links: {default: {bandwidth_mbps: 8000, rtt_ms: 0}}
sites:
  - {name: dc, nodes: [{cpu: 64, memory_mib: 262144, devices: [{model: A100-80GB, count: 6}]}]}
  - {name: store, nodes: [{cpu: 4, memory_mib: 8192}], datasets: {corpus: 200000000000}}
queues:
  - {name: a, tenant: team-a, quotas: [{resource: gpu, nominal: 2, borrowing_limit: 4}]}
  - {name: b, tenant: team-b, quotas: [{resource: gpu, nominal: 4}]}
"""
    rows = [f"{row},corpus" for row in flood("team-a", 6, duration_s=1000)]
    rows += [f"{row}," for row in flood("team-b", 4, submit_s=150)]
    result = run(tmp_path, topology, rows, f"{HEADER},dataset")
    assert {r.started_s for r in runs(result, "team-a")} == {200.0, 620.0}
    assert [r.started_s for r in runs(result, "team-b")] == [320.0] * 4
    assert tenants(result)["tenants"]["team-a"]["preemptions"] == 4


URGENT_HEADER = "job_id,submit_s,duration_s,accelerator_count,priority_class,checkpoint_interval_s"


@pytest.mark.parametrize(
    ("checkpoint", "lost_s", "low_ends"),
    [
        # Checkpoints at 100, 200: stopped at 250 it loses 50 s, and restarts at 350 with
        # 1000 - 200 = 800 s to go.
        ("100", 50.0, 1150.0),
        # No checkpoints: it loses all 250 s and starts over.
        ("", 250.0, 1350.0),
    ],
)
def test_an_urgent_job_preempts_and_its_victim_restarts_from_its_checkpoint(
    tmp_path: Path, checkpoint: str, lost_s: float, low_ends: float
) -> None:
    """One GPU. A low-priority job runs from 0 for 1000 s; an urgent job (a class that may
    preempt, named by an operator) arrives at 250 and runs 250-350 in its place."""
    rows = [f"low,0,1000,1,batch,{checkpoint}", "urgent,250,100,1,urgent,"]
    result = run(tmp_path, SITE % 1 + URGENT, rows, URGENT_HEADER)
    low, urgent = runs(result, "low")[0], runs(result, "urgent")[0]
    assert (urgent.started_s, urgent.finished_s) == (250.0, 350.0)
    assert (low.started_s, low.finished_s) == (350.0, low_ends)  # its last start
    assert low.preemptions == 1
    assert low.lost_device_s == pytest.approx(lost_s)
    figures = tenants(result)["tenants"]["(no queue)"]
    assert figures["preemptions"] == 1
    assert figures["device_hours_lost"] == pytest.approx(lost_s / 3600)


def test_tasks_are_preempted_only_once_they_ran_the_minimum(tmp_path: Path) -> None:
    """The urgent job arrives 30 s into the low one: it waits until the low one has run
    60 s, then stops it (which loses those 60 s and restarts at 160)."""
    rows = ["low,0,1000,1,batch,", "urgent,30,100,1,urgent,"]
    result = run(tmp_path, SITE % 1 + URGENT, rows, URGENT_HEADER)
    low, urgent = runs(result, "low")[0], runs(result, "urgent")[0]
    assert (urgent.started_s, low.started_s, low.finished_s) == (60.0, 160.0, 1160.0)
    assert low.lost_device_s == 60.0


@pytest.mark.parametrize("models", ["", "A100-80GB|H100-80GB"])
def test_a_victim_counts_the_devices_it_was_given_whatever_its_row_names(
    tmp_path: Path, models: str
) -> None:
    """The low job accepts any model, or two: on the one A100 it counts an A100, so an urgent
    job that wants an A100 stops it (it waited for its end before)."""
    header = f"{URGENT_HEADER},accelerator_models"
    rows = [f"low,0,1000,1,batch,,{models}", "urgent,250,100,1,urgent,,A100-80GB"]
    result = run(tmp_path, SITE % 1 + URGENT, rows, header)
    assert runs(result, "urgent")[0].started_s == 250.0
    assert runs(result, "low")[0].preemptions == 1


def test_only_lower_priority_preemptible_work_is_stopped(tmp_path: Path) -> None:
    """A class that is not preemptible, or of equal priority, keeps its GPU."""
    classes = (
        "priority_classes: {urgent: {value: 900, may_preempt: true},"
        " vital: {value: 0, preemptible: false}, peer: {value: 900}}\n"
    )
    for victim in ("vital", "peer"):
        rows = [f"low,0,1000,1,{victim},", "urgent,250,100,1,urgent,"]
        result = run(tmp_path, SITE % 1 + classes, rows, URGENT_HEADER)
        assert runs(result, "urgent")[0].started_s == 1000.0, victim


def test_without_queues_or_classes_the_figures_are_as_before(tmp_path: Path) -> None:
    """No ``sharing`` figures, and the new columns may be left out or empty."""
    result = run(tmp_path, SITE % 1, ["j,0,10,1,"], HEADER)
    assert "sharing" not in result.summary["policies"]["greedy"]
    assert result.summary["policies"]["greedy"]["jobs_completed"] == 1


def test_written_traces_carry_the_new_columns_only_when_used(tmp_path: Path) -> None:
    plain = TraceTask(line=2, job_id="j", task="main", submit_s=0.0, duration_s=1.0)
    write_trace(tmp_path / "plain.csv", [plain])
    assert "tenant" not in (tmp_path / "plain.csv").read_text().splitlines()[0]
    queued = TraceTask(
        line=2, job_id="j", task="main", submit_s=0.0, duration_s=1.0, tenant="t", queue="q"
    )
    write_trace(tmp_path / "queued.csv", [queued])
    (back,) = load_trace(tmp_path / "queued.csv")
    assert (back.tenant, back.queue, back.priority_class) == ("t", "q", "")


# Bad input: one line naming the file, the line and the column (or the field).

QUEUES = """queues:
  - {name: a, tenant: team-a}
  - {name: b, tenant: team-b}
  - {name: b2, tenant: team-b}
priority_classes: {urgent: {value: 900, may_preempt: true, tenants: [team-b]}, batch: {value: -100}}
"""


@pytest.mark.parametrize(
    ("header", "row", "message"),
    [
        ("queue", "x", "column 'queue': unknown queue 'x' (queues in the topology: a, b, b2)"),
        ("tenant,queue", "team-b,a", "column 'queue': tenant team-b has no queue 'a'."),
        ("tenant", "team-c", "column 'queue': needed: tenant 'team-c' owns no queue"),
        ("tenant", "team-b", "column 'queue': needed: tenant 'team-b' owns b, b2"),
        (
            "queue,priority_class",
            "a,rush",
            "column 'priority_class': unknown priority class 'rush' (batch, urgent)",
        ),
        # A class that may preempt is only for the tenants it names (and operators).
        (
            "queue,priority_class",
            "a,urgent",
            "column 'priority_class': unknown priority class 'urgent' (batch, urgent)",
        ),
        (
            "queue,priority_class,priority",
            "a,batch,-5",
            "column 'priority': is -5 but class batch sets -100; give one or the other",
        ),
        ("queue,priority", "a,100", "column 'priority': is 100; a tenant may only lower"),
    ],
)
def test_bad_tenants_queues_and_classes_are_refused_by_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], header: str, row: str, message: str
) -> None:
    topology = write(tmp_path, "t.yaml", SITE % 1 + QUEUES)
    trace = write(tmp_path, "trace.csv", f"submit_s,duration_s,{header}\n0,1,\n0,1,{row}\n")
    argv = ["sim", "--topology", topology, "--trace", trace, "--policies", "greedy"]
    line = refused(capsys, argv)
    assert line.startswith(f"fedctl: {trace}:3: {message}"), line


def test_an_operator_may_name_any_class(tmp_path: Path) -> None:
    topology = write(tmp_path, "t.yaml", SITE % 1 + QUEUES)
    trace = write(tmp_path, "trace.csv", "submit_s,duration_s,priority_class\n0,1,urgent\n")
    argv = ["sim", "--topology", topology, "--trace", trace, "--policies", "greedy"]
    assert fedctl(*argv) == 0


def test_queue_columns_need_queues_in_the_topology(tmp_path: Path) -> None:
    topo = load_topology(write(tmp_path, "t.yaml", SITE % 1))
    trace = write(tmp_path, "trace.csv", "submit_s,duration_s,queue\n0,1,a\n")
    with pytest.raises(InputFileError) as err:
        replay(topo, load_trace(trace), ["greedy"], trace_source="trace.csv")
    assert str(err.value) == (
        "trace.csv:2: column 'queue': unknown queue 'a' (queues in the topology: none)"
    )


@pytest.mark.parametrize(
    ("rows", "message"),
    [
        (
            "job_id,task,submit_s,duration_s,queue\nj,x,0,1,a\nj,y,0,1,b\n",
            "trace.csv:3: column 'queue': 'b', but job 'j' has 'a' on line 2",
        ),
        (
            "submit_s,duration_s,checkpoint_interval_s\n0,1,-5\n",
            "trace.csv:2: column 'checkpoint_interval_s': must be >= 0, got '-5'",
        ),
    ],
)
def test_bad_rows_are_refused_when_read(tmp_path: Path, rows: str, message: str) -> None:
    path = write(tmp_path, "trace.csv", rows)
    with pytest.raises(InputFileError) as err:
        load_trace(path)
    assert str(err.value) == f"{tmp_path}/{message}"


@pytest.mark.parametrize(
    ("topology", "message"),
    [
        (
            "queues: [{name: a, tenant: t, quotas: [{resource: gpus, nominal: 1}]}]",
            "queues[0].quotas[0].resource: unknown resource 'gpus'",
        ),
        (
            "queues: [{name: a, tenant: t, quotas: [{resource: gpu/A100-80GB, nominal: 1}]}]",
            "queues[0].quotas[0].resource: gpu/A100-80GB: quotas of one model are not simulated",
        ),
        ("queues: [{name: a}]", "queues[0].tenant: is required: the tenant that owns it"),
        ("queues: [{name: a, tenant: t, parent: p}]", "queues[0].parent: no queue 'p'"),
        (
            "queues: [{name: a, tenant: t, parent: b}, {name: b, tenant: t, parent: a}]",
            "queues[0].parent: makes a cycle: a -> b -> a",
        ),
        ("queues: [{name: a, tenant: t}, {name: a, tenant: u}]", "queues: duplicate queue name"),
        ("queues: [{name: A, tenant: t}]", "queues[0].name: 'A' is not a valid name"),
        ("queues: [{name: a, tenant: t, weight: -1}]", "queues[0].weight: must be >= 0"),
        ("queues: [{name: a, tenant: t, size: 1}]", "queues[0]: unknown field(s) size"),
        (
            "priority_classes: {urgent: {value: high}}",
            "priority_classes.urgent.value must be an integer",
        ),
        ("priority_classes: [urgent]", "priority_classes: expected a mapping"),
    ],
)
def test_bad_queues_and_classes_are_refused_naming_the_field(
    tmp_path: Path, topology: str, message: str
) -> None:
    path = write(tmp_path, "t.yaml", SITE % 1 + topology + "\n")
    with pytest.raises(InputFileError) as err:
        load_topology(path)
    assert str(err.value).startswith(f"{path}: {message}"), str(err.value)


EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "sim"


def test_the_example_replays_and_prints_the_tenants_table(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """The README's example: shares follow the weights 1:2 while both tenants wait, batch
    work is preempted, and the operators' urgent jobs run at once."""
    argv = [
        "sim",
        "--topology",
        EXAMPLES / "sharing-topology.yaml",
        "--trace",
        EXAMPLES / "sharing-trace.csv",
        "--policies",
        "completion-time",
    ]
    assert fedctl(*argv) == 0
    out = capsys.readouterr().out
    assert "Tenants (shares while every tenant has a task waiting" in out
    topology = load_topology(EXAMPLES / "sharing-topology.yaml")
    result = replay(topology, load_trace(EXAMPLES / "sharing-trace.csv"), ["completion-time"])
    figures = tenants(result, "completion-time")
    shares = {name: t["mean_share"] for name, t in figures["tenants"].items()}
    assert shares["product"] / shares["research"] == pytest.approx(2.0, rel=0.02)
    assert figures["jain_index"] > 0.999
    assert figures["tenants"]["research"]["preemptions"] > 0
    assert figures["tenants"]["(no queue)"]["jct_s"]["p99"] == 1200.0
