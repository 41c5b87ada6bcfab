"""Parts of divided tasks ("train/1") are tasks the site cores take; other slashes are not."""

from __future__ import annotations

import pytest

from datacenter_agent.slurm.offer import _NAME_RE
from federation.agent.node_fit import bad_task_name


@pytest.mark.parametrize(
    ("name", "bad"),
    [
        ("train", False),
        ("train/1", False),
        ("train/12", False),
        ("train/", True),
        ("/1", True),
        ("../1", True),
        ("train/x", True),
        ("a/b/1", True),
        ("train/\u0661", True),  # a digit, but not an ASCII one
        ("..", True),
    ],
)
def test_task_names_at_the_sites(name: str, bad: bool) -> None:
    assert bad_task_name(name) is bad
    assert (_NAME_RE.match(name) is None) is bad
