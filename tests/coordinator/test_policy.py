"""The sharing rules as pure functions: demand, admission with borrowing and hierarchy, fair
order by weighted dominant share, priority classes and queue checks."""

from __future__ import annotations

import math

import pytest
from prometheus_client import REGISTRY

from federation.api.v1 import jobs_pb2, queues_pb2, resources_pb2
from federation.config import ConfigError
from federation.coordinator.policy.fair_share import dominant_share, fair_order
from federation.coordinator.policy.preemption import Candidate, choose_victims, ready_s
from federation.coordinator.policy.priority import PriorityClass, parse_priority_classes
from federation.coordinator.policy.queues import QueueBook, queue_violations
from federation.coordinator.policy.quota import Debt, admission, owed
from federation.coordinator.policy.resources import demand
from federation.coordinator.policy.sharing import Sharing
from federation.coordinator.policy.usage import QueueUsage


def q(name: str, *quotas: tuple[str, float, float], parent: str = "") -> queues_pb2.Queue:
    return queues_pb2.Queue(
        name=name,
        tenant="t",
        weight=1,
        parent=parent,
        quotas=[queues_pb2.Quota(resource=r, nominal=n, borrowing_limit=b) for r, n, b in quotas],
    )


def test_demand_counts_replicas_shares_and_a_single_model() -> None:
    task = jobs_pb2.TaskSpec(name="t", replicas=2)
    task.resources.cpu = 4
    task.resources.memory_mib = 1000
    task.resources.accelerator.kind = resources_pb2.DEVICE_KIND_GPU
    task.resources.accelerator.count = 2
    task.resources.accelerator.models.append("H100-80GB")
    assert demand(task) == {"cpu": 8, "memory_mib": 2000, "gpu": 4, "gpu/H100-80GB": 4}
    task.resources.accelerator.ClearField("count")
    task.resources.accelerator.fraction = 0.25
    task.resources.accelerator.models.append("A100-80GB")  # two models: no model quota
    assert demand(task) == {"cpu": 8, "memory_mib": 2000, "gpu": 0.5}


def test_admission_within_nominal_borrowing_and_its_limits() -> None:
    queues = {"a": q("a", ("gpu", 2, 1)), "b": q("b", ("gpu", 2, 0))}
    held = {"a": {"gpu": 2.0}, "b": {"gpu": 0.0}}

    def holds(name: str) -> dict[str, float]:
        return held[name]

    assert admission("a", {"gpu": 1}, queues, holds) is None  # borrows b's idle nominal
    assert admission("a", {"cpu": 64}, queues, holds) is None  # no cpu quota: not limited
    why = admission("a", {"gpu": 2}, queues, holds)
    assert why == "queue a at its gpu quota (2/2), may borrow 1; this task needs 2"
    held["b"]["gpu"] = 2.0  # b uses its nominal: nothing to borrow
    why = admission("a", {"gpu": 1}, queues, holds)
    assert why is not None
    assert "borrowing blocked" in why
    assert admission("b", {"gpu": 1}, queues, holds) is not None  # b may not borrow at all


def test_a_queue_within_its_nominal_quota_is_owed_what_the_queues_beside_it_borrow() -> None:
    """qa (nominal 2) borrows 2 of qb's nominal 4: the two hold 4 of their 6 together. qb may
    take 2 more; past that it is within its nominal quota but the cohort is at its sum, so
    it waits, and qa owes it back what it borrows (never more than the 6 together)."""
    queues = {"qa": q("qa", ("gpu", 2, 2)), "qb": q("qb", ("gpu", 4, 0))}
    held = {"qa": {"gpu": 4.0}, "qb": {"gpu": 0.0}}

    def holds(name: str) -> dict[str, float]:
        return held[name]

    assert admission("qb", {"gpu": 2}, queues, holds) is None
    assert owed("qb", {"gpu": 2}, queues, holds) == []  # nothing to give back
    why = admission("qb", {"gpu": 4}, queues, holds)
    assert why == (
        "queue qb within its nominal gpu quota (0/4), but the queues beside it hold 4 of their "
        "6 gpu together: waits for what they borrow to be given back"
    )
    assert owed("qb", {"gpu": 4}, queues, holds) == [Debt("qb", "gpu", 2.0, {"qa": 2.0})]
    held["qb"]["gpu"] = 1.0
    assert owed("qb", {"gpu": 1}, queues, holds) == []  # 6 together: room in the sum yet
    assert owed("qb", {"gpu": 2}, queues, holds) == [Debt("qb", "gpu", 1.0, {"qa": 2.0})]
    assert owed("qa", {"gpu": 1}, queues, holds) is None  # qa would borrow: owed nothing
    held["qb"]["gpu"] = 4.0
    assert owed("qb", {"gpu": 1}, queues, holds) is None  # qb at its nominal: would borrow


