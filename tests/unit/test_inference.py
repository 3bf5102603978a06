"""The inference service's pieces, in process: input decoding, pooling + forward, batching, remote PS lookups."""
from __future__ import annotations

import asyncio

import numpy as np
import pytest

from hybridrec.core.layouts.bundle import read_manifest
from hybridrec.core.config.inference import BatchingConfig, InferenceConfig, load_inference_config
from hybridrec.core.config import ConfigError
from services.inference.batcher import Batcher
from services.inference.core import InferenceCore
from services.inference.grpc_api import split_bytes
from services.inference.inputs import BadInput, InputDecoder, NotFound, Tensor
from services.inference.model import RemotePSTable, StaticSource, load_model
from tests.conftest import REPO
from tests.inference_util import (FakePS, columns, criteo_lines, make_bundle, make_config_bundle, random_ids, reference,
                                  tokens_for)

ATOL = 1e-5


@pytest.fixture(scope="module")
def bundle(tmp_path_factory):
    path = tmp_path_factory.mktemp("bundle") / "b"
    tokens = tokens_for()
    _, known = make_bundle(path, tokens=tokens)
    return path, known, tokens


def _rows_tensor(lines):
    return Tensor("rows", "BYTES", (len(lines),), [line.encode() if isinstance(line, str) else line
                                                    for line in lines])


def _ids_tensors(ids, dense):
    return [Tensor("ids", "UINT64", ids.shape, ids.reshape(-1)), Tensor("dense", "FP32", dense.shape,
                                                                        dense.reshape(-1))]


def _ids_dense_present(samples):
    ids, present = columns(samples)
    return ids, samples.dense, present


async def _answer(model, samples):
    batcher = Batcher(StaticSource(model), BatchingConfig())
    batcher.start()
    try:
        return await batcher.infer(samples)
    finally:
        await batcher.close()


def _run_one(model, samples):
    return asyncio.run(_answer(model, samples))


def _run_remote(path, shards, samples):
    """`samples` answered by the bundle at `path` whose rows come from the PS `shards` over gRPC."""
    async def go():
        remote = load_model(path, table=RemotePSTable([s.address for s in shards], timeout_s=5))
        try:
            return await _answer(remote, samples)
        finally:
            await remote.table.close()
    return asyncio.run(go())


def test_raw_rows_parse_like_the_training_reader(bundle, tmp_path):
    from services.dataloader.tsv import read_criteo

    path, known, tokens = bundle
    decoder = InputDecoder(read_manifest(path), 4096)
    lines = criteo_lines(tokens, 300, label=True)
    (tmp_path / "d.tsv").write_text("\n".join(lines) + "\n")
    chunk = next(read_criteo(tmp_path / "d.tsv", bad_lines="error"))
    with_label = decoder.decode([_rows_tensor(lines)])
    without = decoder.decode([_rows_tensor([line.split("\t", 1)[1] for line in lines])])
    for samples in (with_label, without):
        ids, present = columns(samples)
        np.testing.assert_array_equal(present, chunk.present)
        np.testing.assert_array_equal(ids[present], chunk.ids[chunk.present])
        np.testing.assert_array_equal(samples.dense, chunk.dense)


def test_predictions_equal_the_reference(bundle):
    path, known, tokens = bundle
    model = load_model(path)
    decoder = InputDecoder(model.manifest, 4096)
    ids = random_ids(known, 257)
    dense = np.random.default_rng(5).random((257, 13), dtype=np.float32)
    result = _run_one(model, decoder.decode(_ids_tensors(ids, dense)))
    assert result.version == 3
    np.testing.assert_allclose(result.probability, reference(path, ids, dense), atol=ATOL)
    # raw rows: the reference is fed the training reader's parse
    lines = criteo_lines(tokens, 64)
    samples = decoder.decode([_rows_tensor(lines)])
    result = _run_one(model, samples)
    np.testing.assert_allclose(result.probability, reference(path, *_ids_dense_present(samples)),
                               atol=ATOL)


