"""Several data loaders: each reads its own split of the data (services/dataloader/splits.py), the splits
together read every sample exactly once, and a layout the data cannot give every loader a share of is refused
naming cluster.dataloader."""
from __future__ import annotations

import gzip
import random
import shutil

import numpy as np
import pytest

from hybridrec.core.layouts import checkpoints
from hybridrec.core.layouts.checkpoints import JobManifest
from hybridrec.core.config import ConfigError, from_dict
from services.dataloader import splits
from services.dataloader.batching import ReadCounters
from services.dataloader.sources import check_splits, eval_rows, split, train_batches


def _lines_of(data: bytes, part: splits.Part | None) -> list[bytes]:
    if part is None:
        return []
    chunk = data[part.start:len(data) if part.stop is None else part.stop]
    return chunk.splitlines(keepends=True)


@pytest.mark.parametrize("seed", range(12))
def test_byte_ranges_hold_every_line_once_across_loaders_and_file_sizes(tmp_path, seed):
    rng = random.Random(seed)
    paths, sizes, lines = [], [], []
    for f in range(rng.randint(1, 4)):
        count = rng.choice([0, 1, 2, 3, rng.randint(4, 400)])
        body = [b"x" * rng.choice([0, 1, 5, rng.randint(6, 3000)]) + b"\n" for _ in range(count)]
        if body and rng.random() < 0.3:
            body[-1] = body[-1][:-1] or b"y"  # the last line without its newline
        path = tmp_path / f"f{f}.tsv"
        path.write_bytes(b"".join(body))
        paths.append(str(path))
        sizes.append(path.stat().st_size)
        lines.append(body)
    for loaders in range(1, 9):
        seen = [[] for _ in paths]
        for loader in range(loaders):
            parts = splits.tsv_split(paths, [False] * len(paths), sizes, loader, loaders)
            for f, part in enumerate(parts):
                if part is not None:
                    assert part.start == 0 or lines[f] and (tmp_path / f"f{f}.tsv").read_bytes()[part.start - 1] == 10
                    assert part.stop is None or part.start < part.stop < sizes[f]
                seen[f] += _lines_of((tmp_path / f"f{f}.tsv").read_bytes(), part)
        assert seen == lines, loaders  # every line once, in order, each wholly in one loader's range


def test_byte_ranges_are_nearly_equal_and_cut_few_files(tmp_path):
    paths, sizes = [], []
    for f in range(6):
        path = tmp_path / f"f{f}.tsv"
        path.write_bytes(b"".join(b"%06d\n" % i for i in range(1000)))  # 7,000 bytes each
        paths.append(str(path))
        sizes.append(path.stat().st_size)
    shares = []
    for loader in range(4):
        parts = splits.tsv_split(paths, [False] * 6, sizes, loader, 4)
        shares.append(sum((s if p.stop is None else p.stop) - p.start for p, s in zip(parts, sizes) if p))
        assert sum(p is not None for p in parts) <= 3  # 1.5 files each: at most 3 touched
    assert sum(shares) == sum(sizes) and max(shares) - min(shares) <= 7  # within one line


def test_gzip_files_go_whole_to_one_loader_each(tmp_path):
    paths = [str(tmp_path / f"{i}.tsv.gz") for i in range(5)]
    parts = [splits.tsv_split(paths, [True] * 5, [1] * 5, loader, 2) for loader in range(2)]
    assert parts[0] == (splits.WHOLE, None, splits.WHOLE, None, splits.WHOLE)
    assert parts[1] == (None, splits.WHOLE, None, splits.WHOLE, None)


