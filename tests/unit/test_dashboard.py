"""The Grafana dashboard only charts metrics the services actually export."""
import json
import re
from pathlib import Path

from tests.integration.test_observability import MOVING, PRESENT

DASHBOARD = Path(__file__).resolve().parents[2] / "deploy" / "grafana" / "hybridrec-dashboard.json"


def test_dashboard_metrics_exist():
    dashboard = json.loads(DASHBOARD.read_text())
    exported = {m for names in (*MOVING.values(), *PRESENT.values()) for m in names}
    exported |= {"hybridrec_rpc_latency_seconds_bucket", "hybridrec_staleness_batches_bucket",
                 "hybridrec_nn_worker_inbox_batches", "hybridrec_nn_worker_lost_updates_total"}
    used = set()
    for panel in dashboard["panels"]:
        for target in panel["targets"]:
            used |= set(re.findall(r"hybridrec_[a-z0-9_]+", target["expr"]))
    assert used and used <= exported, used - exported
