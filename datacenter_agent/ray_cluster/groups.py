"""A Ray site's placement groups and jobs as Ray knows them: their names (each carries the
site, job, task and epoch), placing a group, removing one, and the site's groups.

Every function here but the names blocks on Ray: call them through ``asyncio.to_thread``.
"""

from __future__ import annotations

import time
from typing import Any

import structlog

from federation.common.keys import RunKey

log = structlog.get_logger()

PLACE_WAIT_S = 2.0
"""How long an offer waits for Ray to place its group before declining."""
UNPLACEABLE = {"NO_RESOURCES", "INFEASIBLE"}
"""Ray's scheduling states of a group its scheduler tried and could not place."""


def group_name(site: str, key: RunKey) -> str:
    """The placement group (and reservation id) of a task's offer."""
    return f"fed|{site}|{key[0]}|{key[1]}|{key[2]}"


def submission_id(site: str, key: RunKey) -> str:
    """The Ray job of a task: the same for a retried commit of the same epoch."""
    return f"fed-{site}-{key[0]}-{key[1].replace('/', '~')}-{key[2]}"


def parse_group(name: str, site: str) -> RunKey | None:
    parts = name.split("|")
    if len(parts) != 5 or parts[:2] != ["fed", site] or not parts[4].isdigit():
        return None
    return parts[2], parts[3], int(parts[4])


def place_group(
    name: str,
    bundles: list[dict[str, float]],
    strategy: str,
    *,
    expect_room: bool,
    selectors: list[dict[str, str]] | None = None,
) -> tuple[Any, str]:
    """Creates the detached group; "" when Ray placed it, else Ray's scheduling state.

    Ray queues a group it cannot place rather than refusing it. With ``expect_room`` (the view
    has the room) Ray gets ``PLACE_WAIT_S`` to place it: a group just removed frees its
    resources a moment later. Without, Ray's first ``NO_RESOURCES`` or ``INFEASIBLE`` is the
    answer. A group not placed is removed.
    """
    from ray.util.placement_group import placement_group, placement_group_table

    group = placement_group(
        bundles,
        strategy=strategy,
        name=name,
        lifetime="detached",
        bundle_label_selector=selectors or None,
    )
    deadline = time.monotonic() + PLACE_WAIT_S
    state = "not placed"
    while time.monotonic() < deadline:
        if group.wait(timeout_seconds=0.05):
            return group, ""
        table = placement_group_table(group)
        state = str(table.get("stats", {}).get("scheduling_state", state))
        if table.get("state") == "CREATED":
            return group, ""
        if state in UNPLACEABLE and (not expect_room or state == "INFEASIBLE"):
            break
    remove_group(group)
    return None, state


def remove_group(group: Any) -> None:
    from ray.util import remove_placement_group

    try:
        remove_placement_group(group)
    except Exception as err:  # already gone
        log.debug("group_remove_failed", error=str(err))


def remove_named_group(name: str) -> None:
    from ray.util import get_placement_group

    try:
        group = get_placement_group(name)
    except ValueError:
        return
    remove_group(group)


def site_groups(site: str) -> list[str]:
    from ray.util.placement_group import placement_group_table

    return [
        g["name"]
        for g in placement_group_table().values()
        if g.get("state") != "REMOVED" and parse_group(g.get("name", ""), site) is not None
    ]
