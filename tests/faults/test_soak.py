"""The whole loop under fire, short form (benchmarks/soak.py): about 90 s of multi-task events replayed
as Arrow record batches through a real nats-server into a stream job with `ps.replicas: 2` publishing every 2 s,
`serve inference --follow` answering a steady OIP client, a training service SIGKILLed every 10 s (every kind
within the first four) and the broker restarted once with its store. The same accounting as the 10-minute
soak, asserted: every event trained once by id and acknowledged, nothing skipped or lost, the summary's
`stream.events` the whole job's; every answer served without error, every version published swapped in (or
passed over for a newer one already complete when the service looked: the final version, published as
training ends, can follow the last interval's within one poll), and
the final version's answers equal to `hybridrec predict` of the same model. (Latency, the drift and the
progressive AUC are the full soak's figures: docs/benchmarks.md.)"""
from __future__ import annotations

import json

import pytest

from benchmarks.soak import KINDS, soak

pytestmark = pytest.mark.faults

RATE = 1_500  # events/s: well within what the job trains on a loaded 2-core machine


def test_a_short_soak_trains_every_event_once_and_serves_without_an_error(tmp_path):
    result = soak(tmp_path, minutes=1.5, rate=RATE, kill_every_s=10, broker_restarts=1, client_rps=20,
                  idle_s=3, file_reference=False, seed=3)
    (tmp_path / "soak.json").write_text(json.dumps(result, indent=2, default=float))
    events = result["events"]
    print(json.dumps({k: result[k] for k in ("events", "recoveries", "served", "final_against_predict")}, indent=1,
                     default=float))
    assert events["replayed"] == RATE * 90 and result["replay"]["returncode"] == 0, result["replay"]
    assert events["each_event_trained_once"] and events["lost"] == 0 and events["skipped"] == 0, events
    assert events["batches_trained_twice"] == 0 and events["batch_positions_read_differently"] == 0, events
    assert events["acknowledged_all"], result["consumer"]
    assert events["summary_stream_events"] == events["replayed"] == events["summary_samples"], events
    assert result["skipped_batches"] == 0 and result["lost_updates"] == 0, result
    kills = result["chaos"]["kills_per_kind"]
    assert sum(kills.values()) >= 4 and all(kills[k] >= 1 for k in KINDS), result["chaos"]
    assert len(result["chaos"]["broker_restarts"]) == 1 and not result["chaos"]["problems"], result["chaos"]
    assert all(result["recoveries"][k]["restarts"] >= kills[k] for k in KINDS), result["recoveries"]
    served = result["served"]
    assert served["requests"] > 0 and served["errors"] == 0, served
    during, idle = served["latency_while_training_ms"], served["latency_idle_floor_ms"]
    assert during["requests"] > 0 and idle["requests"] > 0, served  # both sides of the split were answered
    assert during["requests"] + idle["requests"] <= served["requests"], served
    assert not served["published_not_served"] and served["versions_published"] >= 5, served
    final = result["final_against_predict"]
    assert final["answers_compared"] > 0 and final["max_abs_difference"] <= 1e-5, final
