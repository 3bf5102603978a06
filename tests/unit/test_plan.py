"""The capacity planner (`hybridrec plan`) sizes one store per width, as the PS allocates them."""
from __future__ import annotations

import pytest

from hybridrec.config import EmbeddingOptimizerConfig, PSConfig
from hybridrec.app.plan import Table, plan_tables
from services.embedding_ps.store_files import StoreConfig, planned_shm_bytes


def _store_bytes(dim: int, capacity: int, admit_after: int = 1) -> int:
    spec = EmbeddingOptimizerConfig(name="adagrad")
    ps = PSConfig(capacity=capacity, num_stripes=16, lifecycle={"admit_after": admit_after})
    parts = planned_shm_bytes(StoreConfig(dim=dim, optimizer=spec, ps=ps))
    return sum(parts.values())


def test_tables_of_one_width_share_a_store_and_its_sketch():
    two = plan_tables([Table(1_000_000, 16), Table(1_000_000, 16)], optimizer="adagrad", shards=2, admit_after=2)
    one = plan_tables([Table(2_000_000, 16)], optimizer="adagrad", shards=2, admit_after=2)
    assert two["per_shard_bytes"] == one["per_shard_bytes"] == _store_bytes(16, 1_000_000, admit_after=2)
    assert [s["dim"] for s in two["stores"]] == [16]
    assert two["per_shard_parts"]["sketch"] == 4 * (1 << 22)  # one sketch, not one per table


def test_tables_of_their_own_widths_get_stores_of_their_own():
    plan = plan_tables([Table(4_000_000, 16), Table(1_000_000, 64), Table(2_000_000, 8)], optimizer="adagrad",
                       shards=2)
    assert [(s["dim"], s["rows_per_shard"]) for s in plan["stores"]] == [(8, 1_000_000), (16, 2_000_000),
                                                                        (64, 500_000)]
    expected = _store_bytes(8, 1_000_000) + _store_bytes(16, 2_000_000) + _store_bytes(64, 500_000)
    assert plan["per_shard_bytes"] == expected == sum(s["per_shard_bytes"] for s in plan["stores"])
    assert plan["total_bytes"] == 2 * expected
    assert plan["parameters"] == 4_000_000 * 16 + 1_000_000 * 64 + 2_000_000 * 8


@pytest.mark.parametrize("table", [Table(0, 16), Table(10, 0)])
def test_an_empty_or_widthless_table_is_refused(table):
    with pytest.raises(ValueError, match="ids >= 1 and dim >= 1"):
        plan_tables([table], optimizer="adagrad", shards=2)
