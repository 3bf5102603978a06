"""FollowSource (services/inference/follow.py): swaps table and dense module together; readers never see a
mix of versions; a broken version is skipped and the previous one keeps serving; metrics."""
from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import torch

from hybridrec.core.layouts.bundle import BundleError
from hybridrec.core.model.models import FeatureInfo, build_model
from hybridrec.core.layouts.versions import load_version, table_arrays
from services.inference.follow import FollowSource
from tests.unit.test_versions import FEATURES, publish, random_tables

KWARGS = {"hidden": [8]}


def dense_state(version: int) -> dict[str, torch.Tensor]:
    torch.manual_seed(version)
    model = build_model("hybridrec.models:DNN", [FeatureInfo(f.name, f.dim) for f in FEATURES], 3, KWARGS)
    return model.state_dict()


def write(root, version, rng, base=None, n=50):
    return publish(root, version, random_tables(rng, n), base=base, dense=dense_state(version), model_kwargs=KWARGS)


def fingerprint(model) -> tuple[int, float]:
    """(version the table says, version the dense weights say): each version's first table row and dense seed
    differ, so a mixed pair would show."""
    return model.version, float(next(iter(model.dense.parameters())).flatten()[0])


def test_swaps_table_and_dense_together_and_readers_never_mix(tmp_path):
    rng = np.random.default_rng(0)
    write(tmp_path, 1, rng, n=200)
    source = FollowSource(tmp_path, poll_s=0.01).start(wait_s=30)
    assert source.current().version == 1
    expected_weight = {1: fingerprint(source.current())[1]}
    seen: list[tuple[int, float, int]] = []
    errors: list[BaseException] = []
    stop = threading.Event()

    def client():
        while not stop.is_set():
            try:
                model = source.current()  # once per "micro-batch"
                ids = np.arange(1, 6000, 97, dtype=np.uint64)
                rows = model.table.lookup(4, ids)
                keys, _ = table_arrays(model.table, 4)
                seen.append((*fingerprint(model), int(keys.shape[0]), rows.shape[0]))
            except BaseException as exc:  # noqa: BLE001
                errors.append(exc)

    threads = [threading.Thread(target=client) for _ in range(8)]
    for t in threads:
        t.start()
    for version in range(2, 8):
        write(tmp_path, version, rng, base=None if version == 5 else version - 1, n=20)
        deadline = time.monotonic() + 30
        while source.current().version != version and time.monotonic() < deadline:
            time.sleep(0.01)
        expected_weight[version] = fingerprint(source.current())[1]
    stop.set()
    for t in threads:
        t.join()
    source.stop()
    assert not errors, errors[:3]
    assert source.swaps == 7
    for version, weight in expected_weight.items():
        torch.manual_seed(version)
        assert weight == pytest.approx(float(next(iter(dense_state(version).values())).flatten()[0]))
    stats = source.stats()
    rows = {v: table_arrays(load_version(tmp_path, v).table, 4)[0].shape[0] for v in expected_weight}
    assert len({v for v, *_ in seen}) >= 5
    for version, weight, n, _ in seen:  # every read saw one version's dense weights with that version's table
        assert weight == expected_weight[version] and n == rows[version]
    assert stats["served_version"] == 7 and stats["versions_behind"] == 0 and stats["version_swaps_total"] == 7
    assert 0 <= stats["version_age_seconds"] < 60


def test_a_broken_version_is_skipped_and_the_previous_one_keeps_serving(tmp_path):
    rng = np.random.default_rng(1)
    write(tmp_path, 1, rng)
    source = FollowSource(tmp_path)
    assert source.poll_once() and source.current().version == 1
    bad = write(tmp_path, 2, rng, base=1)
    (bad / "dense.pt").write_bytes(b"not a tensor file")
    assert not source.poll_once()
    assert source.current().version == 1 and source.stats()["versions_skipped_total"] == 1
    write(tmp_path, 3, rng)  # a full snapshot: served again
    assert source.poll_once() and source.current().version == 3


def test_current_before_any_version_and_load_version_errors(tmp_path):
    source = FollowSource(tmp_path, poll_s=0.01)
    with pytest.raises(LookupError, match="no complete version"):
        source.current()
    with pytest.raises(TimeoutError):
        source.start(wait_s=0.2)
    source.stop()
    with pytest.raises(BundleError, match="not complete"):
        load_version(tmp_path, 3)


def test_the_inference_service_settings_and_model(tmp_path):
    from hybridrec.core.config import ConfigError
    from hybridrec.core.config.inference import load_inference_config
    from services.inference.follow import inference_model
    from services.inference.model import load_model

    with pytest.raises(ConfigError, match="exactly one"):
        load_inference_config(None, values={})
    with pytest.raises(ConfigError, match="exactly one"):
        load_inference_config(None, values={"bundle": "a", "follow": "b"})
    with pytest.raises(ConfigError, match="ps:"):
        load_inference_config(None, values={"follow": "b", "ps": ["127.0.0.1:1"]})
    assert load_inference_config(None, values={"follow": "b"}).follow_poll_s == 0.5
    rng = np.random.default_rng(3)
    write(tmp_path, 1, rng)
    delta = write(tmp_path, 2, rng, base=1)
    with pytest.raises(BundleError, match="--follow"):
        load_model(delta)
    source = FollowSource(tmp_path, make_model=inference_model)
    assert source.poll_once()
    model = source.current()  # the service's LoadedModel over the merged table
    assert model.version == 2 and model.outputs == 1 and model.table.table is source._served.table