def test_a_parent_bounds_its_children_together() -> None:
    queues = {
        "org": q("org", ("gpu", 3, 0)),
        "x": q("x", parent="org"),
        "y": q("y", parent="org"),
    }
    own = {"org": {}, "x": {"gpu": 2.0}, "y": {"gpu": 1.0}}

    def subtree(name: str) -> dict[str, float]:
        names = [name] + [n for n, queue in queues.items() if queue.parent == name]
        return {"gpu": sum(own[n].get("gpu", 0.0) for n in names)}

    why = admission("x", {"gpu": 1}, queues, subtree)
    assert why is not None
    assert why.startswith("queue org at its gpu quota (3/3)")
    own["y"] = {}
    assert admission("x", {"gpu": 1}, queues, subtree) is None


def test_dominant_share_and_fair_order_follow_weights() -> None:
    capacity = {"cpu": 100, "memory_mib": 1000, "gpu": 10}
    assert dominant_share({"cpu": 10, "gpu": 5}, capacity, 1) == (0.5, "gpu")
    assert dominant_share({"cpu": 10, "gpu": 5}, capacity, 2) == (0.25, "gpu")
    held = {"light": 0.0, "heavy": 0.0}
    weight = {"light": 1.0, "heavy": 3.0}
    lines = {"light": [f"l{i}" for i in range(8)], "heavy": [f"h{i}" for i in range(8)]}

    def turn(queue: str, item: str) -> tuple[bool, float]:
        return False, held[queue] / weight[queue]

    order = []
    for item in fair_order(lines, turn):
        order.append(item)
        held["light" if item.startswith("l") else "heavy"] += 1
        if len(order) == 8:
            break
    assert sum(item.startswith("h") for item in order) == 6  # 3:1, as the weights


def test_what_a_queue_is_owed_goes_before_what_another_would_borrow() -> None:
    """qc holds 1 of its nominal 2 GPUs, qd (weight 3) its whole 2: qc's next task is owed and
    goes first, though qd's weighted share is lower; then qd, by share, before qc borrows.
    Without the rule qd would borrow the GPU qc takes back."""
    book = QueueBook(None)  # type: ignore[arg-type]  # never written: no store needed
    book._queues = {"qc": q("qc", ("gpu", 2, 2)), "qd": q("qd", ("gpu", 2, 2))}
    book._queues["qd"].weight = 3
    usage = QueueUsage()
    for i, name in enumerate(["qc", "qd", "qd"]):
        running = gpu_job(name, 1)
        running.id = f"running-{i}"
        running.tasks[0].state = jobs_pb2.JOB_STATE_RUNNING
        usage.update(running, {})
    sharing = Sharing(book, usage)
    waiting = []
    for name in ["qd", "qd", "qc", "qc"]:
        job = gpu_job(name, 1)
        job.id = f"{name}-{len(waiting)}"
        waiting.append(job)
    tentative: dict[str, dict[str, float]] = {}
    order = []
    for job in sharing.order(waiting, {"gpu": 4}, tentative):
        order.append(job.id)
        sharing.admit(job, {"gpu": 1}, tentative)
    # qc at 2 of 2 and qd at 2 of 2: both would borrow; qd's share (3/4/3) beats qc's (3/4).
    assert order == ["qc-2", "qd-0", "qd-1", "qc-3"]
    assert sharing.lenders(waiting[0], {"gpu": 1}) == set()  # qd would borrow itself
    assert sharing.lenders(waiting[2], {"gpu": 1}) == set()  # qd borrows nothing
    borrowed = gpu_job("qd", 1)
    borrowed.id = "borrowed"
    borrowed.tasks[0].state = jobs_pb2.JOB_STATE_RUNNING
    usage.update(borrowed, {})
    assert sharing.lenders(waiting[2], {"gpu": 1}) == {"qd"}  # owed what qd borrows
    # Once another of qc's tasks waits for the GPU it is owed, qc is owed nothing more.
    assert sharing.lenders(waiting[2], {"gpu": 1}, {"qc": {"gpu": 1.0}}) == set()