@pytest.mark.parametrize("tensors, match", [
    ([Tensor("rows", "FP32", (1,), np.zeros(1, np.float32))], "must be BYTES"),
    ([Tensor("rows", "BYTES", (1, 2), [b"a", b"b"])], "shape"),
    ([Tensor("rows", "BYTES", (1,), [b"\xff\xfe" + b"\t" * 38])], "not UTF-8"),
    ([Tensor("rows", "BYTES", (1,), [b"1\t2\t3"])], "tab-separated fields"),
    ([Tensor("rows", "BYTES", (1,), [b"x" + b"\t" * 38])], "column I1 is not an integer"),
    ([Tensor("rows", "BYTES", (1,), [b"2" + b"\t" * 39])], "label must be 0 or 1"),
    ([Tensor("rows", "BYTES", (1,), [b"\t" * 20 + b"\n" + b"\t" * 18])], "line break"),
    # a character split between two rows: their bytes together are UTF-8, neither row is
    ([Tensor("rows", "BYTES", (2,), [b"\t" * 38 + b"\xc3", b"\xa9" + b"\t" * 38])],
     r"rows\[0\] is not UTF-8: unexpected end of data at byte 38"),
    ([Tensor("rows", "BYTES", (3,), [b"\t" * 38, b"\t" * 38, b"\t" * 37])], r"rows\[2\]: expected 39"),
    ([Tensor("rows", "BYTES", (2,), [b"\t" * 38, b"\t" * 10 + b"\r" + b"\t" * 28])], r"rows\[1\] holds a line"),
    ([Tensor("rows", "BYTES", (2,), [b"\t" * 38, b"\t" * 13 + b"\x01" + b"\t" * 25])], r"rows\[1\].*control"),
    ([Tensor("rows", "BYTES", (0,), [])], "no samples"),
    ([Tensor("ids", "UINT64", (1, 26), np.zeros(26, np.uint64))], "expected"),
    ([Tensor("ids", "FP32", (1, 26), np.zeros(26, np.float32)), Tensor("dense", "FP32", (1, 13),
                                                                      np.zeros(13, np.float32))], "UINT64"),
    ([Tensor("ids", "UINT64", (1, 25), np.zeros(25, np.uint64)), Tensor("dense", "FP32", (1, 13),
                                                                       np.zeros(13, np.float32))], r"\[batch, 26\]"),
    ([Tensor("ids", "UINT64", (1, 26), np.zeros(26, np.uint64)), Tensor("dense", "FP32", (1, 12),
                                                                       np.zeros(12, np.float32))], r"\[1, 13\]"),
    ([Tensor("ids", "UINT64", (1, 26), np.zeros(26, np.uint64)), Tensor("dense", "FP64", (1, 13),
                                                                       np.zeros(13))], "must be FP32"),
    ([Tensor("ids", "UINT64", (1, 26), np.zeros(26, np.uint64)), Tensor("dense", "FP32", (1, 13),
                                                                       np.full(13, np.nan, np.float32))], "NaN"),
    ([Tensor("ids", "UINT64", (1, 26), np.full(26, 5, np.uint64)), Tensor("dense", "FP32", (1, 13),
                                                                         np.zeros(13, np.float32))], "group"),
    ([Tensor("rows", "BYTES", (1,), [b"\t" * 38]), Tensor("extra", "FP32", (1,), np.zeros(1, np.float32))],
     "unknown input"),
    ([Tensor("rows", "BYTES", (1,), [b"\t" * 38]), Tensor("rows", "BYTES", (1,), [b"\t" * 38])], "twice"),
    ([Tensor("rows", "BYTES", (5,), [b"\t" * 38] * 5)], "maximum is 4"),
])
def test_bad_inputs_are_named(bundle, tensors, match):
    path, _, _ = bundle
    decoder = InputDecoder(read_manifest(path), 4)
    with pytest.raises(BadInput, match=match):
        decoder.decode(tensors)


