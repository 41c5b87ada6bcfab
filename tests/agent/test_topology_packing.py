"""The site's packer honours a task's topology: every replica in one rack (required), one
block where one has room (preferred), the fullest rack that fits first, so an empty one stays
whole for a larger gang."""

from __future__ import annotations

from pathlib import Path

import pytest

from federation.agent.main import load_config, parse_args
from federation.agent.packing import Slot, Usage, place
from federation.api.v1 import jobs_pb2, resources_pb2
from federation.config import ConfigError

from .cores import node, offer

RACKS = {"r1": "b1", "r2": "b1", "r3": "b2", "r4": "b2"}
"""4 racks of 2 nodes with 2 GPUs each, in 2 blocks."""


def site() -> list[resources_pb2.Node]:
    return [
        node(f"{rack}n{i}", devices=2, labels={"rack": rack, "block": block})
        for rack, block in RACKS.items()
        for i in (1, 2)
    ]


def task(replicas: int, required: str = "", preferred: str = "") -> jobs_pb2.TaskSpec:
    spec = offer(devices=1, replicas=replicas).spec
    spec.topology.CopyFrom(jobs_pb2.TopologyRequest(required=required, preferred=preferred))
    return spec


def racks_of(slots: tuple[Slot, ...] | str) -> set[str]:
    assert not isinstance(slots, str), slots
    return {slot.node[:2] for slot in slots}


def test_a_required_rack_puts_every_replica_in_one_rack() -> None:
    placed = place(site(), task(4, required="rack"), Usage())
    assert len(racks_of(placed)) == 1
    assert len(placed) == 4


def test_the_fullest_rack_that_fits_takes_the_gang() -> None:
    """r3 has 3 GPUs free, the others 4: two replicas go to r3, leaving 3 racks whole."""
    usage = Usage.of([Slot("r3n1", 1, 256, (0,))])
    assert racks_of(place(site(), task(2, required="rack"), usage)) == {"r3"}


def test_a_gang_larger_than_any_rack_is_declined_naming_the_level() -> None:
    why = place(site(), task(5, required="rack"), Usage())
    assert isinstance(why, str)
    assert why.startswith("no rack has room for all 5 replicas")


def test_without_the_label_a_required_level_is_declined() -> None:
    why = place(site(), task(2, required="switch"), Usage())
    assert why == "no node has a switch (node label 'switch')"


def test_a_preferred_block_is_filled_first_and_otherwise_ignored() -> None:
    eight = place(site(), task(8, preferred="block"), Usage())
    assert racks_of(eight) in ({"r1", "r2"}, {"r3", "r4"})
    # Ten replicas fit in no block: placed anyway, over both.
    ten = place(site(), task(10, preferred="block"), Usage())
    assert {RACKS[rack] for rack in racks_of(ten)} == {"b1", "b2"}
    assert len(ten) == 10


def test_required_block_preferred_rack_keeps_a_small_gang_in_one_rack() -> None:
    """Two GPUs taken in each rack but r2: a 3-replica gang fits in one rack only at r2, so
    it goes there, though block b2 (r3 and r4) would be left fuller by it."""
    usage = Usage.of([Slot(f"{rack}n1", 1, 256, (0, 1)) for rack in ("r1", "r3", "r4")])
    assert racks_of(place(site(), task(3, required="block", preferred="rack"), usage)) == {"r2"}


def test_the_sites_levels_keep_whole_blocks_and_racks_free() -> None:
    """One GPU is taken in r3 (block b2). With the site's levels, single GPUs go to the fullest
    block, then rack: they fill r3, then r4, and block b1 stays whole for a gang that requires
    a block. Without them, they go by node order and break b1 up."""
    taken = Slot("r3n1", 1, 256, (0,))

    def fill(levels: tuple[str, ...]) -> tuple[list[str], Usage]:
        usage = Usage.of([taken])
        racks = []
        for _ in range(7):
            placed = place(site(), task(1), usage, levels=levels)
            assert not isinstance(placed, str), placed
            usage.add(placed[0])
            racks.append(placed[0].node[:2])
        return racks, usage

    racks, usage = fill(("block", "rack"))
    assert racks == ["r3"] * 3 + ["r4"] * 4
    assert racks_of(place(site(), task(8, required="block"), usage)) == {"r1", "r2"}
    unordered, usage = fill(())
    assert set(unordered) & {"r1", "r2"}, unordered
    assert isinstance(place(site(), task(8, required="block"), usage), str)


@pytest.mark.parametrize(
    ("levels", "words"),
    [
        ('["block", "block"]', "topology_levels: give distinct, non-empty label names"),
        ('["rack", ""]', "topology_levels: give distinct, non-empty label names"),
        ('"rack"', "topology_levels"),
    ],
)
def test_bad_topology_levels_are_refused(tmp_path: Path, levels: str, words: str) -> None:
    config = tmp_path / "agent.toml"
    config.write_text(
        'site = "s"\ncoordinator = "127.0.0.1:1"\nca = "ca.pem"\nstate_dir = "state"\n'
        f"topology_levels = {levels}\n"
    )
    with pytest.raises(ConfigError, match=words):
        load_config(parse_args(["--config", str(config)], "p", "datacenter"), "datacenter")


def test_good_topology_levels_are_read_in_order(tmp_path: Path) -> None:
    config = tmp_path / "agent.toml"
    config.write_text(
        'site = "s"\ncoordinator = "127.0.0.1:1"\nca = "ca.pem"\nstate_dir = "state"\n'
        'topology_levels = ["block", "rack"]\n'
    )
    loaded = load_config(parse_args(["--config", str(config)], "p", "datacenter"), "datacenter")
    assert loaded.topology_levels == ["block", "rack"]