def test_priority_classes_are_checked() -> None:
    classes = parse_priority_classes(
        {"urgent": {"value": 900, "may_preempt": True}, "batch": {"value": -10}}, source="c"
    )
    assert classes["urgent"] == PriorityClass("urgent", 900, preemptible=True, may_preempt=True)
    assert classes["urgent"].allows(None)  # operators
    assert not classes["urgent"].allows("team-a")  # it may preempt: listed tenants only
    assert classes["batch"].allows("team-a")
    listed = parse_priority_classes(
        {"vip": {"value": 10, "preemptible": False, "tenants": ["team-a"]}}, source="c"
    )
    assert listed["vip"].allows("team-a")
    assert not listed["vip"].allows("team-b")
    for bad, message in (
        ({"x": {"value": 5000}}, "must be in"),
        ({"x": {"value": "high"}}, "must be an integer"),
        ({"x": {}}, "value is required"),
        ({"x": {"value": 1, "preempt": True}}, "unknown setting"),
        ({"x": 3}, "must be a table"),
        ({"x": {"value": 1, "tenants": "team-a"}}, "must be a list"),
    ):
        with pytest.raises(ConfigError, match=message):
            parse_priority_classes(bad, source="c")


def test_queue_checks_name_each_field() -> None:
    known = {"a": q("a", parent="b"), "b": q("b")}
    bad = q("b", ("gpu", 1, 0), ("gpu", 2, 0), parent="a")
    found = {v.field: v.description for v in queue_violations(bad, {**known, "b": bad})}
    assert "cycle" in found["queue.parent"]
    assert "appears twice" in found["queue.quotas[1].resource"]


def test_victims_are_the_fewest_cheapest_whole_tasks() -> None:
    def task(job: str, site: str, priority: int, gpus: float, lost_s: float) -> Candidate:
        return Candidate(job, "t", site, 1, priority, {"gpu": gpus}, lost_s)

    need = {"gpu": 2.0}
    free = {"a": {"gpu": 0.0}, "b": {"gpu": 1.0}}
    candidates = [
        task("a-low", "a", -100, 1, 5),
        task("a-low-fresh", "a", -100, 1, 1),
        task("a-mid", "a", 0, 1, 0),
        task("b-gang", "b", 0, 2, 50),  # two replicas: stopped whole or not at all
    ]
    site, victims = choose_victims(need, free, candidates) or ("", [])
    # a needs two victims (the low ones, least lost work first); b needs one, the gang whole.
    assert site == "b"
    assert [v.job_id for v in victims] == ["b-gang"]
    site, victims = choose_victims(need, {"a": free["a"]}, candidates) or ("", [])
    assert [v.job_id for v in victims] == ["a-low-fresh", "a-low"]
    assert choose_victims({"gpu": 9.0}, free, candidates) is None


