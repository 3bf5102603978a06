"""A freshly installed inference service compiles no kernel while it serves: its warm-up compiled every kernel
that a request of any form reaches (docs/serving.md#warm-up). Each model is served with an empty numba cache, is
sent requests of every form, each ID datatype, raw and as typed contents, over gRPC and REST, and its log must
show no compilation after it turned ready."""
from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import numpy as np
import pytest

from hybridrec.core.config import FeatureKind
from hybridrec.core.wire.proto import grpc_predict_v2_pb2 as oip
from tests.conftest import REPO
from tests.inference_util import criteo_lines, make_bundle, make_config_bundle, tokens_for
from tests.integration.test_inference import MODEL, Server

pytestmark = pytest.mark.integration
ID_FIELDS = {"INT64": ("int64_contents", np.int64), "INT32": ("int_contents", np.int32),
             "UINT64": ("uint64_contents", np.uint64)}


class ColdServer(Server):
    """`hybridrec serve inference` with a numba cache directory of its own, empty at start."""

    def __init__(self, bundle: Path, tmp: Path, *extra: str):
        # every kernel compiles from nothing before the model is ready: up to a minute on a busy 2-vCPU machine
        super().__init__(bundle, tmp / "inference.log", *extra,
                         env={**os.environ, "NUMBA_CACHE_DIR": str(tmp / "numba-cache")}, ready_s=240)

    def over_grpc(self, inputs: list[tuple[str, str, object]], raw: bool) -> np.ndarray:
        """Probabilities for `inputs`: (name, datatype, numpy array or list of bytes)."""
        request = oip.ModelInferRequest(model_name=MODEL)
        for name, datatype, value in inputs:
            t = request.inputs.add(name=name, datatype=datatype, shape=[len(value)] if datatype == "BYTES"
                                   else list(np.shape(value)))
            if datatype == "BYTES":
                if raw:
                    request.raw_input_contents.append(b"".join(struct.pack("<I", len(v)) + v for v in value))
                else:
                    t.contents.bytes_contents.extend(value)
            elif raw:
                request.raw_input_contents.append(np.ascontiguousarray(value).tobytes())
            else:
                field = "fp32_contents" if datatype == "FP32" else ID_FIELDS[datatype][0]
                getattr(t.contents, field).extend(np.asarray(value).reshape(-1).tolist())
        response = self.call("ModelInfer", request, oip.ModelInferResponse)
        return np.frombuffer(response.raw_output_contents[0], np.float32)

    def over_rest(self, inputs: list[tuple[str, str, object]]) -> dict:
        status, reply = self.post(f"/v2/models/{MODEL}/infer", {"inputs": [
            {"name": name, "datatype": datatype,
             "shape": [len(value)] if datatype == "BYTES" else list(np.shape(value)),
             "data": [v.decode() for v in value] if datatype == "BYTES" else np.asarray(value).reshape(-1).tolist()}
            for name, datatype, value in inputs]})
        assert status == 200, reply
        return reply

    def events(self) -> list[str]:
        return [json.loads(line).get("event", "") for line in self.log.read_text().splitlines()
                if line.startswith("{")]


def _assert_nothing_compiled(server: ColdServer, answered: int) -> None:
    events = server.events()
    assert "model_loaded" in events, server.log.read_text()[-4000:]
    late = [line for line in server.log.read_text().splitlines()
            if "kernel_compiled_while_serving" in line or "warm_up_probe_failed" in line]
    assert not late, "\n".join(late)
    assert answered > 0


def test_the_readme_model_compiles_nothing_while_serving_rows_ids_and_names(tmp_path):
    bundle = tmp_path / "criteo"
    tokens = tokens_for()
    make_bundle(bundle, hidden=[16], rows_per_feature=50, num_shards=2, tokens=tokens)
    server = ColdServer(bundle, tmp_path)
    try:
        lines = [line.encode() for line in criteo_lines(tokens, 3)]
        labelled = [line.encode() for line in criteo_lines(tokens, 2, label=True)]
        ids = np.array([[(f << 56) | (7 + f) for f in range(26)]] * 2, np.uint64)
        dense = np.ones((2, 13), np.float32)
        answered = 0
        for raw in (True, False):
            for rows in (lines, labelled):
                assert server.over_grpc([("rows", "BYTES", rows)], raw).shape == (len(rows),)
                answered += 1
            for datatype in ("UINT64", "INT64"):
                probs = server.over_grpc([("ids", datatype, ids.view(ID_FIELDS[datatype][1])),
                                     ("dense", "FP32", dense)], raw)
                assert probs.shape == (2,) and np.isfinite(probs).all()
                answered += 1
        reply = server.over_rest([("rows", "BYTES", lines)])
        assert len(reply["outputs"][0]["data"]) == 3
        _assert_nothing_compiled(server, answered)
    finally:
        server.stop()


@pytest.mark.parametrize("compile_dense", [True, False], ids=["onnx", "eager"])
def test_the_multitask_model_compiles_nothing_while_serving_each_datatype_by_name(tmp_path, compile_dense):
    bundle = tmp_path / "mmoe"
    manifest = make_config_bundle(bundle, REPO / "examples/multitask_parquet.yaml", vocabulary=100)
    server = ColdServer(bundle, tmp_path, "--set", f"compile_dense={str(compile_dense).lower()}")
    try:
        lists = {f.name for f in manifest.features if f.kind == FeatureKind.LIST}
        answered = 0
        for datatype in ("INT64", "INT32", "UINT64", "BYTES"):
            for raw in (True, False):
                inputs: list[tuple[str, str, object]] = [("dense", "FP32", np.zeros((2, manifest.num_dense),
                                                                                   np.float32))]
                for f in manifest.features:
                    count = 5 if f.name in lists else 2
                    values = ([str(v).encode() for v in range(1, count + 1)] if datatype == "BYTES"
                              else np.arange(1, count + 1).astype(ID_FIELDS[datatype][1]))
                    inputs.append((f.name, datatype, values))
                    if f.name in lists:
                        inputs.append((f.name + "__lengths", "INT64", np.array([2, 3], np.int64)))
                probs = server.over_grpc(inputs, raw)
                assert probs.shape == (4,) and np.isfinite(probs).all()  # two samples, two tasks
                answered += 1
        _assert_nothing_compiled(server, answered)
    finally:
        server.stop()
