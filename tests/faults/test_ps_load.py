"""Bounded load on one PS shard: 16 concurrent clients, lookups + updates, 20 s, loopback only (the benchmark,
benchmarks/ps_load.py, runs 60 s). The key space overflows a 50,000-row capacity within the first seconds, so the
second half runs at capacity: memory must stay flat there."""
import json

import pytest

from benchmarks.ps_load import run_load

pytestmark = pytest.mark.faults


def test_sixteen_clients_for_twenty_seconds(tmp_path):
    result = run_load(clients=16, duration_s=20.0, capacity=50_000)
    (tmp_path / "ps_load.json").write_text(json.dumps(result))
    assert result["errors"] == 0, result["error_samples"]
    assert result["lookup_count"] > 100 and result["update_count"] > 100
    assert result["lookup_p50_ms"] <= result["lookup_p99_ms"]
    assert result["rows"] == result["capacity"] and result["evictions"] > 0  # the key space overflows capacity
    assert result["rss_growth_second_half"] < 1.05, result["memory_rss"]  # memory flat at capacity