def test_borrowed_quota_is_taken_back_from_borrowers_anywhere_once_the_task_fits() -> None:
    """qb is owed 2 GPUs that qa borrows. Site a has room for the task: 2 of qa's tasks go,
    wherever they run, the cheapest first; qc's (not borrowing) do not pay what is owed.
    Where the task needs room too (site b alone), it is made there, by those that pay."""

    def task(job: str, site: str, queue: str, lost_s: float) -> Candidate:
        return Candidate(job, "t", site, 1, 0, {"gpu": 1.0}, lost_s, (queue,))

    debts = [Debt("qb", "gpu", 2.0, {"qa": 2.0})]
    need = {"gpu": 1.0}
    candidates = [
        task("qa-b-old", "b", "qa", 30),
        task("qa-b-new", "b", "qa", 1),
        task("qa-c", "c", "qa", 2),
        task("qc-b", "b", "qc", 0),  # the cheapest, but qc borrows nothing
    ]
    site, victims = choose_victims(need, {"a": {"gpu": 1.0}}, candidates, debts) or ("", [])
    assert site == "a"
    assert [v.job_id for v in victims] == ["qa-b-new", "qa-c"]
    site, victims = choose_victims(need, {"b": {"gpu": 0.0}}, candidates, debts) or ("", [])
    assert site == "b"
    assert [v.job_id for v in victims] == ["qa-b-new", "qa-b-old"]
    # qa borrows only 1 more than its nominal: a second task of it would not be borrowed.
    one = [Debt("qb", "gpu", 2.0, {"qa": 1.0})]
    assert choose_victims(need, {"a": {"gpu": 1.0}}, candidates, one) is None


def test_a_task_not_started_is_taken_back_only_after_the_minimum_run() -> None:
    """Delegated but not started, a task may be stopped for priority at once (it loses
    nothing), but it counts as having run nothing when borrowed quota is taken back."""
    assert ready_s(None, 60.0, reclaim=False) == -math.inf
    assert ready_s(None, 120.0, reclaim=True) == math.inf
    assert ready_s(None, 0.0, reclaim=True) == -math.inf
    assert ready_s(1000.0, 120.0, reclaim=True) == 1120.0


def test_queue_gauges_follow_usage_and_drop_what_is_gone() -> None:
    book = QueueBook(None)  # type: ignore[arg-type]  # never written: no store needed
    book._queues = {"q": q("q", ("gpu", 4, 0))}
    usage = QueueUsage()
    job = jobs_pb2.Job(id="j1")
    job.spec.queue = "q"
    task = job.spec.tasks.add(name="t")
    task.resources.accelerator.kind = resources_pb2.DEVICE_KIND_GPU
    task.resources.accelerator.count = 2
    job.tasks.add(name="t", state=jobs_pb2.JOB_STATE_RUNNING)
    usage.update(job, {})
    sharing = Sharing(book, usage)
    sharing.export_gauges({"gpu": 8}, {})
    sample = REGISTRY.get_sample_value
    assert sample("federation_queue_usage", {"queue": "q", "resource": "gpu"}) == 2
    assert sample("federation_queue_dominant_share", {"queue": "q"}) == 0.25
    usage.remove("j1")
    sharing.export_gauges({"gpu": 8}, {})
    assert sample("federation_queue_usage", {"queue": "q", "resource": "gpu"}) is None
    assert sample("federation_queue_dominant_share", {"queue": "q"}) == 0


def one_gpu_of_two_held() -> tuple[Sharing, QueueUsage, jobs_pb2.Job]:
    """Queue qs with a quota of 2 GPUs (no borrowing), and its running task holding one."""
    book = QueueBook(None)  # type: ignore[arg-type]  # never written: no store needed
    book._queues = {"qs": q("qs", ("gpu", 2, 0))}
    usage = QueueUsage()
    running = gpu_job("qs", 1)
    running.tasks[0].state = jobs_pb2.JOB_STATE_RUNNING
    usage.update(running, {})
    sharing = Sharing(book, usage)
    return sharing, usage, running


def test_a_change_admitted_during_a_cycle_counts_in_the_cycles_view() -> None:
    """A scale-up checked while a scheduling cycle looks at what queues held as it began is
    checked against what they hold now, and the room it takes is gone from the cycle's view
    too: neither can hand the last GPU of qs to a second task."""
    sharing, usage, running = one_gpu_of_two_held()
    waiting = gpu_job("qs", 1)
    with sharing.as_of_now():
        assert sharing.admit_change(running, {"gpu": 1}) is None  # the one GPU left
        usage.update(running, {("j", "t"): {"gpu": 2.0}})  # held while the change is made
        assert sharing.admission(waiting, {"gpu": 1}, {}) is not None  # the cycle's view
        assert sharing.admit_change(running, {"gpu": 1}) is not None  # what is held now
    assert sharing.admission(waiting, {"gpu": 1}, {}) is not None