@pytest.mark.parametrize("rows", [[10], [0, 7, 0, 3], [1, 1, 1], [5, 0], [0], [100, 3, 64]])
def test_prepared_row_ranges_hold_every_row_once_and_every_shard_end_once(rows):
    for loaders in range(1, 7):
        covered = [np.zeros(n, int) for n in rows]
        ends = [0] * len(rows)
        for loader in range(loaders):
            for shard, part in enumerate(splits.row_split(rows, loader, loaders)):
                if part is None:
                    continue
                covered[shard][part.start:part.stop] += 1
                ends[shard] += part.stop == rows[shard]  # the loader that counts the shard's bad lines
        assert all((c == 1).all() for c in covered) and ends == [1] * len(rows), (loaders, ends)
        if sum(rows) >= loaders:  # every loader gets rows
            assert all(any(p and p.stop > p.start for p in splits.row_split(rows, loader, loaders))
                       for loader in range(loaders))


@pytest.mark.parametrize("groups", [[[10, 10, 10, 10]], [[5], [1, 1, 1, 100], [7, 7]], [[3, 3], [3]],
                                    [[0, 9], [9, 0, 9]]])
def test_parquet_row_group_ranges_are_contiguous_hold_every_group_once_and_one_at_least(groups):
    total = sum(len(g) for g in groups)
    for loaders in range(1, total + 3):
        owner = {}
        for loader in range(loaders):
            parts = splits.group_split(groups, loader, loaders)
            mine = [(f, g) for f, part in enumerate(parts) if part for g in range(part.start, part.stop)]
            assert mine or loaders > total  # one group at least while they last
            flat = [sum(len(x) for x in groups[:f]) + g for f, g in mine]
            assert flat == list(range(flat[0], flat[0] + len(flat))) if flat else True  # contiguous
            for key in mine:
                assert key not in owner
                owner[key] = loader
        assert len(owner) == total


def test_parquet_row_groups_are_balanced_by_rows():
    groups = [[100] * 30]
    shares = [sum(p.stop - p.start for p in splits.group_split(groups, l, 3) if p) for l in range(3)]
    assert shares == [10, 10, 10]


def _config(train, eval_=(), loaders=3, **data):
    return from_dict({"data": {"train": [str(p) for p in train], "eval": [str(p) for p in eval_], **data},
                      "training": {"batch_size": 1000},
                      "cluster": {"dataloader": ["127.0.0.1:0"] * loaders}})


def _read_all(config, loaders):
    """Every loader's training batches and eval rows, as label arrays, with their counters."""
    train, evaluation, counts = [], [], []
    for loader in range(loaders):
        c = ReadCounters()
        train.append([b for b, _ in train_batches(config, c, loader=loader)])
        evaluation.append(list(eval_rows(config, ReadCounters(), loader=loader)))
        counts.append(c)
    return train, evaluation, counts


def _labels_and_ids(rows_lists):
    flat = [r for rows in rows_lists for r in rows]
    return np.concatenate([r.labels for r in flat]), np.concatenate([r.bags.values for r in flat])


def _samples(rows_lists) -> np.ndarray:
    """Every sample (label, dense values, sum of its IDs) as a row, sorted: the multiset of samples read."""
    flat = [r for rows in rows_lists for r in rows]
    ids = [np.bincount(np.repeat(np.tile(np.arange(len(r)), r.bags.lengths.shape[0]), r.bags.lengths.ravel()),
                       weights=(r.bags.values % 1_000_003).astype(np.float64), minlength=len(r)) for r in flat]
    table = np.column_stack([np.concatenate([r.labels for r in flat]), np.concatenate([r.dense for r in flat]),
                             np.concatenate(ids)])
    return table[np.lexsort(table.T[::-1])]


