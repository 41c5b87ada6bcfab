"""A site owner's share: the site keeps room for its owner's tenants and declines other
tenants' offers that would eat into it; its config is checked by key."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from federation.agent.embedded_core import EmbeddedCore
from federation.agent.main import load_config, parse_args
from federation.api.v1 import resources_pb2
from federation.config import ConfigError

from .cores import node, offer

KEEP_TWO = resources_pb2.OwnerShare(tenants=["lab"], keep={"gpu": 2, "gpu/A100-80GB": 2})


async def test_guests_get_only_what_the_owner_share_leaves(
    make_core: Callable[..., EmbeddedCore],
) -> None:
    """Of 4 GPUs with 2 kept for "lab": other tenants may hold 2 together, by reservation
    or task; lab may take the rest; room freed by a guest is a guest's again."""
    core = make_core([node("n", devices=4, cpu=32, memory_mib=65536)], owner_share=KEEP_TWO)

    def guest(job: str, devices: int = 1, tenant: str = "visitor"):  # type: ignore[no-untyped-def]
        o = offer(job, devices=devices)
        o.tenant = tenant
        return o

    first = await core.offer(guest("g1"))
    assert first.accepted
    assert (await core.offer(guest("g2", tenant="other"))).accepted  # guests count together
    refused = await core.offer(guest("g3"))
    assert not refused.accepted
    assert refused.reason == (
        "the site keeps 2 gpu for its owner's tenants: other tenants hold 2 of the 2 left to "
        "them; this task needs 1"
    )
    owner = await core.offer(guest("l1", devices=2, tenant="lab"))
    assert owner.accepted  # the kept room is the owner's
    await core.release(first.reservation_id)
    assert (await core.offer(guest("g4"))).accepted


async def test_a_site_without_an_owner_share_takes_anyone(
    make_core: Callable[..., EmbeddedCore],
) -> None:
    core = make_core([node("n", devices=2)])
    for job in ("a", "b"):
        o = offer(job, devices=1)
        o.tenant = "visitor"
        assert (await core.offer(o)).accepted


@pytest.mark.parametrize(
    ("table", "words"),
    [
        ('[owner_share]\ntenants = ["lab"]\nkeep = { tpu = 2 }\n', "owner_share.keep.tpu"),
        ("[owner_share]\nkeep = { gpu = 2 }\n", "owner_share.tenants is empty"),
        ('[owner_share]\ntenants = ["lab"]\nkeep = { gpu = -1 }\n', "owner_share.keep.gpu"),
        ('[owner_share]\ntenants = ["lab"]\nkeep = { gpu = "2" }\n', "owner_share.keep.gpu"),
        ('[owner_share]\ntenant = ["lab"]\n', "unknown setting owner_share.tenant"),
    ],
)
def test_bad_owner_shares_are_refused_by_key(tmp_path: Path, table: str, words: str) -> None:
    config = tmp_path / "agent.toml"
    config.write_text(
        'site = "s"\ncoordinator = "127.0.0.1:1"\nca = "ca.pem"\nstate_dir = "state"\n' + table
    )
    with pytest.raises(ConfigError, match=words.replace(".", r"\.")):
        load_config(parse_args(["--config", str(config)], "p", "datacenter"), "datacenter")
