"""A task's replicas divided into parts: the static division, the skew rule, the expansion."""

from __future__ import annotations

import pytest

from federation.api.v1 import jobs_pb2
from federation.common import job_state
from federation.coordinator.jobs.spread import (
    divide,
    division,
    part_number,
    part_of,
    placed_parts,
    static_division,
    within_skew,
)
from federation.coordinator.jobs.validation import spec_violations
from federation.jobspec import job_spec_from_dict


def job_spec(*tasks: dict[str, object]) -> jobs_pb2.JobSpec:
    return job_spec_from_dict(
        {"name": "j", "tasks": [{"command": ["run"], **task} for task in tasks]}
    )


@pytest.mark.parametrize(
    ("parts", "weights", "expected"),
    [
        (6, {"dc-b": 2, "cloud-a": 1}, {"dc-b": 4, "cloud-a": 2}),
        (5, {"a": 1, "b": 1, "c": 1}, {"a": 2, "b": 2, "c": 1}),  # remainder tie: by name
        (7, {"x": 3, "y": 3, "z": 1}, {"x": 3, "y": 3, "z": 1}),
        (4, {"x": 3, "y": 1}, {"x": 3, "y": 1}),
        (10, {"a": 1, "b": 2, "c": 4}, {"a": 1, "b": 3, "c": 6}),  # 1.43, 2.86, 5.71
        (2, {"a": 1, "b": 1, "c": 5}, {"c": 2}),  # 0.29, 0.29, 1.43: c's remainder is largest
        (3, {"a": 0, "b": 1}, {"b": 3}),
        (0, {"a": 1}, {}),
    ],
)
def test_static_division_by_largest_remainder(
    parts: int, weights: dict[str, int], expected: dict[str, int]
) -> None:
    sites = static_division(parts, weights)
    assert len(sites) == sum(expected.values())
    assert {s: sites.count(s) for s in set(sites)} == expected
    assert sites == sorted(sites)  # parts numbered site by site, in name order
    assert static_division(parts, dict(reversed(list(weights.items())))) == sites


def test_within_skew_keeps_the_best_value_that_holds_it() -> None:
    ranked = ["dc-a", "dc-b", "cloud-a"]  # best first

    def same(site: str) -> str:
        return site

    assert within_skew(ranked, ranked, same, {}, 1, "train") == (["dc-a"], [])
    kept, refused = within_skew(ranked, ranked, same, {"dc-a": 1}, 1, "train")
    assert kept == ["dc-b"]
    assert refused == [
        ("dc-a", "site dc-a would hold 2 parts of train, 2 more than cloud-a (max skew 1)")
    ]
    kept, refused = within_skew(ranked, ranked, same, {"dc-a": 1, "dc-b": 1}, 1, "train")
    assert (kept, [s for s, _ in refused]) == (["cloud-a"], ["dc-a", "dc-b"])
    counts = {"dc-a": 1, "dc-b": 1, "cloud-a": 1}
    assert within_skew(ranked, ranked, same, counts, 1, "train") == (["dc-a"], [])
    # A larger skew lets the best take more.
    assert within_skew(ranked, ranked, same, {"dc-a": 1}, 2, "train") == (["dc-a"], [])
    # A site the part may run at but that is not free now still counts as the fewest.
    kept, refused = within_skew(["dc-a"], ranked, same, {"dc-a": 1}, 1, "train")
    assert kept == []
    assert "more than cloud-a" in refused[0][1]


def test_within_skew_by_domain_keeps_every_site_of_the_chosen_domain() -> None:
    domain = {"e1": "edge", "d1": "datacenter", "d2": "datacenter", "c1": "cloud"}.__getitem__
    ranked = ["d1", "e1", "d2", "c1"]
    kept, refused = within_skew(ranked, ranked, domain, {"datacenter": 1}, 1, "t", "domain")
    assert kept == ["e1"]
    assert [s for s, _ in refused] == ["d1", "d2"]
    assert refused[0][1].startswith("domain datacenter (site d1) would hold 2 parts of t")
    assert within_skew(ranked, ranked, domain, {}, 1, "t", "domain") == (["d1", "d2"], [])


