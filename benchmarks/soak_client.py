"""The soak's steady Open Inference Protocol client (benchmarks/soak.py): a process of its own that sends the
drift probe rows to `hybridrec serve inference` over gRPC (ModelInfer) by feature name — scalar IDs, the
multi-hot `tags` and the `hist_cats` sequence as flat values plus NAME__lengths, the dense columns as one FP32
matrix — at a steady rate, and times every answer.

Request k holds row k of every probe item (the drifted items', then the control items'), so PROBE_ROWS_PER_ID
consecutive requests cover every probe row once: the served level of an item over such a cycle is the mean
of its rows' answers, comparable with the planted level in oracle.json. Requests are serialized once, up front;
the client does nothing but send, wait and record, so what it times is the service.

    python benchmarks/soak_client.py --grpc 127.0.0.1:8001 --model soak --probes DIR/drift_probes.parquet \
        --config job.yaml --rps 50 --stop STOPFILE --out answers.npz

It runs until STOPFILE exists, then writes OUT: per request sent, its scheduled and sent wall time, the seconds
to its answer, the request index, the version that answered (-1: an error) and the probabilities (rows, tasks);
the errors' texts as `errors`.
"""
from __future__ import annotations

import argparse
import struct
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

LENGTHS_SUFFIX = "__lengths"  # services/inference/inputs.py: a list feature's per-sample counts


def probe_requests(probes: Path, config, rows_per_id: int) -> tuple[list[list[tuple[str, str, list[int], bytes]]],
                                                                   np.ndarray]:
    """Request k's named tensors (name, datatype, shape, raw bytes) for k < rows_per_id, and the probe-table row
    of each (request, position) as (rows_per_id, items) indices."""
    import pyarrow as pa
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    from hybridrec.core.config import FeatureKind

    table = pq.read_table(probes)
    items = table.num_rows // rows_per_id
    index = np.arange(items)[None, :] * rows_per_id + np.arange(rows_per_id)[:, None]
    out = []
    for k in range(rows_per_id):
        part = table.take(pa.array(index[k]))
        n = part.num_rows
        dense = np.stack([part[c].to_numpy().astype(np.float32) for c in config.dense_columns], 1)
        tensors = [("dense", "FP32", [n, dense.shape[1]], dense.tobytes())]
        for feature in config.features:
            column = part[feature.source].combine_chunks()
            if feature.kind == FeatureKind.LIST:
                flat = pc.list_flatten(column)
                rows_of = pc.list_parent_indices(column).to_numpy()
                valid = flat.is_valid().to_numpy(zero_copy_only=False)
            else:
                flat, rows_of = column, np.arange(len(column))
                valid = column.is_valid().to_numpy(zero_copy_only=False)
            values = flat.filter(pa.array(valid))
            lengths = np.bincount(rows_of[valid], minlength=n).astype(np.int64)
            if pa.types.is_integer(values.type):
                raw = pc.cast(values, pa.int64()).to_numpy().astype(np.int64)
                tensors.append((feature.name, "INT64", [len(raw)], raw.tobytes()))
            else:
                raw = b"".join(struct.pack("<I", len(v)) + v for v in (s.encode() for s in values.to_pylist()))
                tensors.append((feature.name, "BYTES", [len(values)], raw))
            if feature.kind == FeatureKind.LIST or not valid.all():
                tensors.append((feature.name + LENGTHS_SUFFIX, "INT64", [n], lengths.tobytes()))
        out.append(tensors)
    return out, index


def serialize(model: str, tensors) -> bytes:
    from hybridrec.core.wire.proto import grpc_predict_v2_pb2 as oip

    request = oip.ModelInferRequest(model_name=model)
    for name, datatype, shape, raw in tensors:
        request.inputs.add(name=name, datatype=datatype, shape=shape)
        request.raw_input_contents.append(raw)
    return request.SerializeToString()


def main() -> None:
    import grpc

    from hybridrec.core.config import load_config
    from hybridrec.core.wire.proto import grpc_predict_v2_pb2 as oip

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--grpc", required=True)
    parser.add_argument("--model", required=True)
    parser.add_argument("--probes", type=Path, required=True)
    parser.add_argument("--config", type=Path, required=True)
    parser.add_argument("--rows-per-id", type=int, default=100)
    parser.add_argument("--rps", type=float, default=50.0)
    parser.add_argument("--stop", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    config = load_config(args.config, [])
    tensors, _ = probe_requests(args.probes, config, args.rows_per_id)
    wire = [serialize(args.model, t) for t in tensors]
    rows = tensors[0][0][2][0]  # the dense matrix's: one row per probe item
    scheduled, sent, seconds, which, versions, probs, errors = [], [], [], [], [], [], []
    with grpc.insecure_channel(args.grpc) as channel:
        infer = channel.unary_unary("/inference.GRPCInferenceService/ModelInfer",
                                    request_serializer=lambda raw: raw,
                                    response_deserializer=oip.ModelInferResponse.FromString)
        start, i = time.time(), 0
        tasks = config.num_tasks
        while not args.stop.exists():
            due = start + i / args.rps
            wait = due - time.time()
            if wait > 0:
                time.sleep(wait)
            k = i % len(wire)
            t0 = time.perf_counter()
            wall = time.time()
            try:
                response = infer(wire[k], timeout=10)
                elapsed = time.perf_counter() - t0
                answer = np.frombuffer(response.raw_output_contents[0], np.float32).reshape(rows, tasks)
                version = int(response.model_version)
            except grpc.RpcError as exc:
                elapsed = time.perf_counter() - t0
                answer, version = np.full((rows, tasks), np.nan, np.float32), -1
                errors.append(f"{wall:.3f} {exc.code()}: {exc.details()}")
            scheduled.append(due)
            sent.append(wall)
            seconds.append(elapsed)
            which.append(k)
            versions.append(version)
            probs.append(answer)
            i += 1
    np.savez(args.out, scheduled=np.array(scheduled), sent=np.array(sent), seconds=np.array(seconds),
             request=np.array(which, np.int32), version=np.array(versions, np.int64),
             probs=np.stack(probs) if probs else np.zeros((0, rows, config.num_tasks), np.float32),
             errors=np.array(errors, dtype=str))


if __name__ == "__main__":
    main()
