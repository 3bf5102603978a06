"""From training to predictions: a run, `hybridrec export` (float32, and `--quantize int8`), then `hybridrec serve
inference` answers the eval file exactly as the exported model does offline — over gRPC and REST, from its own
table and from two read-only PS shards serving the bundle."""
from __future__ import annotations

import asyncio
import subprocess

import numpy as np
import pytest

from hybridrec.core.runtime import rpc
from hybridrec.core.config import load_config
from hybridrec.app.run.ports import free_port
from tests.conftest import HYBRIDREC, REPO
from tests.integration.test_export_e2e import predict
from tests.integration.test_inference import MODEL, Server, _probs

pytestmark = pytest.mark.integration
ATOL = 1e-5
CHUNK = 500


def _eval_rows(path) -> list[str]:
    """The eval file's lines without their label column: what a client sends."""
    return [line.split("\t", 1)[1] for line in path.read_text().splitlines()]


def _served(server: Server, rows: list[str]) -> tuple[np.ndarray, np.ndarray]:
    """Predictions for every row, over gRPC and over REST, CHUNK rows a request."""
    grpc_out, rest_out = [], []
    for start in range(0, len(rows), CHUNK):
        chunk = rows[start:start + CHUNK]
        grpc_out.append(_probs(server.infer_grpc({"rows": chunk})).reshape(-1))
        status, body = server.post(f"/v2/models/{MODEL}/infer", {"inputs": [
            {"name": "rows", "datatype": "BYTES", "shape": [len(chunk)], "data": chunk}]})
        assert status == 200, body
        rest_out.append(np.asarray(body["outputs"][0]["data"], np.float32).reshape(-1))
    return np.concatenate(grpc_out), np.concatenate(rest_out)


@pytest.fixture(scope="module", params=["float32", "int8"])
def exported(request, exported_run, tmp_path_factory):
    """The shared exported run (tests/integration/conftest.py) as a float32 bundle and as an int8 one (`export
    --quantize int8`), its eval rows as a client sends them, and the bundle's own offline predictions of them."""
    data, tmp = exported_run.data, tmp_path_factory.mktemp("serving-e2e")
    bundle = exported_run.bundle
    if request.param == "int8":
        bundle = tmp / "int8"
        subprocess.run(HYBRIDREC + ["export", str(exported_run.run_dir), "--out", str(bundle), "--quantize", "int8"],
                       cwd=REPO, check=True, capture_output=True, timeout=300)
    offline, _ = predict(bundle, [str(data / "eval.tsv")], load_config(exported_run.config))
    return tmp, bundle, _eval_rows(data / "eval.tsv"), offline


def test_served_predictions_equal_offline_ones_from_the_in_process_table(exported):
    tmp, bundle, rows, offline = exported
    server = Server(bundle, tmp / "inference.log")
    try:
        over_grpc, over_rest = _served(server, rows)
    finally:
        server.stop()
    assert over_grpc.shape == over_rest.shape == offline.shape == (10_000,)
    assert np.abs(over_grpc - offline).max() <= ATOL and np.abs(over_rest - offline).max() <= ATOL


def test_served_predictions_equal_offline_ones_from_two_read_only_ps_shards(exported):
    tmp, bundle, rows, offline = exported
    addresses = [f"127.0.0.1:{free_port()}" for _ in range(2)]
    shards = [subprocess.Popen(HYBRIDREC + ["serve", "embedding_ps", "--bundle", str(bundle), "--replica", str(i),
                                            "--listen", address], cwd=REPO, stdout=subprocess.DEVNULL,
                               stderr=open(tmp / f"ps-{i}.log", "w")) for i, address in enumerate(addresses)]
    server = None
    try:
        asyncio.run(rpc.wait_until_serving(addresses, timeout_s=300, what="read-only PS shards"))
        server = Server(bundle, tmp / "inference-ps.log", *sum((["--ps", a] for a in addresses), []))
        over_grpc, over_rest = _served(server, rows)
    finally:
        if server is not None:
            server.stop()
        for p in shards:
            p.terminate()
            p.wait(timeout=30)
    assert np.abs(over_grpc - offline).max() <= ATOL and np.abs(over_rest - offline).max() <= ATOL
