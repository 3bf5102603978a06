"""The dense learning rate's fall over a run's last steps (services/nn_worker/lr_decay.py): the rate of each
step, the run's length counted from `training.max_steps` or the Parquet files' footers, and the configs that
cannot know the length refused naming the key."""
from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from hybridrec.core.config import ConfigError, from_dict
from services.nn_worker.lr_decay import LrDecay, run_steps

FEATURES = [{"name": "a", "group": 0, "dim": 4}]


def _parquet_config(files: list[str], **training) -> dict:
    return {"data": {"format": "parquet", "train": files, "dense_columns": ["d"]}, "num_dense": 1,
            "features": FEATURES, "training": {"batch_size": 2, **training},
            "cluster": {"nn_workers": ["127.0.0.1:0", "127.0.0.1:0"]},
            "optimizer": {"dense": {"lr": 0.5, "decay": {"last": 0.5, "to": 0.1}}}}


def test_the_rate_holds_then_falls_linearly_to_its_floor_and_stays_there():
    decay = LrDecay(base=1.0, start=4, total=8, floor=0.2)
    rates = [decay.lr(step) for step in range(1, 11)]
    assert rates[:4] == [1.0] * 4
    assert rates[4:8] == pytest.approx([0.8, 0.6, 0.4, 0.2])  # 1 - k/4 of the way from 1 to the floor
    assert rates[8:] == pytest.approx([0.2, 0.2])  # a run longer than counted stays at the floor


def test_the_length_is_the_parquet_rows_times_the_epochs_over_one_steps_rows(tmp_path):
    files = []
    for i, rows in enumerate((7, 6)):
        files.append(str(tmp_path / f"part{i}.parquet"))
        pq.write_table(pa.table({"d": [0.0] * rows}), files[-1])
    config = from_dict(_parquet_config(files, epochs=3))
    assert run_steps(config) == 10  # 13 rows x 3 epochs over 2 NN workers' batches of 2: 39 / 4, rounded up
    decay = LrDecay.from_config(config)
    assert (decay.base, decay.start, decay.total, decay.floor) == (0.5, 5, 10, 0.1)
    assert run_steps(from_dict(_parquet_config(files, max_steps=4))) == 4  # max_steps wins


def test_a_training_file_this_process_cannot_read_names_the_key_and_the_file(tmp_path):
    missing = str(tmp_path / "elsewhere.parquet")
    with pytest.raises(ConfigError, match=r"optimizer\.dense\.decay.*elsewhere\.parquet.*training\.max_steps"):
        LrDecay.from_config(from_dict(_parquet_config([missing])))


def test_a_run_of_unknown_length_refuses_the_decay_naming_the_key():
    tsv = {"data": {"train": ["day_0.tsv"]}, "optimizer": {"dense": {"decay": {"last": 0.25}}}}
    with pytest.raises(ConfigError, match=r"optimizer\.dense\.decay.*training\.max_steps"):
        from_dict(tsv)
    assert from_dict({**tsv, "training": {"max_steps": 100}}).optimizer.dense.decay.last == 0.25
    plain = from_dict({"data": {"train": ["day_0.tsv"]}, "optimizer": {"dense": {"lr": 0.3}}})
    assert plain.optimizer.dense.decay is None
    constant = LrDecay.from_config(plain)  # no fall: the config's rate at every step, however long the run
    assert constant.lr(1) == constant.lr(10**12) == 0.3