def _prefixed(elements: list[bytes]) -> bytes:
    return b"".join(len(e).to_bytes(4, "little") + e for e in elements)


def test_raw_bytes_elements_decode_as_the_same_list_does(bundle):
    """Rows and strings sent as raw length-prefixed contents (split in one compiled pass) decode to exactly what
    the same elements as a list decode to: Criteo lines, labelled or not, one with a UTF-8 token beyond ASCII,
    an empty string."""
    path, _, tokens = bundle
    decoder = InputDecoder(read_manifest(path), 4096)
    lines = [line.encode() for line in criteo_lines(tokens, 5)] + [line.encode() for line in
                                                                 criteo_lines(tokens, 2, label=True)]
    lines.append(lines[0].rsplit(b"\t", 1)[0] + "\tcaf\u00e9".encode())
    split = split_bytes(_prefixed(lines), "rows")
    assert len(split) == len(lines) and [split[i] for i in range(len(lines))] == lines
    raw, listed = decoder.decode([Tensor("rows", "BYTES", (len(lines),), split)]), decoder.decode([_rows_tensor(lines)])
    for a, b in zip(raw.columns, listed.columns):
        np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(raw.dense, listed.dense)
    assert raw.columns[0][-1, -1] != raw.columns[0][0, -1]  # the last field's token differs: hashed, not dropped
    empty = split_bytes(_prefixed([b"", b"ab", b""]), "s")
    assert [empty[i] for i in range(3)] == [b"", b"ab", b""]


@pytest.mark.parametrize("raw, match", [
    (b"\x05\x00\x00", "inside an element's length prefix"),
    (_prefixed([b"abc"]) + b"\x09\x00\x00\x00abc", "element of 9 bytes runs past the end"),
])
def test_malformed_raw_bytes_are_named(raw, match):
    with pytest.raises(BadInput, match=match):
        split_bytes(raw, "rows")


def test_group_zero_ids_are_checked_too(bundle):
    path, known, _ = bundle
    decoder = InputDecoder(read_manifest(path), 10)
    ids = random_ids(known, 2)
    ids[1, 3] = ids[1, 4]
    with pytest.raises(BadInput, match=r"ids\[1, 3\].*group 4.*C4 is group 3"):
        decoder.decode(_ids_tensors(ids, np.zeros((2, 13), np.float32)))


def test_unknown_model_and_version_are_not_found(bundle):
    path, _, _ = bundle
    core = InferenceCore("ctr", 10)
    core.serve(StaticSource(load_model(path)), None)
    with pytest.raises(NotFound, match="unknown model 'x'"):
        core.check_model("x")
    with pytest.raises(NotFound, match="no version '4'"):
        core.check_model("ctr", "4")
    assert core.check_model("ctr", "3") == 3 and core.check_model("ctr") is None
    assert core.model_ready("ctr") and not core.model_ready("x")


def _batching_case(bundle, n: int, seed: int):
    """The bundle's model, its input decoder, `n` samples' IDs and dense features, and their reference
    predictions."""
    path, known, _ = bundle
    model = load_model(path)
    ids = random_ids(known, n, seed=seed)
    dense = np.random.default_rng(seed).random((n, 13), dtype=np.float32)
    return model, InputDecoder(model.manifest, 4096), ids, dense, reference(path, ids, dense)