def test_placed_parts_count_sites_and_offers_not_pending_ones() -> None:
    job = jobs_pb2.Job()
    for n, (state, site) in enumerate(
        [
            (job_state.RUNNING, "a"),
            (job_state.SUCCEEDED, "a"),
            (job_state.PENDING, ""),
            (job_state.PENDING, ""),
            (job_state.DELEGATED, "b"),
        ]
    ):
        job.tasks.add(name=f"train/{n}", state=state, site=site, part_of="train")
    job.tasks.add(name="other", state=job_state.RUNNING, site="b")
    counts = placed_parts(job, "train/2", lambda s: s, {"train/3": "c"})
    assert counts == {"a": 2, "b": 1, "c": 1}
    assert placed_parts(job, "train/0", lambda s: s, {}) == {"a": 1, "b": 1}


def test_divide_makes_parts_and_points_dependants_at_each() -> None:
    spec = job_spec(
        {"name": "pre", "output_bytes": 100},
        {
            "name": "train",
            "replicas": 6,
            "depends_on": ["pre"],
            "output_bytes": 60,
            "spread": {"part_replicas": 2, "max_skew": 1, "topology": "domain"},
        },
        {
            "name": "post",
            "depends_on": ["train"],
            "inputs": [{"dataset": "task:train", "bytes": 90}, {"dataset": "other"}],
        },
    )
    assert spec_violations(spec) == []
    out = divide(spec)
    assert [t.name for t in out.tasks] == ["pre", "train/0", "train/1", "train/2", "post"]
    parts = out.tasks[1:4]
    assert {(t.replicas, t.output_bytes, tuple(t.depends_on)) for t in parts} == {(2, 20, ("pre",))}
    assert all(t.spread.max_skew == 1 for t in parts)
    post = out.tasks[4]
    assert list(post.depends_on) == ["train/0", "train/1", "train/2"]
    assert [(i.dataset, i.bytes) for i in post.inputs] == [
        ("task:train/0", 30),
        ("task:train/1", 30),
        ("task:train/2", 30),
        ("other", 0),
    ]
    assert divide(job_spec({"name": "plain"})) == job_spec({"name": "plain"})
    assert [part_of(t.name) for t in out.tasks] == ["", "train", "train", "train", ""]
    assert part_number("train/2") == 2


def test_division_lists_each_part_site_and_replicas() -> None:
    job = jobs_pb2.Job()
    job.spec.CopyFrom(
        divide(job_spec({"name": "t", "replicas": 4, "spread": {"part_replicas": 2}}))
    )
    job.tasks.add(name="t/0", site="a", part_of="t")
    job.tasks.add(name="t/1", part_of="t")
    assert division(job) == {"t": [("a", 2), ("", 2)]}


@pytest.mark.parametrize(
    ("task", "field", "words"),
    [
        ({"replicas": 6, "spread": {"part_replicas": 4}}, "part_replicas", "must divide"),
        ({"replicas": 6, "spread": {"part_replicas": 4000}}, "part_replicas", "between 0"),
        ({"spread": {"topology": 9}}, "topology", "unknown topology"),
        ({"spread": {"site_weights": {"a": 0}}}, "site_weights[a]", "positive"),
        ({"spread": {"site_weights": {"A b": 1}}}, "site_weights['A b']", "not a valid name"),
        ({"spread": {"max_skew": 1, "site_weights": {"a": 1}}}, "max_skew", "not both"),
        ({"spread": {"topology": "domain", "site_weights": {"a": 1}}}, "topology", "by site"),
        ({"replicas": 300, "spread": {}}, "part_replicas", "at most 256"),
    ],
)
def test_bad_spreads_name_their_field(task: dict[str, object], field: str, words: str) -> None:
    found = {v.field: v.description for v in spec_violations(job_spec({"name": "t", **task}))}
    assert words in found[f"spec.tasks[0].spread.{field}"], found


def test_parts_of_every_task_count_against_the_limit() -> None:
    spread = {"replicas": 200, "spread": {}}
    found = spec_violations(job_spec({"name": "a", **spread}, {"name": "b", **spread}))
    assert [v.field for v in found] == ["spec.tasks[1].spread.part_replicas"]
    assert "would have 400 tasks and parts" in found[0].description


def test_a_spread_of_one_part_and_unknown_weighted_sites_are_accepted() -> None:
    # Sites may join later: their parts wait for them.
    assert spec_violations(job_spec({"name": "t", "spread": {"site_weights": {"later": 1}}})) == []
    assert [t.name for t in divide(job_spec({"name": "t", "spread": {}})).tasks] == ["t/0"]
