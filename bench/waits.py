"""What weighing a predicted wait costs a task, beside one placement decision of that task.

A federation of busy sites (4 nodes of 8 H100s each, every device taken, 32 tasks due to end
over the next minutes at each) and one free slow site: a long task could start on the slow
site now, or wait. Each figure is ``sooner_by_waiting`` for one task, with 0 to ``MAX_AHEAD``
tasks already waiting for every busy site, beside a placement decision of the same request
on the same snapshot measured in the same run.

    python bench/waits.py [--sizes 10,100,1000] [--repeat 20] [--json]
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import statistics
import sys
import time
from collections.abc import Callable

from federation.api.v1 import jobs_pb2, resources_pb2
from federation.coordinator.scheduling.waits import MAX_AHEAD, Occupant, Waiter, sooner_by_waiting
from federation.placement.estimates import estimate
from federation.placement.registry import build_framework
from federation.placement.request import Request
from federation.placement.snapshot import SiteInput, Snapshot, build_snapshot

NOW = 1_000_000.0
AHEAD = (0, MAX_AHEAD // 2, MAX_AHEAD)


def fleet(n_busy: int) -> Snapshot:
    def gpus(model: str, count: int, taken: bool) -> list[resources_pb2.Device]:
        return [
            resources_pb2.Device(
                kind=resources_pb2.DEVICE_KIND_GPU,
                vendor="nvidia",
                model=model,
                memory_total_mib=81920,
                allocated=taken,
            )
            for _ in range(count)
        ]

    def site(name: str, nodes: list[resources_pb2.Node]) -> SiteInput:
        view = resources_pb2.SiteView(site=name, domain=resources_pb2.DOMAIN_DATACENTER)
        view.nodes.extend(nodes)
        return SiteInput(view=view, is_connected=True, is_cordoned=False)

    busy = [
        site(
            f"busy-{i:05d}",
            [
                resources_pb2.Node(
                    name=f"n{j}",
                    cpu_free=64,
                    memory_free_mib=1 << 20,
                    schedulable=True,
                    devices=gpus("H100-80GB", 8, True),
                )
                for j in range(4)
            ],
        )
        for i in range(n_busy)
    ]
    slow = resources_pb2.Node(
        name="n0",
        cpu_free=64,
        memory_free_mib=1 << 20,
        schedulable=True,
        devices=gpus("V100", 8, False),
    )
    return build_snapshot([*busy, site("slow", [slow])])


def long_task() -> Request:
    task = jobs_pb2.TaskSpec(name="t", command=["run"], estimated_duration_s=100_000)
    task.resources.accelerator.kind = resources_pb2.DEVICE_KIND_GPU
    task.resources.accelerator.count = 1
    return Request.from_spec(jobs_pb2.JobSpec(name="j", tasks=[task]), task)


def median_ms(run: Callable[[], object], repeat: int) -> float:
    samples = []
    for _ in range(repeat):
        start = time.perf_counter()
        run()
        samples.append((time.perf_counter() - start) * 1000)
    return statistics.median(samples)


def measure(size: int, repeat: int) -> dict[str, float]:
    """A placement decision and the weighing of a wait, at ``size`` busy sites."""
    framework = build_framework()
    req = long_task()
    snap = fleet(size)
    holding = {
        name: [Occupant(NOW + 60 + k, (f"n{k % 4}",), 0.0, 0.0, 1, "H100-80GB") for k in range(32)]
        for name in snap.site_ids
        if name != "slow"
    }
    busy = framework.place(req, snap).short_of_room().tolist()
    now_s = float(estimate(req, snap).total_s[snap.site_index("slow") or 0])
    # A request not placed on this snapshot yet, each time: nothing is reused.
    fresh = (dataclasses.replace(req, duration_s=req.duration_s + i) for i in range(10**9))
    row = {
        "busy_sites": float(len(busy)),
        "placement_ms": median_ms(lambda: framework.place(next(fresh), snap), repeat),
    }
    for ahead in AHEAD:
        waiting = {name: [Waiter(req, 2.5, 40_000.0)] * ahead for name in holding}
        weigh = functools.partial(sooner_by_waiting, req, snap, busy, now_s, holding, waiting, NOW)
        row[f"wait_{ahead}_ahead_ms"] = median_ms(weigh, repeat)
        row[f"wait_{ahead}_ahead_vs_placement"] = (
            row[f"wait_{ahead}_ahead_ms"] / row["placement_ms"]
        )
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="10,100,1000", help="busy sites")
    parser.add_argument("--repeat", type=int, default=20)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    results = {size: measure(int(size), args.repeat) for size in args.sizes.split(",")}
    if args.json:
        json.dump(results, sys.stdout, indent=2)
        print()
        return
    heads = " ".join(f"{f'wait, {a} ahead ms':>20}" for a in AHEAD)
    print(f"{'busy sites':>10} {'placement ms':>13} {heads}")
    for size, r in results.items():
        cells = " ".join(
            f"{r[f'wait_{a}_ahead_ms']:9.2f} ({r[f'wait_{a}_ahead_vs_placement']:5.2f}x)".rjust(20)
            for a in AHEAD
        )
        print(f"{size:>10} {r['placement_ms']:>13.2f} {cells}")


if __name__ == "__main__":
    main()