def test_dynamic_batching_merges_concurrent_requests(bundle):
    model, decoder, ids, dense, want = _batching_case(bundle, 40, seed=9)

    async def go(enabled):
        batcher = Batcher(StaticSource(model), BatchingConfig(enabled=enabled, max_batch_rows=16, max_delay_ms=2))
        batcher.start()
        try:
            results = await asyncio.gather(*(batcher.infer(decoder.decode(_ids_tensors(ids[i:i + 1],
                                                                                       dense[i:i + 1])))
                                             for i in range(40)))
        finally:
            await batcher.close()
        return results, batcher.counters["micro_batches_total"]

    results, micro = asyncio.run(go(True))
    assert micro <= 4  # 40 one-row requests, at most 16 rows a micro-batch: 3 when all arrive together
    assert max(r.micro_batch_rows for r in results) == 16
    np.testing.assert_allclose(np.concatenate([r.probability for r in results]), want, atol=ATOL)
    results, micro = asyncio.run(go(False))
    assert micro == 40 and all(r.micro_batch_rows == 1 for r in results)
    np.testing.assert_allclose(np.concatenate([r.probability for r in results]), want, atol=ATOL)


def test_a_request_that_would_overfill_a_micro_batch_goes_first_into_the_next(bundle):
    """Requests of 3 rows arriving together against micro-batches of at most 16 rows: the one that would pass
    16 is held for the next micro-batch, and every request is answered with its own rows. (The batching loop
    once put it back by comparing queued requests field by field, which raised on their arrays and ended the
    loop: every later request waited for ever.)"""
    model, decoder, ids, dense, want = _batching_case(bundle, 60, seed=4)

    async def go():
        batcher = Batcher(StaticSource(model), BatchingConfig(max_batch_rows=16, max_delay_ms=2))
        batcher.start()
        try:
            return await asyncio.wait_for(asyncio.gather(*(
                batcher.infer(decoder.decode(_ids_tensors(ids[i:i + 3], dense[i:i + 3]))) for i in range(0, 60, 3))),
                30)
        finally:
            assert not batcher.task.done(), batcher.task
            await batcher.close()

    results = asyncio.run(go())
    assert max(r.micro_batch_rows for r in results) == 15  # five requests; the sixth went to the next one
    np.testing.assert_allclose(np.concatenate([r.probability for r in results]), want, atol=ATOL)


def test_a_version_mismatch_inside_a_micro_batch_fails_only_that_request(bundle):
    path, known, _ = bundle
    model = load_model(path)
    decoder = InputDecoder(model.manifest, 4096)
    samples = decoder.decode(_ids_tensors(random_ids(known, 1), np.zeros((1, 13), np.float32)))

    async def go():
        batcher = Batcher(StaticSource(model), BatchingConfig())
        batcher.start()
        try:
            return await asyncio.gather(batcher.infer(samples, 2), batcher.infer(samples, 3),
                                        return_exceptions=True)
        finally:
            await batcher.close()

    bad, good = asyncio.run(go())
    assert isinstance(bad, NotFound) and good.version == 3


def test_a_fault_of_the_batching_loop_fails_its_requests_once_each_and_the_loop_serves_on(bundle, monkeypatch):
    """A micro-batch whose first request asked for a version not loaded (failed, counted) and then met a fault
    of the batcher's own: every request of it fails, each counted once, and the next request is answered."""
    from services.inference import batcher as batcher_module

    path, known, _ = bundle
    model = load_model(path)
    decoder = InputDecoder(model.manifest, 4096)
    samples = decoder.decode(_ids_tensors(random_ids(known, 1), np.zeros((1, 13), np.float32)))

    class Broken:
        def observe(self, value):
            raise RuntimeError("the histogram broke")

    async def go():
        batcher = Batcher(StaticSource(model), BatchingConfig(max_delay_ms=200))
        batcher._concurrent = True  # the micro-batch waits for company: both requests go into it
        batcher.start()
        try:
            with monkeypatch.context() as m:
                m.setattr(batcher_module, "MICRO_BATCH_ROWS", Broken())
                failed = await asyncio.wait_for(asyncio.gather(batcher.infer(samples, 2), batcher.infer(samples),
                                                               return_exceptions=True), 30)
            after = await asyncio.wait_for(batcher.infer(samples), 30)
        finally:
            await batcher.close()
        return failed, after, dict(batcher.counters)

    (mismatch, fault), after, counters = asyncio.run(go())
    assert isinstance(mismatch, NotFound)
    assert isinstance(fault, RuntimeError) and "histogram" in str(fault)
    assert counters["failed_requests_total"] == 2  # not 3: the mismatched request is counted once
    assert after.version == 3 and counters["requests_total"] == 3