@pytest.mark.parametrize("loaders", [2, 3, 5])
def test_tsv_loaders_read_every_sample_once_and_resume_inside_their_split(small_data, tmp_path, loaders):
    shutil.copy(small_data / "train.tsv", tmp_path / "a.tsv")
    with open(small_data / "train.tsv", "rb") as src, gzip.open(tmp_path / "b.tsv.gz", "wb") as dst:
        dst.write(src.read()[:400_000])  # a gzip file among plain ones: whole, to one loader
    files = [tmp_path / "a.tsv", tmp_path / "b.tsv.gz", small_data / "eval.tsv"]
    one = _config(files, [small_data / "eval.tsv"], loaders=1)
    many = _config(files, [small_data / "eval.tsv"], loaders=loaders)
    (whole,), (whole_eval,), (count,) = _read_all(one, 1)
    parts, parts_eval, counts = _read_all(many, loaders)
    # The loaders together read the samples one loader reads, each once
    np.testing.assert_array_equal(_samples([whole]), _samples(parts))
    np.testing.assert_array_equal(_samples([whole_eval]), _samples(parts_eval))
    assert sum(c.rows for c in counts) == count.rows and sum(c.bad_lines for c in counts) == count.bad_lines
    assert min(sum(len(b) for b in p) for p in parts) > 0
    # A loader resumed at a position inside its split reads on to its split's end, not into the next one
    loader = loaders // 2
    full = list(train_batches(many, ReadCounters(), loader=loader))
    cut = len(full) // 2
    resumed = list(train_batches(many, ReadCounters(), start=full[cut - 1][1], loader=loader))
    assert len(resumed) == len(full) - cut
    for (a, pa), (b, pb) in zip(full[cut:], resumed):
        np.testing.assert_array_equal(a.labels, b.labels)
        assert pa == pb


def test_prepared_loaders_read_every_sample_once(small_data, tmp_path):
    from services.dataloader.prepared_write import prepare

    config = _config([small_data / "train.tsv"], loaders=1)
    prepare([small_data / "train.tsv", small_data / "eval.tsv"], tmp_path / "prep", config)
    (whole,), _, (count,) = _read_all(_config([tmp_path / "prep"], loaders=1), 1)
    parts, _, counts = _read_all(_config([tmp_path / "prep"], loaders=4), 4)
    for a, b in zip(_labels_and_ids([whole]), _labels_and_ids(parts)):
        np.testing.assert_array_equal(a, b)
    assert sum(c.rows for c in counts) == count.rows == 80_000
    assert all(len(p) for p in parts)


def test_parquet_loaders_read_every_sample_once(small_data, tmp_path):
    from hybridrec.app.data.parquet_data import tsv_to_parquet

    tsv_to_parquet(small_data / "train.tsv", tmp_path / "a.parquet", row_group_rows=7_000)
    tsv_to_parquet(small_data / "eval.tsv", tmp_path / "b.parquet", row_group_rows=7_000)
    files = [tmp_path / "a.parquet", tmp_path / "b.parquet"]
    (whole,), _, _ = _read_all(_config(files, loaders=1, format="parquet"), 1)
    parts, _, counts = _read_all(_config(files, loaders=3, format="parquet"), 3)
    for a, b in zip(_labels_and_ids([whole]), _labels_and_ids(parts)):
        np.testing.assert_array_equal(a, b)
    assert sum(c.rows for c in counts) == 80_000 and all(len(p) for p in parts)


def test_a_layout_the_data_cannot_give_every_loader_a_share_of_is_refused_naming_the_key(small_data, tmp_path):
    gz = []
    for i in range(2):
        gz.append(tmp_path / f"{i}.tsv.gz")
        with open(small_data / "eval.tsv", "rb") as src, gzip.open(gz[-1], "wb") as dst:
            dst.write(src.read())
    check_splits(_config(gz, loaders=2))  # one each: fine
    with pytest.raises(ConfigError, match=r"^cluster\.dataloader: 3 data loaders, but data\.train holds 2 gzip "
                                          r"files .* loader 2 would read nothing"):
        check_splits(_config(gz, loaders=3))
    check_splits(_config([small_data / "eval.tsv"], loaders=8))  # a plain file is cut at any line
    check_splits(_config([*gz, small_data / "eval.tsv"], loaders=8))  # ... and so feeds the loaders without gzip
    # eval data is split the same way, but a loader without any just ends the phase
    assert split(_config([small_data / "eval.tsv"], gz, loaders=3), "data.eval", 2) == (None, None)

    from hybridrec.app.data.parquet_data import tsv_to_parquet

    tsv_to_parquet(small_data / "eval.tsv", tmp_path / "e.parquet", row_group_rows=10_000)  # 2 row groups
    with pytest.raises(ConfigError, match=r"^cluster\.dataloader: .*2 Parquet row groups"):
        check_splits(_config([tmp_path / "e.parquet"], loaders=3, format="parquet"))

    from services.dataloader.prepared_write import prepare

    tiny = tmp_path / "tiny.tsv"
    tiny.write_bytes(b"".join((small_data / "eval.tsv").read_bytes().splitlines(keepends=True)[:2]))
    prepare([tiny], tmp_path / "tiny.prep", _config([tiny], loaders=1))
    with pytest.raises(ConfigError, match=r"^cluster\.dataloader: .*2 prepared rows"):
        check_splits(_config([tmp_path / "tiny.prep"], loaders=3))


