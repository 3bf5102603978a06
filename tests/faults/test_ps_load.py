"""Bounded load on one PS shard: 16 concurrent clients, lookups + updates, 60 s, loopback only."""
import json

import pytest

from benchmarks.ps_load import run_load

pytestmark = pytest.mark.faults


def test_sixteen_clients_for_sixty_seconds(tmp_path):
    result = run_load(clients=16, duration_s=60.0, capacity=200_000)
    (tmp_path / "ps_load.json").write_text(json.dumps(result))
    assert result["errors"] == 0, result["error_samples"]
    assert result["lookup_count"] > 100 and result["update_count"] > 100
    assert result["lookup_p50_ms"] <= result["lookup_p99_ms"]
    assert result["rows"] == result["capacity"] and result["evictions"] > 0  # the key space overflows capacity
    assert result["rss_growth_second_half"] < 1.05, result["memory_rss"]  # memory flat at capacity
