"""The capacity planner (`hybridrec plan`) sizes one store per width, as the PS allocates them."""
from __future__ import annotations

import pytest

from hybridrec.core.config import EmbeddingOptimizerConfig, PSConfig, from_dict
from hybridrec.app.plan.job_plan import JobPlan
from hybridrec.app.plan.memory import Table, plan_config, plan_tables
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


def test_every_byte_a_shard_holds_is_counted():
    """Store files, the per-slot stamps and change marks, and the largest store's checkpoint buffers."""
    from services.embedding_ps.checkpoint import dump_memory_bytes
    from services.embedding_ps.store import PRIVATE_BYTES_PER_SLOT

    plan = plan_tables([Table(4_000_000, 16), Table(1_000_000, 64)], optimizer="adagrad", shards=2)
    configs = [StoreConfig(dim=d, optimizer=EmbeddingOptimizerConfig(name="adagrad"),
                           ps=PSConfig(capacity=c, num_stripes=16)) for d, c in ((16, 2_000_000), (64, 500_000))]
    private = plan["per_shard_private"]
    assert private == {"stamps_and_marks": PRIVATE_BYTES_PER_SLOT * 2_500_000,
                       "checkpoint_buffers": max(dump_memory_bytes(c) for c in configs)}
    assert plan["per_shard_memory_bytes"] == plan["per_shard_bytes"] + sum(private.values())
    assert plan["full_checkpoint_bytes_per_shard"] == 2_000_000 * (8 + 32 * 4) + 500_000 * (8 + 128 * 4)


def test_a_shard_beyond_the_stripe_limit_names_the_shards_it_needs():
    with pytest.raises(ValueError, match=r"more than 1024 stripes .* use at least 30 shards"):
        plan_tables([Table(500_000_000_000, 16)], optimizer="adagrad", shards=2)


def _no_fewer_hosts_hold(tables, plan, host, **options):
    """No way of putting 1 to 8 shards on each of `plan["hosts"] - 1` hosts holds the tables."""
    for per_host in range(1, 9):
        try:
            fewer = plan_tables(tables, shards=per_host * (plan["hosts"] - 1), **options)
        except ValueError as exc:
            assert "more than 1024 stripes" in str(exc)
            continue
        assert fewer["per_shard_memory_bytes"] * per_host > host