def test_a_change_cannot_take_room_a_resting_cycle_has_admitted() -> None:
    """A cycle that admitted a task (not held yet: its offers leave when the cycle ends) and
    rests: a scale-up checked meanwhile finds that room taken."""
    sharing, _, running = one_gpu_of_two_held()
    tentative: dict[str, dict[str, float]] = {}
    with sharing.as_of_now(tentative):
        sharing.admit(gpu_job("qs", 1), {"gpu": 1}, tentative)
        assert "queue qs at its gpu quota (2/2)" in str(sharing.admit_change(running, {"gpu": 1}))
    # Outside a cycle only what is held counts: a cycle holds what it admitted as it ends.
    assert sharing.admit_change(running, {"gpu": 1}) is None


def scoped(resource: str, nominal: float, *, site: str = "", domain: int = 0) -> queues_pb2.Quota:
    return queues_pb2.Quota(resource=resource, nominal=nominal, site=site, domain=domain)


def gpu_job(queue: str, count: int, *models: str) -> jobs_pb2.Job:
    job = jobs_pb2.Job(id="j")
    job.spec.queue = queue
    task = job.spec.tasks.add(name="t")
    task.resources.accelerator.kind = resources_pb2.DEVICE_KIND_GPU
    task.resources.accelerator.count = count
    task.resources.accelerator.models.extend(models)
    job.tasks.add(name="t", state=jobs_pb2.JOB_STATE_PENDING)
    return job


def test_placed_tasks_count_at_their_site_domain_and_given_models() -> None:
    """What a running task holds counts at its site and in its domain, by the models of the
    devices the site reported giving it (or, until then, the model it accepted the offer
    with): a task that lists two models is counted by the one it runs on."""
    usage = QueueUsage(domain_of={"dc-1": "datacenter"}.__getitem__)
    job = gpu_job("q", 2, "A100", "H100")
    job.tasks[0].state = jobs_pb2.JOB_STATE_DELEGATED
    job.tasks[0].site = "dc-1"
    job.tasks[0].estimate.device_model = "A100"
    usage.update(job, {})
    held = {k: v for k, v in usage.of("q").items() if v}  # cores and memory: none asked
    assert held == {
        f"{r}{where}": 2
        for r in ("gpu", "gpu/A100")
        for where in ("", "@site/dc-1", "@domain/datacenter")
    }
    job.tasks[0].state = jobs_pb2.JOB_STATE_RUNNING
    job.tasks[0].models.extend(["H100", "A100"])  # as the site reported: one device each
    usage.update(job, {})
    held = usage.of("q")
    assert held["gpu/H100"] == 1
    assert held["gpu/A100@domain/datacenter"] == 1
    usage.update(job, {("j", "t"): {"gpu": 5.0}})  # offers out: what it was admitted with
    assert usage.of("q") == {"gpu": 5.0}