@pytest.mark.parametrize("fp16", [False, True])
def test_remote_ps_gives_the_same_predictions(bundle, fp16):
    path, known, _ = bundle
    shards = [FakePS(path, s, fp16=fp16) for s in range(2)]
    try:
        local = load_model(path)
        decoder = InputDecoder(local.manifest, 4096)
        ids = random_ids(known, 100, seed=11)
        dense = np.random.default_rng(11).random((100, 13), dtype=np.float32)
        samples = decoder.decode(_ids_tensors(ids, dense))
        remote = _run_remote(path, shards, samples)
        want = _run_one(local, samples).probability
        # float32 rows: identical; fp16 on the wire (a training PS's default) is lossy
        np.testing.assert_allclose(remote.probability, want, atol=ATOL if not fp16 else 2e-3)
        assert [s.calls for s in shards] == [1, 1] and all(s.trains == 0 for s in shards)
    finally:
        for s in shards:
            s.stop()


def test_ps_count_must_match_the_bundle(bundle):
    path, _, _ = bundle
    async def go():
        table = RemotePSTable(["127.0.0.1:1"], timeout_s=1)
        try:
            load_model(path, table=table)
        finally:
            await table.close()

    with pytest.raises(ValueError, match="1 shard"):
        asyncio.run(go())


def test_settings():
    s = load_inference_config(None, values={"bundle": "b", "ps": ["h:1", "h:2"]},
                              overrides=["batching.max_delay_ms=2", "grpc_port=0"])
    assert s.ps == ["h:1", "h:2"] and s.batching.max_delay_ms == 2 and s.host == "127.0.0.1"
    with pytest.raises(ConfigError, match="bundle"):
        load_inference_config(None)
    with pytest.raises(ConfigError, match="batching.max_batch_rows"):
        load_inference_config(None, values={"bundle": "b"}, overrides=["batching.max_batch_rows=0"])
    with pytest.raises(ConfigError, match="unknown key"):
        load_inference_config(None, values={"bundle": "b"}, overrides=["nope=1"])
    for model in (InferenceConfig, BatchingConfig):
        for name, field in model.model_fields.items():
            assert field.description or name == "batching", f"{model.__name__}.{name} has no docstring"


# -- inputs by feature name ------------------------------------------------------------------------------------
def _named(tokens_by_feature: list[list[bytes]], dense: np.ndarray) -> list[Tensor]:
    return [Tensor("dense", "FP32", dense.shape, dense.reshape(-1))] + [
        Tensor(f"C{f + 1}", "BYTES", (len(values),), values) for f, values in enumerate(tokens_by_feature)]


def test_named_string_features_hash_like_the_training_reader(bundle):
    """Each C column sent by name as BYTES gives exactly the bags of the same TSV rows (an empty string is an
    absent field), and the same predictions."""
    path, _, tokens = bundle
    decoder = InputDecoder(read_manifest(path), 4096)
    lines = criteo_lines(tokens, 50)
    fields = [line.split("\t") for line in lines]
    from_rows = decoder.decode([_rows_tensor(lines)])
    named = decoder.decode(_named([[row[13 + f].encode() for row in fields] for f in range(26)], from_rows.dense))
    for a, b in zip(from_rows.bags.bags(), named.bags.bags()):
        np.testing.assert_array_equal(a.values, b.values)
        np.testing.assert_array_equal(a.offsets, b.offsets)
    model = load_model(path)
    np.testing.assert_array_equal(_run_one(model, named).probability, _run_one(model, from_rows).probability)


