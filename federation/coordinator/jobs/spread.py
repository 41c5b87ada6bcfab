"""A task's replicas divided over sites (``TaskSpec.spread``), as pure functions.

A task with a spread is divided when it is submitted: the stored spec holds one task per part
(``train/0``, ``train/1``, ...), each with the part's replicas, which stay together at one site
as any task's do. The rest of the house then sees ordinary tasks. What is left to the scheduler
is where each part may go:

- with ``site_weights``, part *i* goes to the site the static division gives it (largest
  remainder, deterministic: ``static_division``);
- with ``max_skew``, a part may go to a topology value (site, domain or region) only where the
  parts there would exceed those in the value with the fewest by at most the skew
  (``within_skew``, Kubernetes' topology spread);
- with neither, each part goes where it finishes soonest, as any task does: division by
  available capacity.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence

from federation.api.v1 import jobs_pb2
from federation.common import job_state
from federation.coordinator.jobs.validation import TASK_OUTPUT, part_count

PART = "/"
"""Between a divided task's name and its part's number; task names may not hold it."""
TOPOLOGY = {
    jobs_pb2.Spread.TOPOLOGY_UNSPECIFIED: "site",
    jobs_pb2.Spread.TOPOLOGY_SITE: "site",
    jobs_pb2.Spread.TOPOLOGY_DOMAIN: "domain",
    jobs_pb2.Spread.TOPOLOGY_REGION: "region",
}


def part_of(name: str) -> str:
    """The divided task's name for part ``name`` ("train" for "train/1"), else ""."""
    return name.rpartition(PART)[0]


def part_number(name: str) -> int:
    return int(name.rpartition(PART)[2])


def divide(spec: jobs_pb2.JobSpec) -> jobs_pb2.JobSpec:
    """``spec`` with each task that has a spread replaced by its parts (a valid spec).

    A part keeps the task's spec (its spread too: the scheduler reads it) with the part's
    replicas and a share of the task's output. Dependants depend on every part, and a
    ``task:NAME`` input becomes one input per part, each a share of the bytes.
    """
    if not any(t.HasField("spread") for t in spec.tasks):
        return spec
    parts = {t.name: part_count(t) for t in spec.tasks if t.HasField("spread")}
    out = jobs_pb2.JobSpec()
    out.CopyFrom(spec)
    del out.tasks[:]
    for task in spec.tasks:
        count = parts.get(task.name)
        template = jobs_pb2.TaskSpec()
        template.CopyFrom(task)
        _expand_dependencies(template, parts)
        if count is None:
            out.tasks.append(template)
            continue
        template.replicas = max(1, task.spread.part_replicas)
        template.output_bytes = -(-task.output_bytes // count)  # rounded up
        for number in range(count):
            part = out.tasks.add()
            part.CopyFrom(template)
            part.name = f"{task.name}{PART}{number}"
    return out


def _expand_dependencies(task: jobs_pb2.TaskSpec, parts: Mapping[str, int]) -> None:
    """Dependencies on a divided task become dependencies on each of its parts."""
    if not any(d in parts for d in task.depends_on) and not task.inputs:
        return
    depends_on = []
    for dep in task.depends_on:
        count = parts.get(dep)
        depends_on += [dep] if count is None else [f"{dep}{PART}{n}" for n in range(count)]
    task.ClearField("depends_on")
    task.depends_on.extend(depends_on)
    inputs = []
    for item in task.inputs:
        source = item.dataset.removeprefix(TASK_OUTPUT)
        count = parts.get(source) if item.dataset.startswith(TASK_OUTPUT) else None
        if count is None:
            inputs.append(item)
            continue
        for n in range(count):
            inputs.append(
                jobs_pb2.DataInput(
                    dataset=f"{TASK_OUTPUT}{source}{PART}{n}",
                    bytes=-(-item.bytes // count),
                    site=item.site,
                )
            )
    task.ClearField("inputs")
    task.inputs.extend(inputs)


def static_division(parts: int, weights: Mapping[str, int]) -> list[str]:
    """The site of each of ``parts`` parts, in proportion to ``weights`` (largest remainder).

    Each site gets the whole part of its share; the parts left go one each to the sites with
    the largest remainders (ties: the heavier weight, then the name). Parts are numbered site
    by site, in name order.
    """
    sites = sorted(s for s, w in weights.items() if w > 0)
    total = sum(weights[s] for s in sites)
    if not sites or parts <= 0:
        return []
    whole = {s: parts * weights[s] // total for s in sites}
    left = parts - sum(whole.values())
    by_remainder = sorted(sites, key=lambda s: (-(parts * weights[s] % total), -weights[s], s))
    for site in by_remainder[:left]:
        whole[site] += 1
    return [site for site in sites for _ in range(whole[site])]


def placed_parts(
    job: jobs_pb2.Job, task: str, value_of: Callable[[str], str], negotiating: Mapping[str, str]
) -> dict[str, int]:
    """Per topology value, the parts of ``task``'s divided task placed there: those with a
    site (delegated, running or ended there) and those whose negotiation (``negotiating``, by
    part name: the site it is offered to) is under way."""
    divided = part_of(task)
    counts: dict[str, int] = {}
    for status in job.tasks:
        if status.name == task or status.part_of != divided:
            continue
        if status.site and status.state != job_state.PENDING:
            site = status.site
        elif (site := negotiating.get(status.name, "")) == "":
            continue
        value = value_of(site)
        counts[value] = counts.get(value, 0) + 1
    return counts


def within_skew(
    ranked: Sequence[str],
    eligible: Iterable[str],
    value_of: Callable[[str], str],
    counts: Mapping[str, int],
    max_skew: int,
    what: str,
    topology: str = "site",
) -> tuple[list[str], list[tuple[str, str]]]:
    """Of ``ranked`` (best first), the sites where one more part keeps the skew: those of the
    best topology value that does; and (site, why) for the sites where it would not.

    ``eligible`` are the sites the part may run at (their values are those the fewest is
    counted over); ``counts`` the parts per value already; ``what`` names the divided task.
    A value with the fewest parts may always take one.
    """
    values = {value_of(s) for s in eligible} | {value_of(s) for s in ranked}
    if not values:
        return [], []
    fewest_value = min(values, key=lambda v: (counts.get(v, 0), v))
    fewest = counts.get(fewest_value, 0)
    kept: list[str] = []
    refused: list[tuple[str, str]] = []
    chosen = ""
    for site in ranked:
        value = value_of(site)
        after = counts.get(value, 0) + 1
        if after - fewest > max_skew:
            where = f"site {site}" if topology == "site" else f"{topology} {value} (site {site})"
            refused.append(
                (
                    site,
                    f"{where} would hold {after} parts of {what}, {after - fewest} more than "
                    f"{fewest_value} (max skew {max_skew})",
                )
            )
        elif not chosen or value == chosen:
            # One value at a time: the count a negotiation adds is then known before it ends.
            chosen = value
            kept.append(site)
    return kept, refused


def division(job: jobs_pb2.Job) -> dict[str, list[tuple[str, int]]]:
    """Per divided task, each part's site ("" while not placed) and replicas."""
    replicas = {t.name: max(1, t.replicas) for t in job.spec.tasks}
    out: dict[str, list[tuple[str, int]]] = {}
    for status in job.tasks:
        if status.part_of:
            out.setdefault(status.part_of, []).append((status.site, replicas.get(status.name, 1)))
    return out
