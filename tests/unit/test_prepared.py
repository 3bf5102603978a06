"""Prepared data: the same batches as the source files, exact resume, and every refusal, on real files."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from hybridrec.app.cli import app
from hybridrec.app.run.preflight import preflight
from hybridrec.core.config import ConfigError, from_dict, load_config
from hybridrec.core.wire.frames import DenseBatch
from hybridrec.app.data.synth import synthesize
from hybridrec.app.data.synth_parquet import synthesize_multitask
from services.dataloader import prepared
from services.dataloader.batching import Position, ReadCounters, iter_batches
from services.dataloader.prepared import PreparedDataError
from services.dataloader.prepared_write import prepare
from services.dataloader.sources import eval_rows, train_batches
from tests.conftest import REPO

BATCH = 1000


@pytest.fixture(scope="module")
def tsv(tmp_path_factory):
    """Two TSV training files (one with bad lines) and an eval file, and their prepared copies."""
    out = tmp_path_factory.mktemp("tsv")
    synthesize(out, rows=9_000, eval_rows=3_000, seed=5)
    lines = (out / "train.tsv").read_text().splitlines(keepends=True)
    (out / "a.tsv").write_text("".join(lines[:5_500]))
    bad = lines[5_500:]
    for i in (10, 700, 1_999):  # malformed lines inside batches: the reader skips and counts them
        bad.insert(i, "1\tnot a sample\n")
    (out / "b.tsv").write_text("".join(bad))
    config = _tsv_config([out / "a.tsv", out / "b.tsv"], [out / "eval.tsv"])
    prepare([out / "a.tsv", out / "b.tsv"], out / "train.prep", config)
    prepare([out / "eval.tsv"], out / "eval.prep", config)
    return out


def _tsv_config(train, eval_, **training):
    return from_dict({"data": {"train": [str(p) for p in train], "eval": [str(p) for p in eval_]},
                      "training": {"batch_size": BATCH, **training}})


def _same_batch(a, b):
    """Rows arrays equal, and the frames the embedding worker and NN worker get carry the same bytes."""
    assert len(a) == len(b)
    for name in ("labels", "dense"):
        np.testing.assert_array_equal(getattr(a, name), getattr(b, name))
    np.testing.assert_array_equal(a.bags.values, b.bags.values)
    np.testing.assert_array_equal(a.bags.lengths, b.bags.lengths)
    assert a.sparse("train").encode() == b.sparse("train").encode()
    assert DenseBatch(7, a.dense, a.labels).encode() == DenseBatch(7, b.dense, b.labels).encode()


def test_tsv_prepared_batches_equal_the_source(tsv):
    raw = _tsv_config([tsv / "a.tsv", tsv / "b.tsv"], [tsv / "eval.tsv"], epochs=2)
    prep = _tsv_config([tsv / "train.prep"], [tsv / "eval.prep"], epochs=2)
    counts_raw, counts_prep = ReadCounters(), ReadCounters()
    a, b = list(train_batches(raw, counts_raw)), list(train_batches(prep, counts_prep))
    assert len(a) == len(b) == 2 * (6 + 4)  # per epoch: 5,500 rows -> 6 batches, 3,500 -> 4; the last ones short
    assert [len(r) for r, _ in b[:10]] == [1000] * 5 + [500] + [1000] * 3 + [500]
    for (ra, _), (rb, _) in zip(a, b):
        _same_batch(ra, rb)
    manifest = prepared.open_dataset(tsv / "train.prep", prep)
    shard = prepared._load_shard(tsv / "train.prep", manifest, manifest.shards[0])
    assert isinstance(shard.columns[0], np.memmap)  # batches are sliced out of the mapped file
    assert [p.as_list() for _, p in b[5:7]] == [[0, 0, 5500, 5501], [0, 1, 1000, 1001]]
    assert vars(counts_raw) == vars(counts_prep)
    assert counts_prep.bad_lines == 2 * 3 and counts_prep.rows == 2 * 9_000
    ea = list(iter_batches(eval_rows(raw, ReadCounters()), 700))
    eb = list(iter_batches(eval_rows(prep, ReadCounters()), 700))
    assert len(ea) == len(eb) == 5
    for ra, rb in zip(ea, eb):
        _same_batch(ra, rb)


def test_resume_from_a_position_mid_file_gives_the_rest_of_the_stream(tsv):
    prep = _tsv_config([tsv / "train.prep"], [], epochs=2)
    full = list(train_batches(prep, ReadCounters()))
    for cut in (2, 5, 8, 13):  # mid-shard, the end of shard 0, mid-shard 1, in the second epoch
        rest = list(train_batches(prep, ReadCounters(), start=full[cut][1]))
        assert [p for _, p in rest] == [p for _, p in full[cut + 1:]]
        for (ra, _), (rb, _) in zip(full[cut + 1:], rest):
            _same_batch(ra, rb)
    with pytest.raises(PreparedDataError, match=r"resume position \[0, 1, 446688, 2001\] is outside the prepared "
                                                r"data \(2 shards of \[5500, 3500\] rows\)"):
        train_batches(prep, ReadCounters(), start=Position(0, 1, 446688, 2001))  # a byte offset, from a TSV run


@pytest.fixture(scope="module")
def multitask(tmp_path_factory):
    """The multi-task Parquet data set (`hybridrec data synth --format parquet`) and its prepared copy."""
    out = tmp_path_factory.mktemp("parquet")
    synthesize_multitask(out, rows=5_000, eval_rows=2_000, seed=2)
    return out


def _parquet_config(train, eval_, example="multitask_parquet"):
    return load_config(REPO / f"examples/{example}.yaml",
                       [f"data.train=[{','.join(map(str, train))}]", f"data.eval=[{','.join(map(str, eval_))}]",
                        f"training.batch_size={BATCH - 300}"])


@pytest.mark.parametrize("example, label_columns", [("multitask_parquet", 2), ("watch_time_parquet", 3)])
def test_parquet_prepared_batches_equal_the_source(multitask, example, label_columns):
    """Two binary tasks; and a binary and a regression task with a weight column (the labels' last)."""
    raw = _parquet_config([multitask / "train.parquet"], [multitask / "eval.parquet"], example)
    prepare([multitask / "train.parquet"], multitask / f"{example}-train.prep", raw)
    prepare([multitask / "eval.parquet"], multitask / f"{example}-eval.prep", raw)
    prep = _parquet_config([multitask / f"{example}-train.prep"], [multitask / f"{example}-eval.prep"], example)
    counts_raw, counts_prep = ReadCounters(), ReadCounters()
    a, b = list(train_batches(raw, counts_raw)), list(train_batches(prep, counts_prep))
    assert len(a) == len(b) == 8 and len(b[-1][0]) == 5_000 - 7 * 700
    for (ra, _), (rb, _) in zip(a, b):
        assert rb.labels.shape == (len(rb), label_columns) and rb.bags.num_features == 5
        _same_batch(ra, rb)
    assert vars(counts_raw) == vars(counts_prep) and counts_prep.truncated_rows > 0
    ea = list(iter_batches(eval_rows(raw, ReadCounters()), 512))
    eb = list(iter_batches(eval_rows(prep, ReadCounters()), 512))
    for ra, rb in zip(ea, eb):
        _same_batch(ra, rb)
    rest = list(train_batches(prep, ReadCounters(), start=b[3][1]))
    for (ra, _), (rb, _) in zip(b[4:], rest):
        _same_batch(ra, rb)


# ------------------------------------------------------------------------------------------------ refusals


def _copy(src: Path, dst: Path) -> Path:
    subprocess.run(["cp", "-r", str(src), str(dst)], check=True)
    return dst


def test_mixing_prepared_and_raw_entries_is_refused(tsv):
    config = _tsv_config([tsv / "train.prep", tsv / "a.tsv"], [])
    with pytest.raises(ConfigError, match=r"data.train: mixes prepared directories .*train.prep.* and raw files "
                                          r".*a.tsv"):
        train_batches(config, ReadCounters())
    with pytest.raises(ConfigError, match="data.train: mixes"):
        preflight(config)


def test_a_config_with_other_ids_is_refused_naming_the_key(tsv):
    features = [{"name": f"C{i + 1}", "group": i} for i in range(26)]
    features[3]["group"] = 40
    config = from_dict({"data": {"train": [str(tsv / "train.prep")]}, "features": features})
    with pytest.raises(PreparedDataError, match=r"train.prep/manifest.json: prepared for another config: "
                                                r"features.3.group: prepared 3, config 40"):
        train_batches(config, ReadCounters())
    features[3]["group"] = 3
    fewer = from_dict({"data": {"train": [str(tsv / "train.prep")]}, "features": features[:25]})
    with pytest.raises(ConfigError, match=r"manifest.json: prepared for another config: features.25.column: "
                                          r"prepared 'C26', config '\(none\)'"):
        preflight(fewer)
    # what does not change the data does not matter: widths, names, pooling
    wider = from_dict({"data": {"train": [str(tsv / "train.prep")]},
                       "features": [{"name": f"f{i}", "column": f"C{i + 1}", "group": i, "dim": 8} for i in range(26)]})
    assert len(next(iter(train_batches(wider, ReadCounters())))[0]) > 0


def test_another_format_version_is_refused_with_both_versions(tsv, tmp_path):
    directory = _copy(tsv / "train.prep", tmp_path / "old")
    manifest = json.loads((directory / "manifest.json").read_text())
    manifest["format_version"] = 0
    (directory / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(PreparedDataError, match=rf"old/manifest.json: prepared with format version 0 .*reads "
                                                rf"version {prepared.FORMAT_VERSION}: re-run `hybridrec data prepare`"):
        train_batches(_tsv_config([directory], []), ReadCounters())


def test_another_checksum_algorithm_is_refused_naming_both(tsv, tmp_path):
    directory = _copy(tsv / "train.prep", tmp_path / "hashed")
    manifest = json.loads((directory / "manifest.json").read_text())
    manifest["checksum"] = "blake2b-128"
    (directory / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(PreparedDataError, match=r"hashed/manifest.json: checksums are blake2b-128; this hybridrec "
                                                r"checks xxh3-128: re-run `hybridrec data prepare`"):
        train_batches(_tsv_config([directory], []), ReadCounters())


def test_a_changed_shard_file_is_refused_naming_it(tsv, tmp_path):
    cut = _copy(tsv / "train.prep", tmp_path / "cut")
    ids = cut / "shard-00001" / "ids.npy"
    os.truncate(ids, ids.stat().st_size - 8)
    with pytest.raises(ConfigError, match=r"cut/shard-00001/ids.npy: \d+ bytes, the manifest says \d+"):
        preflight(_tsv_config([cut], []))
    os.remove(ids)
    with pytest.raises(PreparedDataError, match=r"cut/shard-00001/ids.npy: missing"):
        train_batches(_tsv_config([cut], []), ReadCounters())
    flipped = _copy(tsv / "train.prep", tmp_path / "flipped")
    dense = flipped / "shard-00000" / "dense.npy"
    with open(dense, "r+b") as f:  # same size, one byte changed: only the checksum sees it
        f.seek(4096)
        byte = f.read(1)
        f.seek(4096)
        f.write(bytes([byte[0] ^ 0xFF]))
    with pytest.raises(PreparedDataError, match=r"flipped/shard-00000/dense.npy: checksum differs"):
        prepared.open_dataset(flipped, _tsv_config([flipped], []))
    with pytest.raises(PreparedDataError, match=r"flipped/shard-00000/dense.npy: checksum differs"):
        prepared.verify(flipped)
    result = CliRunner().invoke(app, ["data", "verify", str(flipped)])
    assert result.exit_code == 2 and "dense.npy: checksum differs" in result.output
    result = CliRunner().invoke(app, ["data", "verify", str(tsv / "train.prep")])
    assert result.exit_code == 0 and "9,000 rows" in result.output


_KILL_AFTER_FIRST_SHARD = """
import os, signal, sys
from hybridrec.core.config import from_dict
from services.dataloader.prepared_write import prepare
src, out = sys.argv[1:3]
config = from_dict({"data": {"train": [src]}})
prepare([src, src], out, config, on_shard=lambda shard: os.kill(os.getpid(), signal.SIGKILL))
"""


def test_a_killed_prepare_is_never_taken_for_prepared_data(tsv, tmp_path):
    out = tmp_path / "prep"
    run = subprocess.run([sys.executable, "-c", _KILL_AFTER_FIRST_SHARD, str(tsv / "a.tsv"), str(out)],
                         cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True, text=True)
    assert run.returncode == -9, run.stderr
    partial, = tmp_path.glob("prep.partial-*")
    assert not out.exists() and (partial / "shard-00000" / "ids.npy").is_file()
    assert not (partial / "manifest.json").exists()
    with pytest.raises(ConfigError, match=r"prep.partial-\d+/manifest.json: no manifest: not prepared data, or a "
                                          r"prepare that did not finish"):
        preflight(_tsv_config([partial], []))
    out.mkdir()  # even a directory of the final name without a manifest is refused
    with pytest.raises(PreparedDataError, match=r"prep/manifest.json: no manifest"):
        train_batches(_tsv_config([out], []), ReadCounters())
    out.rmdir()
    manifest = prepare([tsv / "a.tsv"], out, _tsv_config([tsv / "a.tsv"], []))  # a re-run cleans up and completes
    assert manifest.rows == 5_500 and not list(tmp_path.glob("prep.partial-*"))


def test_an_existing_directory_is_replaced_only_with_force(tsv, tmp_path):
    out = _copy(tsv / "train.prep", tmp_path / "prep")
    config = _tsv_config([tsv / "a.tsv"], [])
    with pytest.raises(PreparedDataError, match=r"--out .*prep: already holds complete prepared data; pass --force"):
        prepare([tsv / "a.tsv"], out, config)
    assert prepare([tsv / "a.tsv"], out, config, force=True).rows == 5_500
    assert prepared.read_manifest(out).rows == 5_500 and not list(tmp_path.glob("prep.*"))
    result = CliRunner().invoke(app, ["data", "prepare", str(tsv / "a.tsv"), "--out", str(out)])
    assert result.exit_code == 2 and "pass --force" in result.output
    result = CliRunner().invoke(app, ["data", "prepare", str(tsv / "eval.tsv"), "--out", str(out), "--force"])
    assert result.exit_code == 0 and "3,000 rows" in result.output, result.output
    result = CliRunner().invoke(app, ["data", "prepare", str(tsv / "a.tsv"), str(tmp_path / "x.parquet"), "--out",
                                      str(tmp_path / "mixed")])
    assert result.exit_code == 2 and "Parquet and other files together" in result.output


def test_a_bad_line_under_bad_lines_error_stops_prepare_naming_it(tsv, tmp_path):
    config = from_dict({"data": {"train": [str(tsv / "b.tsv")], "bad_lines": "error"}})
    with pytest.raises(ValueError, match=r"b.tsv:11: "):
        prepare([tsv / "b.tsv"], tmp_path / "prep", config)
    assert not list(tmp_path.iterdir())  # nothing left behind: neither the directory nor a partial one


def test_the_benchmark_reads_both_ways(tsv, tmp_path):
    from benchmarks.prepared import bench

    result = bench(tsv / "a.tsv", tmp_path, 1000)
    assert result["rows"] == 5_500 and result["prepare"]["prepared_bytes"] > 0
    for what in ("read", "frames"):
        assert result[what]["tsv"]["rows"] == result[what]["prepared"]["rows"] == 5_500


def test_the_data_loader_refuses_bad_prepared_data_before_serving(tsv, tmp_path):
    (tmp_path / "empty.prep").mkdir()
    config = tmp_path / "config.yaml"
    config.write_text(json.dumps({"data": {"train": [str(tmp_path / "empty.prep")]}}))
    result = subprocess.run([sys.executable, "-m", "hybridrec", "serve", "dataloader", "--config", str(config),
                             "--replica", "0"], cwd=REPO, capture_output=True, text=True, timeout=120,
                            env={**os.environ, "PYTHONPATH": str(REPO)})
    assert result.returncode == 2, result.stderr[-2000:]
    assert "empty.prep/manifest.json: no manifest" in result.stderr


def test_empty_and_all_bad_files_become_empty_shards(tsv, tmp_path):
    (tmp_path / "bad.tsv").write_text("garbage\nmore garbage\n")
    (tmp_path / "empty.tsv").write_text("")
    sources = [tmp_path / "bad.tsv", tmp_path / "empty.tsv", tsv / "eval.tsv"]
    manifest = prepare(sources, tmp_path / "prep", _tsv_config(sources, []))
    assert [(s.rows, s.bad_lines) for s in manifest.shards] == [(0, 2), (0, 0), (3_000, 0)]
    counts_raw, counts_prep = ReadCounters(), ReadCounters()
    a = list(train_batches(_tsv_config(sources, []), counts_raw))
    b = list(train_batches(_tsv_config([tmp_path / "prep"], []), counts_prep))
    assert len(a) == len(b) == 3 and vars(counts_raw) == vars(counts_prep)
    assert [p.file for _, p in b] == [2, 2, 2]
    for (ra, _), (rb, _) in zip(a, b):
        _same_batch(ra, rb)
    prepared.verify(tmp_path / "prep")


def test_preflight_still_names_a_missing_raw_file_and_accepts_prepared_data(tsv, tmp_path):
    with pytest.raises(ConfigError, match=r"data.eval: data file not found: .*nope.tsv"):
        preflight(_tsv_config([tsv / "train.prep"], [tmp_path / "nope.tsv"]))
    preflight(_tsv_config([tsv / "train.prep"], [tsv / "eval.prep"]))
    preflight(_tsv_config([tsv / "train.prep"], [tsv / "eval.tsv"]))  # each list is one kind; train and eval may differ