def _list_manifest():
    from hybridrec.core.layouts.bundle import BundleManifest
    from hybridrec.core.config import FeatureConfig, ModelConfig

    return BundleManifest(features=[FeatureConfig(name="user", group=0, dim=4),
                                    FeatureConfig(name="tags", group=1, dim=4, kind="list", max_len=3)],
                          num_dense=2, model=ModelConfig(path="hybridrec.models:DNN"), num_shards=1)


def _list_request(user, tags, lengths, dense_rows=None):
    n = len(lengths)
    dense = np.zeros((dense_rows or n, 2), np.float32)
    return [Tensor("dense", "FP32", dense.shape, dense.reshape(-1)),
            Tensor("user", "INT64", (len(user),), np.asarray(user, np.int64)),
            Tensor("tags", "INT64", (len(tags),), np.asarray(tags, np.int64)),
            Tensor("tags__lengths", "INT64", (n,), np.asarray(lengths, np.int64))]


def test_a_list_feature_keeps_its_most_recent_max_len_values_and_counts_the_cut():
    from hybridrec.core.layouts.criteo_kernels import hash_ints

    decoder = InputDecoder(_list_manifest(), 16)
    samples = decoder.decode(_list_request([7, 8], [1, 2, 3, 4, 5, 6], [5, 1]))
    expected = np.empty(4, np.uint64)
    hash_ints(np.array([3, 4, 5, 6], np.int64), np.uint64(1 << 56), expected)  # row 0 keeps 3, 4, 5
    np.testing.assert_array_equal(samples.bags.bag(1).values, expected)
    np.testing.assert_array_equal(samples.bags.bag(1).offsets, [0, 3, 4])
    assert decoder.truncated_rows == 1 and samples.bags.bag(0).lengths.tolist() == [1, 1]


@pytest.mark.parametrize("tensors, match", [
    (_list_request([7], [1], [1])[:3], r"list feature: send its flat values with tags__lengths"),
    (_list_request([7, 8], [1, 2, 3], [1, 1]), r"tags__lengths'?: the lengths add up to 2, but 'tags' has 3"),
    (_list_request([7, 8], [1], [2, -1]), "negative length"),
    (_list_request([7], [1], [1])[:2] + _list_request([7], [1], [1])[3:], r"missing input\(s\) \['tags'\]"),
    (_list_request([7], [1], [1]) + [Tensor("price", "FP32", (1,), np.zeros(1, np.float32))],
     r"unknown input\(s\) \['price'\]"),
    ([*_list_request([7], [1], [1])[:1], Tensor("user", "FP32", (1,), np.zeros(1, np.float32)),
      *_list_request([7], [1], [1])[2:]], "'user' must be one of INT64, INT32, UINT64, BYTES, got FP32"),
    (_list_request([7, 8], [1, 2], [1, 1]) + [Tensor("user__lengths", "INT64", (2,), np.array([2, 0]))],
     "user is a scalar feature"),
    (_list_request([7, 8, 9], [1], [1, 0]), "'user' has 3 values for a batch of 2"),
    (_list_request([1] * 17, [1] * 17, [1] * 17), "maximum is 16"),
])
def test_bad_named_inputs_are_named(tensors, match):
    with pytest.raises(BadInput, match=match):
        InputDecoder(_list_manifest(), 16).decode(tensors)


def test_metadata_lists_every_named_input_with_its_type():
    manifest = _list_manifest().model_copy(update={"input_types": {"user": "INT64", "tags": "BYTES"}})
    assert InputDecoder(manifest, 16).metadata() == [
        {"name": "dense", "datatype": "FP32", "shape": [-1, 2]},
        {"name": "user", "datatype": "INT64", "shape": [-1]},
        {"name": "tags", "datatype": "BYTES", "shape": [-1]},
        {"name": "tags__lengths", "datatype": "INT64", "shape": [-1]},
        {"name": "ids", "datatype": "UINT64", "shape": [-1, 2]},
    ]  # no 'rows': these are not Criteo columns


