"""``fedctl jobs explain``: a row per rejection (site | stage | code | reason), whole when piped,
and the ranked estimate beside the committed one."""

from __future__ import annotations

import io

from rich.console import Console

from federation.api.v1 import jobs_pb2
from federation.cli.explain import explain_task
from federation.cli.render import print_whole

LONG = "needs 2 replica(s) of 4 CPU, 1xGPU (H100-80GB); site has room for 0; " * 2


def task() -> jobs_pb2.TaskExplanation:
    def verdict(stage: str, code: str, reason: str) -> jobs_pb2.SiteVerdict:
        return jobs_pb2.SiteVerdict(site="edge-a", stage=stage, code=code, reason=reason)

    edge = jobs_pb2.SiteExplanation(
        site="edge-a",
        plugin="Constraints",
        code="DOMAIN_NOT_ALLOWED",
        reason="job wants domain cloud, site is edge",
        rejections=[
            verdict("Constraints", "DOMAIN_NOT_ALLOWED", "job wants domain cloud, site is edge"),
            verdict("CapacityFit", "NO_DEVICE_OF_MODEL", LONG),
        ],
    )
    old = jobs_pb2.SiteExplanation(site="dc-a", plugin="SiteState", reason="site is cordoned")
    fast = jobs_pb2.SiteExplanation(site="cloud-a", feasible=True, rank=1, score=120.0)
    return jobs_pb2.TaskExplanation(
        task="train",
        state=jobs_pb2.JOB_STATE_RUNNING,
        site="cloud-a",
        sites=[edge, old, fast],
        ranked_site="cloud-a",
        ranked_estimate=jobs_pb2.Estimate(run_s=100, total_s=100, cost_usd=1.0),
        committed_estimate=jobs_pb2.Estimate(
            run_s=125, total_s=125, cost_usd=1.25, device_model="H100-80GB"
        ),
    )


def piped(width: int) -> list[str]:
    out = io.StringIO()
    print_whole(Console(file=out, width=width), explain_task(task()))
    return out.getvalue().splitlines()


def test_every_rejection_is_a_whole_row_even_on_a_narrow_pipe() -> None:
    lines = piped(width=40)
    rows = [line.split("│")[1:-1] for line in lines if "edge-a" in line or "dc-a" in line]
    cells = [[cell.strip() for cell in row] for row in rows]
    assert cells == [
        ["dc-a", "SiteState", "-", "site is cordoned"],
        ["edge-a", "Constraints", "DOMAIN_NOT_ALLOWED", "job wants domain cloud, site is edge"],
        ["edge-a", "CapacityFit", "NO_DEVICE_OF_MODEL", LONG.strip()],
    ]


def test_ranked_estimate_stands_beside_the_committed_one() -> None:
    lines = piped(width=200)
    ranked = next(line for line in lines if "ranked by" in line)
    committed = next(line for line in lines if "committed by" in line)
    assert "cloud-a" in ranked
    assert "1m 40s run" in ranked
    assert "2m 05s run" in committed
    assert "on H100-80GB" in committed
    assert committed.endswith("run 1.25x ranked")


def test_the_image_pull_shows_beside_the_transfer_where_some_site_holds_the_image() -> None:
    held = jobs_pb2.SiteExplanation(
        site="holder",
        feasible=True,
        rank=1,
        estimate=jobs_pb2.Estimate(image_held=True),
    )
    far = jobs_pb2.SiteExplanation(
        site="far",
        feasible=True,
        rank=2,
        estimate=jobs_pb2.Estimate(transfer_s=4.2, pull_s=4.2, pull_bytes=50 * 2**20),
    )
    explained = jobs_pb2.TaskExplanation(
        task="t",
        state=jobs_pb2.JOB_STATE_RUNNING,
        site="holder",
        sites=[held, far],
        ranked_site="far",
        ranked_estimate=far.estimate,
    )
    out = io.StringIO()
    print_whole(Console(file=out, width=200), explain_task(explained))
    lines = out.getvalue().splitlines()
    rows = {
        cells[1]: cells
        for line in lines
        if (cells := [c.strip() for c in line.split("│")[1:-1]]) and cells[1] in ("holder", "far")
    }
    assert rows["holder"][5] == "held"
    assert rows["far"][5] == "50.0 MiB in 4.2s"
    assert any("image pull 50.0 MiB in 4.2s of the transfer" in line for line in lines)
