"""A decoupled job across three sites in network namespaces (the sites harness), through a
partition of one site and the loss of another: it completes, every incident heals, nothing
is applied twice and nothing a fenced incarnation sends is applied."""
from __future__ import annotations

import json

import pytest

from harness import netns
from harness.drill import SitesDrill
from harness.sites import SiteSpec

REASON = netns.available()
pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.skipif(REASON is not None, reason=REASON or "")]


def test_job_survives_a_partition_and_a_site_loss(tmp_path):
    drill = SitesDrill(tmp_path, quick=True, baseline=False, faults=("partition", "site_loss"),
                       sites=[SiteSpec("s1", 1000, 1, 2), SiteSpec("s2", 100, 1, 2),
                              SiteSpec("s3", 20, 1, 2)])
    try:
        report = drill.run()
    finally:
        print(json.dumps({k: v for k, v in drill.report.items() if k != "spec"}, indent=1, default=str))
    assert report["status"] == "completed", report.get("status_reason")
    faults = {f["fault"]: f for f in report["faults"]}
    assert set(faults) == {"partition", "site_loss"}
    # the partitioned site's learners were declared lost, and its node came back online
    assert faults["partition"]["learners_on_site"], "nothing ran on the partitioned site"
    assert faults["partition"]["detected_after_s"]
    lost_pools = {i["pool"] for i in report["incidents"]}
    assert faults["partition"]["site"] in lost_pools
    assert faults["site_loss"]["site"] in lost_pools or not faults["site_loss"]["learners_on_site"]
    assert report["every_incident_healed"], report["incidents"]
    assert report["duplicates_applied"] == 0, report["duplicate_details"]
    assert report["fenced_applied"] == 0
    assert report["final_val_loss"] < report["initial_val_loss"]
    # the uplinks carried the traffic (the interfaces' own counters)
    assert all(b["tx_bytes"] > 0 and b["rx_bytes"] > 0 for b in report["uplink_bytes"].values())
