"""Shared by the inference tests and benchmarks/serving.py: a random bundle and a reference forward pass."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from hybridrec.core.layouts.bundle import (FORMAT_VERSION, QUANTIZED_FORMAT_VERSION, BundleManifest, BundleWriter,
                              EmbeddingTable,
                              load_dense, open_bundle)
from hybridrec.core.config import FeatureConfig, ModelConfig
from hybridrec.core.wire.ids import GROUP_SHIFT
from hybridrec.core.model.models import FeatureInfo, build_model
from hybridrec.core.wire.sharding import shard_of


def make_bundle(out: Path, *, num_features: int = 26, dim: int = 16, rows_per_feature: int = 200,
                hidden=(32, 16), num_shards: int = 2, version: int = 3, seed: int = 0,
                tokens: dict[int, list[str]] | None = None, quantization: str | None = None
                ) -> tuple[BundleManifest, dict[int, np.ndarray]]:
    """A bundle of a DNN with random weights and random rows; returns it and the known IDs per feature.

    `tokens`: feature index -> Criteo tokens whose hashed IDs get rows too (for raw-row tests). `quantization`:
    "int8" writes quantized tables.
    """
    from hybridrec.core.layouts.criteo_kernels import hash_token

    rng = np.random.default_rng(seed)
    torch.manual_seed(seed)
    features = [FeatureConfig(name=f"C{i + 1}", group=i, dim=dim) for i in range(num_features)]
    model_cfg = ModelConfig(path="hybridrec.models:DNN", kwargs={"hidden": list(hidden)})
    manifest = BundleManifest(version=version, step=10, features=features, num_dense=13, model=model_cfg,
                              num_shards=num_shards, quantization=quantization,
                              format_version=QUANTIZED_FORMAT_VERSION if quantization else FORMAT_VERSION)
    model = build_model(model_cfg.path, [FeatureInfo(f.name, f.dim) for f in features], 13, model_cfg.kwargs)
    known: dict[int, np.ndarray] = {}
    all_ids = []
    for i in range(num_features):
        ids = (np.uint64(i) << np.uint64(GROUP_SHIFT)) | rng.integers(1, 1 << 56, rows_per_feature, dtype=np.uint64)
        extra = [hash_token(t, i) for t in (tokens or {}).get(i, [])]
        ids = np.unique(np.concatenate([ids, np.array(extra, np.uint64)]))
        known[i] = ids
        all_ids.append(ids)
    ids = np.concatenate(all_ids)
    rows = rng.normal(0, 0.5, (ids.shape[0], dim)).astype(np.float32)
    writer = BundleWriter(out, manifest)
    writer.add_dense(model.state_dict())
    owner = shard_of(ids, num_shards)
    for s in range(num_shards):
        writer.add_table(s, dim, ids[owner == s], rows[owner == s])
    return writer.commit(), known


def random_ids(known: dict[int, np.ndarray], n: int, *, seed: int = 1, unknown: float = 0.2,
               absent: float = 0.1) -> np.ndarray:
    """(n, F) uint64 IDs: mostly known, some unknown (zeros), some absent (group << 56)."""
    rng = np.random.default_rng(seed)
    cols = []
    for f in sorted(known):
        col = rng.choice(known[f], n)
        unk = rng.random(n) < unknown
        col[unk] = (np.uint64(f) << np.uint64(GROUP_SHIFT)) | rng.integers(1, 1 << 56, int(unk.sum()), dtype=np.uint64)
        col[rng.random(n) < absent] = np.uint64(f) << np.uint64(GROUP_SHIFT)
        cols.append(col)
    return np.stack(cols, axis=1)


def reference(bundle: Path, ids: np.ndarray, dense: np.ndarray, present: np.ndarray | None = None) -> np.ndarray:
    """Probabilities computed without the service's code: per-feature rows (zeros when absent) and the model."""
    manifest, table = open_bundle(bundle)
    model = build_model(manifest.model.path, [FeatureInfo(f.name, f.dim) for f in manifest.features],
                        manifest.num_dense, manifest.model.kwargs)
    model.load_state_dict(load_dense(bundle))
    model.eval()
    if present is None:
        present = (ids & np.uint64((1 << GROUP_SHIFT) - 1)) != 0
    pooled = {}
    for f, feat in enumerate(manifest.features):
        rows = table.lookup(feat.dim, ids[:, f]) * present[:, f:f + 1]
        pooled[feat.name] = torch.from_numpy(rows.astype(np.float32))
    with torch.no_grad():
        return torch.sigmoid(model(torch.from_numpy(dense.astype(np.float32)), pooled)).numpy()