def test_compact_rows_plan_persias_hundred_trillion_parameters_on_fewer_hosts_than_persia_used():
    """Persia trained 1e14 parameters of width 128 on 30 hosts of 12 TB; fp16 weights with row-wise Adagrad
    need at most 20 of 12 TiB (float32 Adagrad: 63)."""
    from hybridrec.app.plan.memory import hosts_for

    host, tables = 12 << 40, [Table(10**14 // 128, 128)]
    compact = hosts_for(tables, optimizer="rowwise_adagrad", storage="fp16", host_bytes=host)
    full = hosts_for(tables, optimizer="adagrad", host_bytes=host)
    assert compact["hosts"] <= 20 < 30 < full["hosts"]
    assert compact["shards_per_host"] * compact["per_shard_memory_bytes"] <= host
    _no_fewer_hosts_hold(tables, compact, host, optimizer="rowwise_adagrad", storage="fp16")
    assert compact["full_checkpoint_bytes_per_shard"] == compact["rows_per_shard"] * (8 + 4 * (64 + 1))


def test_the_hundred_trillion_parameter_table_on_paper():
    """1e14 parameters of width 16 on hosts of 12 TiB: the fewest shards whose memory fits a host, packed."""
    from hybridrec.app.plan.memory import checkpoint_bytes, hosts_for

    host = 12 << 40
    plan = hosts_for([Table(10**14 // 16, 16)], optimizer="adagrad", host_bytes=host)
    assert plan["per_shard_memory_bytes"] <= host and plan["stores"][0]["stripes"] <= 1024
    assert plan["hosts"] * plan["shards_per_host"] >= plan["shards"]
    assert plan["shards_per_host"] * plan["per_shard_memory_bytes"] <= host
    assert plan["rows_per_shard"] * plan["shards"] >= 10**14 // 16
    _no_fewer_hosts_hold([Table(10**14 // 16, 16)], plan, host, optimizer="adagrad")
    writes = checkpoint_bytes(plan, changed=0.1, interval_s=30)
    assert writes["full_per_shard"] == plan["rows_per_shard"] * (8 + 32 * 4)
    assert writes["delta_bandwidth_per_shard"] == pytest.approx(writes["full_per_shard"] * 0.1 / 30, rel=1e-6)
    small = hosts_for([Table(100_000_000, 16)], optimizer="adagrad", host_bytes=8 << 30)
    assert small["shards"] == 2 and small["per_shard_memory_bytes"] <= 8 << 30  # 7.5 GiB a shard


def test_a_local_run_that_cannot_hold_its_capacity_is_refused_naming_host_width_and_bytes(tmp_path, small_config):
    """Before anything starts: no run directory, the message names the host, the width and the bytes, and the
    largest capacity that fits."""
    import re

    from typer.testing import CliRunner

    from hybridrec.app.cli import app
    from hybridrec.app.plan.memory import host_memory_bytes

    result = CliRunner().invoke(app, ["run", str(small_config), "--run-dir", str(tmp_path / "run"),
                                      "--set", "ps.capacity=400000000", "--set", "ps.num_stripes=64"])
    assert result.exit_code == 2, result.output
    message = " ".join(result.output.split())
    assert re.search(r"ps\.capacity: \d+ PS shard\(s\) of 400,000,000 rows per width on host \S+ need [\d.]+ GiB",
                     message), message
    assert "width 16:" in message and "At most" in message and not (tmp_path / "run").exists()
    most = int(re.search(r"At most ([\d,]+) rows", message)[1].replace(",", ""))
    shards = int(re.search(r"ps\.capacity: (\d+) PS shard", message)[1])
    fits = plan_tables([Table(most * shards, 16)], optimizer="adagrad", shards=shards, num_stripes=64)
    assert 0 < most < 400_000_000 and fits["total_memory_bytes"] <= host_memory_bytes()


def _tier_config(tmp_path, tier_capacity: int):
    from hybridrec.core.config import Config

    return Config.model_validate({
        "data": {"train": ["unused.tsv"]}, "features": [{"name": "C1", "group": 0, "dim": 16}],
        "optimizer": {"embedding": {"name": "adagrad"}},
        "ps": {"capacity": 1_000_000, "tier": {"dir": str(tmp_path / "disk"), "capacity": tier_capacity}},
        "cluster": {"ps": ["127.0.0.1:1", "127.0.0.1:2"]}})


def test_a_disk_tier_is_planned_on_disk_and_its_marks_in_memory(tmp_path):
    """The tier's file at full capacity, its change marks as private memory, checkpoints of the whole table."""
    from hybridrec.app.plan.memory import plan_config
    from services.embedding_ps.tier import TierLayout

    plan = plan_config(_tier_config(tmp_path, 8_000_000))
    layout = TierLayout.of(StoreConfig.from_config(_tier_config(tmp_path, 8_000_000), 16))
    assert plan["per_shard_disk_bytes"] == layout.nbytes and plan["total_disk_bytes"] == 2 * layout.nbytes
    assert plan["disk_rows_per_shard"] == 8_000_000 and layout.nbytes >= 8_000_000 * (8 + 32 * 4)
    assert plan["per_shard_private"]["disk_tier_marks"] == layout.pages * layout.per_page
    assert plan["full_checkpoint_bytes_per_shard"] == 8_000_000 * (8 + 32 * 4)  # the table, not the memory


def test_a_disk_tier_without_room_is_refused_before_start_naming_key_path_and_bytes(tmp_path):
    from hybridrec.app.plan.memory import check_fits
    from hybridrec.core.config import ConfigError

    with pytest.raises(ConfigError, match=r"ps.tier.capacity: 2 PS shard\(s\) .* need [\d,]+ bytes under .*disk"):
        check_fits(_tier_config(tmp_path, 10**13 // 128), host="here", memory_bytes=1 << 40, shm_free_bytes=1 << 40)


def test_a_job_plan_lists_every_replica_with_its_address_and_part_and_round_trips(tmp_path):
    config = from_dict({"data": {"train": ["x"]}, "num_dense": 3,
                        "features": [{"name": "a", "group": 0, "dim": 16}, {"name": "b", "group": 1, "dim": 8}],
                        "ps": {"capacity": 1000, "num_stripes": 16},
                        "cluster": {"dataloader": ["10.0.0.1:7001"], "embedding_workers": ["10.0.0.2:7002"],
                                    "ps": ["10.0.0.3:7003", "10.0.0.4:7003"],
                                    "nn_workers": ["10.0.0.5:7004", "10.0.0.6:0"]}})
    plan = JobPlan.of(config)
    assert [(p.service, p.replica, p.address) for p in plan.services] == [
        ("dataloader", 0, "10.0.0.1:7001"), ("embedding_worker", 0, "10.0.0.2:7002"),
        ("embedding_ps", 0, "10.0.0.3:7003"), ("embedding_ps", 1, "10.0.0.4:7003"),
        ("nn_worker", 0, "10.0.0.5:7004"), ("nn_worker", 1, "10.0.0.6:0")]
    assert plan.of_service("embedding_ps")[1].role == "shard 1 of 2: width 8, width 16"
    assert [(s.dim, s.rows_per_shard, s.disk_rows_per_shard) for s in plan.stores] == [(8, 1000, 0), (16, 1000, 0)]
    assert plan.ps_memory_bytes == plan_config(config)["per_shard_memory_bytes"] and plan.ps_disk_bytes == 0
    lines = plan.lines()
    assert len(lines) == 1 + 6 + 2 + 1 and "10.0.0.6:(chosen at start)" in lines[6] and "rank 1 of 2" in lines[6]
    plan.write(tmp_path)
    assert JobPlan.read(tmp_path) == plan