def test_dense_features_by_column_equal_the_dense_matrix():
    manifest = _list_manifest().model_copy(update={"dense_columns": ["price", "age"]})
    decoder = InputDecoder(manifest, 16)
    matrix = _list_request([7, 8], [1, 2, 3], [2, 1])
    dense = np.array([[0.5, 1.5], [2.5, 3.5]], np.float32)
    matrix[0] = Tensor("dense", "FP32", dense.shape, dense.reshape(-1))
    by_column = [Tensor("price", "FP32", (2,), dense[:, 0].copy()), Tensor("age", "FP32", (2,), dense[:, 1].copy()),
                 *matrix[1:]]
    np.testing.assert_array_equal(decoder.decode(by_column).dense, decoder.decode(matrix).dense)
    assert {"name": "age", "datatype": "FP32", "shape": [-1]} in decoder.metadata()
    with pytest.raises(BadInput, match=r"missing input\(s\) \['age'\]"):
        decoder.decode(by_column[:1] + by_column[2:])
    with pytest.raises(BadInput, match="'age' must have shape \\[2\\]"):
        decoder.decode([by_column[0], Tensor("age", "FP32", (3,), np.zeros(3, np.float32)), *by_column[2:]])
    with pytest.raises(BadInput, match=r"dense features are given twice: as 'dense' and as the dense columns "
                                       r"\['age', 'price'\]; send one form") as both:
        decoder.decode([*by_column[:2], *matrix])
    assert "unknown" not in str(both.value)


def test_read_only_ps_shards_serve_a_sequence_model_by_feature_name(tmp_path):
    """The DIN example's model (two widths, multi-hot tags, a 30-long sequence, two tasks) by feature name: read
    from PS shards over gRPC, the predictions equal those from the bundle's own tables."""
    path = tmp_path / "din"
    make_config_bundle(path, REPO / "examples/din_parquet.yaml", vocabulary=500)
    rng = np.random.default_rng(3)
    n = 40
    tags, hist = rng.integers(0, 9, n), rng.integers(0, 31, n)
    ints = lambda count: rng.integers(0, 600, count)  # noqa: E731 - a few values the tables do not hold
    tensors = [Tensor("user_id", "INT64", (n,), ints(n)), Tensor("item_id", "INT64", (n,), ints(n)),
               Tensor("item_cat", "INT64", (n,), ints(n)),
               Tensor("tags", "INT64", (int(tags.sum()),), ints(int(tags.sum()))),
               Tensor("tags__lengths", "INT64", (n,), tags),
               Tensor("hist_cats", "INT64", (int(hist.sum()),), ints(int(hist.sum()))),
               Tensor("hist_cats__lengths", "INT64", (n,), hist),
               Tensor("dense", "FP32", (n, 4), rng.random((n, 4), dtype=np.float32).reshape(-1))]
    local = load_model(path)
    samples = InputDecoder(local.manifest, 4096).decode(tensors)
    shards = [FakePS(path, s) for s in range(2)]
    try:
        remote = _run_remote(path, shards, samples)
        want = _run_one(local, samples).probability
        assert want.shape == (n, 2) and np.ptp(want) > 0
        np.testing.assert_allclose(remote.probability, want, rtol=0, atol=ATOL)
        assert [s.calls for s in shards] == [1, 1] and all(s.trains == 0 for s in shards)
    finally:
        for s in shards:
            s.stop()