def criteo_lines(known_tokens: dict[int, list[str]], n: int, *, seed: int = 2, label: bool = False) -> list[str]:
    """Criteo TSV lines (without the label unless `label`) mixing known tokens, unknown ones and empty fields."""
    rng = np.random.default_rng(seed)
    lines = []
    for _ in range(n):
        ints = [str(int(v)) if rng.random() > 0.1 else "" for v in rng.integers(-3, 1000, 13)]
        cats = []
        for c in range(26):
            r = rng.random()
            if r < 0.1:
                cats.append("")
            elif r < 0.3 or not known_tokens.get(c):
                cats.append(f"{rng.integers(0, 1 << 32):08x}")
            else:
                cats.append(str(rng.choice(known_tokens[c])))
        fields = ([str(int(rng.random() < 0.5))] if label else []) + ints + cats
        lines.append("\t".join(fields))
    return lines


def tokens_for(num_features: int = 26, per_feature: int = 30, seed: int = 4) -> dict[int, list[str]]:
    rng = np.random.default_rng(seed)
    return {c: [f"{v:08x}" for v in rng.integers(0, 1 << 32, per_feature)] for c in range(num_features)}


class FakePS:
    """A tiny read-only PS shard for tests: answers EmbeddingPS.Lookup (PSLookup -> PSRows) from one bundle
    shard, as `hybridrec serve embedding_ps` does for train=False lookups. Runs a sync gRPC server in threads."""

    def __init__(self, bundle: Path, shard: int, *, fp16: bool = False):
        import grpc
        from concurrent import futures

        from hybridrec.core.layouts.bundle import ShardTable, read_manifest
        from hybridrec.core.wire.compress import ValueCodec
        from hybridrec.core.wire.frames import PSLookup, PSRows

        manifest = read_manifest(bundle)
        table = ShardTable(Path(bundle), manifest, shard)
        values = ValueCodec(fp16=fp16)
        self.calls = 0
        self.trains = 0

        def lookup(request: bytes, context) -> bytes:
            self.calls += 1
            req = PSLookup.decode(request, manifest.widths)
            self.trains += int(req.train)
            return PSRows({d: table.lookup(d, ids) for d, ids in req.ids.items()}).encode(values)

        handler = grpc.method_handlers_generic_handler(
            "hybridrec.EmbeddingPS", {"Lookup": grpc.unary_unary_rpc_method_handler(lookup)})
        self.server = grpc.server(futures.ThreadPoolExecutor(4))
        self.server.add_generic_rpc_handlers((handler,))
        from grpc_health.v1 import health, health_pb2, health_pb2_grpc

        status = health.HealthServicer()  # the inference service waits for its shards to report SERVING
        status.set("", health_pb2.HealthCheckResponse.SERVING)
        health_pb2_grpc.add_HealthServicer_to_server(status, self.server)
        port = self.server.add_insecure_port("127.0.0.1:0")
        self.address = f"127.0.0.1:{port}"
        self.server.start()

    def stop(self) -> None:
        self.server.stop(0)


def columns(samples) -> tuple[np.ndarray, np.ndarray]:
    """(ids (n, F), present (n, F)) of decoded inference `Samples` whose features are all scalar (a bag of at
    most one ID each): the column form `reference` and the TSV reader use."""
    return samples.bags.to_columns()  # refuses a bag of more than one ID


def make_config_bundle(out: Path, config_path: Path, *, vocabulary: int = 20_000, num_shards: int = 2,
                       seed: int = 0) -> BundleManifest:
    """A bundle of a job config's model (its features, tables and model; random weights) whose tables hold a
    row for every integer 0..vocabulary-1 of every feature group, hashed as the Parquet reader hashes integer
    IDs: requests by feature name with such integers find their rows."""
    from hybridrec.core.config import load_config
    from hybridrec.core.layouts.criteo_kernels import hash_ints
    from hybridrec.core.model.models import feature_infos

    config = load_config(config_path)
    rng = np.random.default_rng(seed)
    torch.manual_seed(seed)
    num_tasks = len(config.data.labels) if config.data.labels else 1
    manifest = BundleManifest(version=1, step=10, features=config.features, num_dense=config.num_dense,
                              num_tasks=num_tasks, model=config.model, num_shards=num_shards,
                              input_types={f.name: "INT64" for f in config.features},
                              dense_columns=list(config.data.dense_columns or []),
                              tasks=config.data.label_names if num_tasks > 1 else [],
                              heads=config.data.tasks)
    model = build_model(config.model.path, feature_infos(config.features), config.num_dense, config.model.kwargs,
                        num_tasks=num_tasks)
    writer = BundleWriter(out, manifest)
    writer.add_dense(model.state_dict())
    raw = np.arange(vocabulary, dtype=np.int64)
    for dim in sorted({f.dim for f in config.features}):
        groups = sorted({f.group for f in config.features if f.dim == dim})
        ids = np.empty(vocabulary * len(groups), np.uint64)
        for k, group in enumerate(groups):
            hash_ints(raw, np.uint64(group << GROUP_SHIFT), ids[k * vocabulary:(k + 1) * vocabulary])
        ids = np.unique(ids)
        rows = rng.normal(0, 0.5, (ids.shape[0], dim)).astype(np.float32)
        owner = shard_of(ids, num_shards)
        for s in range(num_shards):
            writer.add_table(s, dim, ids[owner == s], rows[owner == s])
    return writer.commit()