def test_the_cli_refuses_before_starting_anything(small_data, tmp_path):
    """`hybridrec run` (and `check`) refuse the layout in their preflight, naming the key: no service starts."""
    import subprocess

    import yaml

    from tests.conftest import HYBRIDREC, REPO

    gz = tmp_path / "a.tsv.gz"
    with open(small_data / "eval.tsv", "rb") as src, gzip.open(gz, "wb") as dst:
        dst.write(src.read())
    config = tmp_path / "c.yaml"
    config.write_text(yaml.safe_dump({"data": {"train": [str(gz)]}}))
    out = subprocess.run(HYBRIDREC + ["run", str(config), "--run-dir", str(tmp_path / "run"), "--set",
                                      'cluster.dataloader=["127.0.0.1:0","127.0.0.1:0"]'],
                         cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "cluster.dataloader: 2 data loaders, but data.train holds 1 gzip file" \
        in out.stderr, out.stderr
    assert not (tmp_path / "run" / "logs").is_dir() or not list((tmp_path / "run" / "logs").glob("dataloader-*"))


def test_cluster_dataloader_takes_several_addresses():
    config = from_dict({"data": {"train": ["t.tsv"]},
                        "cluster": {"dataloader": ["10.0.0.1:7000", "10.0.0.2:7000", "10.0.0.3:7000"]}})
    assert len(config.cluster.dataloader) == 3
    with pytest.raises(ConfigError, match="cluster.dataloader needs at least one address"):
        from_dict({"data": {"train": ["t.tsv"]}, "cluster": {"dataloader": []}})


def test_a_checkpoint_resumes_only_with_its_number_of_loaders_and_an_old_one_as_one(tmp_path):
    old = JobManifest(step=7, seq=14, position=[0, 0, 100, 14])  # the single-loader layout: no `loaders`
    checkpoints.write_manifest(tmp_path, old)
    loaded = checkpoints.read_manifest(tmp_path)
    assert loaded.streams() == [(14, [0, 0, 100, 14])]
    checkpoints.check_loaders(tmp_path, loaded, 1)
    with pytest.raises(ConfigError, match=r"^cluster\.dataloader: checkpoint .* 1 data loader, this one has 3"):
        checkpoints.check_loaders(tmp_path, loaded, 3)
    new = JobManifest.of_streams([(4, [0, 0, 10, 5]), (6, [0, 1, 20, 7]), (0, [0, 0, 0, 0])], step=5)
    checkpoints.write_manifest(tmp_path, new)
    loaded = checkpoints.read_manifest(tmp_path)
    assert loaded.streams() == [(4, [0, 0, 10, 5]), (6, [0, 1, 20, 7]), (0, [0, 0, 0, 0])]
    assert loaded.seq == 10 and loaded.position == [0, 0, 10, 5]
    checkpoints.check_loaders(tmp_path, loaded, 3)
    with pytest.raises(ConfigError, match="cluster.dataloader: .* 3 data loaders, this one has 1"):
        checkpoints.check_loaders(tmp_path, loaded, 1)