def test_a_lone_request_is_answered_at_once_and_the_batcher_reports_its_micro_batches(bundle):
    """Sequential requests each run alone, without waiting in the batcher; concurrent ones wait and merge. The
    metrics say so: each micro-batch's rows, and each request's wait (0 when answered alone)."""
    from prometheus_client import REGISTRY

    model, decoder, ids, dense, want = _batching_case(bundle, 20, seed=4)
    requests = [decoder.decode(_ids_tensors(ids[i:i + 1], dense[i:i + 1])) for i in range(20)]

    def sample(name: str) -> float:
        return REGISTRY.get_sample_value(name) or 0.0

    async def go():
        batcher = Batcher(StaticSource(model), BatchingConfig(max_batch_rows=8, max_delay_ms=50))
        batcher.start()
        try:
            alone = [await batcher.infer(r) for r in requests[:5]]
            waits = sample("hybridrec_inference_queue_delay_seconds_sum")
            merged = await asyncio.gather(*(batcher.infer(r) for r in requests[5:]))
            return alone, merged, waits
        finally:
            await batcher.close()

    before = {k: sample(k) for k in ("hybridrec_inference_queue_delay_seconds_count",
                                      "hybridrec_inference_queue_delay_seconds_sum",
                                      "hybridrec_inference_micro_batch_rows_sum",
                                      "hybridrec_inference_micro_batch_rows_count")}
    alone, merged, waits_after_alone = asyncio.run(go())
    assert [r.micro_batch_rows for r in alone] == [1] * 5
    assert waits_after_alone == before["hybridrec_inference_queue_delay_seconds_sum"]  # alone: no wait at all
    assert sorted(r.micro_batch_rows for r in merged)[-1] == 8  # 15 together, at most 8 rows a micro-batch
    assert sample("hybridrec_inference_queue_delay_seconds_count") - before[
        "hybridrec_inference_queue_delay_seconds_count"] == 20
    assert sample("hybridrec_inference_queue_delay_seconds_sum") > waits_after_alone  # the merged ones waited
    assert sample("hybridrec_inference_micro_batch_rows_sum") - before["hybridrec_inference_micro_batch_rows_sum"] == 20
    micro = sample("hybridrec_inference_micro_batch_rows_count") - before["hybridrec_inference_micro_batch_rows_count"]
    assert 5 + 2 <= micro <= 5 + 3  # 5 alone, then 15 rows in micro-batches of at most 8
    np.testing.assert_allclose(np.concatenate([r.probability for r in alone + merged]), want, atol=ATOL)


def test_the_table_lookup_is_compiled_at_start_for_every_kind_of_array_a_request_passes():
    """Tables read-only (a bundle's) or writable (a followed version's, merged), IDs read-only (a request's bytes)
    or writable: each is a numba signature, compiled by `warm_up`, never at a request on the event loop (a clean
    clone once compiled one there for 19 s under load)."""
    from hybridrec.core.model import table_lookup

    table_lookup.warm_up()
    compiled = len(table_lookup._find.signatures)
    for tables_writable in (False, True):
        for ids_writable in (False, True):
            keys, rows = np.array([3, 7], np.uint64), np.arange(8, dtype=np.float32).reshape(2, 4)
            ids = np.array([7, 5, 3], np.uint64)
            keys.flags.writeable = rows.flags.writeable = tables_writable
            ids.flags.writeable = ids_writable
            out = np.empty((3, 4), np.float32)
            table_lookup.lookup_into([keys], [rows], ids, out)
            np.testing.assert_array_equal(out, [[4, 5, 6, 7], [0, 0, 0, 0], [0, 1, 2, 3]])
    assert len(table_lookup._find.signatures) == compiled >= 4


def test_a_shape_with_a_zero_and_a_huge_dimension_is_refused():
    """Found by the fuzzer (tests/fuzz): after a 0 the product stays 0, and a REST body's shape [0, 10**30]
    reached numpy's int64 product and was answered 500."""
    from services.inference.grpc_api import checked_shape
    from services.inference.inputs import BadInput

    with pytest.raises(BadInput, match="has a dimension past"):
        checked_shape([0, 10 ** 30])
    assert checked_shape([0, 5]) == (0, 5)