def test_where_keeps_sites_and_models_within_scoped_quotas() -> None:
    """A quota of one site, one domain or one model narrows where a task may go: sites past
    it are refused with the quota's words, and a site with several models is offered only
    those still within quota (a second model no longer sidesteps a model quota)."""
    book = QueueBook(None)  # type: ignore[arg-type]  # never written: no store needed
    queue = q("q")
    queue.quotas.extend(
        [
            scoped("gpu", 2, site="dc-1"),
            scoped("gpu", 3, domain=resources_pb2.DOMAIN_CLOUD),
            scoped("gpu/A100", 4),
        ]
    )
    book._queues = {"q": queue}
    usage = QueueUsage(domain_of={"dc-1": "datacenter", "dc-2": "datacenter"}.get)
    sharing = Sharing(book, usage)
    running = gpu_job("q", 2, "A100")
    running.id = "r"
    running.tasks[0].state = jobs_pb2.JOB_STATE_RUNNING
    running.tasks[0].site = "dc-1"
    usage.update(running, {})  # dc-1's quota is full; 2 of the 4 A100 are used

    job = gpu_job("q", 2, "A100", "H100")
    spec = job.spec.tasks[0]
    need = demand(spec)
    models = {"dc-1": {"A100"}, "dc-2": {"A100", "H100"}, "cloud-1": {"H100"}}
    domains = {"dc-1": "datacenter", "dc-2": "datacenter", "cloud-1": "cloud"}
    where = sharing.where(
        job, spec, need, ["dc-1", "dc-2", "cloud-1"], models.__getitem__, domains.__getitem__, {}
    )
    assert where.sites == ["dc-2", "cloud-1"]
    assert where.refused == [
        ("dc-1", "queue q at its gpu at site dc-1 quota (2/2); this task needs 2")
    ]
    assert where.models == {}  # A100 still has room for 2 more
    assert where.holds["gpu/A100@site/dc-2"] == 2
    assert where.holds["gpu/H100@domain/cloud"] == 2

    more = gpu_job("q", 2, "A100")
    more.id = "r2"
    more.tasks[0].state = jobs_pb2.JOB_STATE_RUNNING
    more.tasks[0].site = "dc-2"
    usage.update(more, {})  # now all 4 A100 are used
    where = sharing.where(
        job, spec, need, ["dc-2", "cloud-1"], models.__getitem__, domains.__getitem__, {}
    )
    assert where.sites == ["dc-2", "cloud-1"]
    assert where.models == {"dc-2": ["H100"]}
    job.spec.tasks[0].resources.accelerator.count = 4  # past the cloud's 3
    where = sharing.where(
        job,
        job.spec.tasks[0],
        demand(job.spec.tasks[0]),
        ["cloud-1"],
        models.__getitem__,
        domains.__getitem__,
        {},
    )
    assert where.sites == []
    assert "gpu in domain cloud quota (0/3)" in where.refused[0][1]


def test_scoped_quota_checks_name_the_field() -> None:
    queue = q("q")
    queue.quotas.extend(
        [
            scoped("gpu", 1, site="dc-1"),
            scoped("gpu", 1, site="dc-1"),
            queues_pb2.Quota(resource="gpu", site="Bad Name!"),
            queues_pb2.Quota(resource="gpu", site="x", domain=resources_pb2.DOMAIN_EDGE),
            queues_pb2.Quota(resource="cpu", domain=42),  # type: ignore[arg-type]
            scoped("gpu", 1, site="dc-2"),  # another site: not a repeat
        ]
    )
    fields = {v.field: v.description for v in queue_violations(queue, {})}
    assert fields.keys() == {
        "queue.quotas[1].resource",
        "queue.quotas[2].site",
        "queue.quotas[3].domain",
        "queue.quotas[4].domain",
    }
    assert fields["queue.quotas[1].resource"] == "gpu at site dc-1 appears twice"


def test_a_cycle_sees_the_sum_of_nominal_quotas_held_as_it_began_and_as_it_admits() -> None:
    """Within a scheduling cycle the queues beside one within its nominal quota are read only
    where one of them borrows (as the cycle began, or by what the cycle admitted): qb is held
    back while qa borrows, and also once the cycle has admitted qa's borrowing."""
    book = QueueBook(None)  # type: ignore[arg-type]  # never written: no store needed
    book._queues = {"qa": q("qa", ("gpu", 2, 2)), "qb": q("qb", ("gpu", 4, 0))}
    usage = QueueUsage()
    running = gpu_job("qa", 4)
    running.tasks[0].state = jobs_pb2.JOB_STATE_RUNNING
    usage.update(running, {})
    sharing = Sharing(book, usage)
    waiting = gpu_job("qb", 3)
    tentative: dict[str, dict[str, float]] = {}
    with sharing.as_of_now(tentative):
        why = sharing.admission(waiting, {"gpu": 3}, tentative)
        assert why is not None
        assert "hold 4 of their 6 gpu together" in why
        assert sharing.admission(waiting, {"gpu": 2}, tentative) is None
    usage.remove(running.id)
    with sharing.as_of_now(tentative):
        assert sharing.admission(waiting, {"gpu": 3}, tentative) is None  # no one borrows
        sharing.admit(gpu_job("qa", 4), {"gpu": 4}, tentative)  # qa borrows 2 meanwhile
        assert sharing.admission(waiting, {"gpu": 3}, tentative) is not None
    assert sharing.admission(waiting, {"gpu": 3}, {}) is None  # outside a cycle: held now
