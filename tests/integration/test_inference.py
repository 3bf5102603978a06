"""`hybridrec serve inference` as a real process: OIP over gRPC and REST, a stock client, bad input,
dynamic batching, remote read-only PS shards."""
from __future__ import annotations

import concurrent.futures
import json
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from hybridrec.app.run.ports import free_port
from hybridrec.core.wire.proto import grpc_predict_v2_pb2 as oip
from tests.conftest import HYBRIDREC, REPO
from tests.inference_util import FakePS, columns, criteo_lines, make_bundle, random_ids, reference, tokens_for

pytestmark = pytest.mark.integration
ATOL = 1e-5
MODEL = "ctr"


_free_port = free_port  # below the ephemeral range: no outgoing connection can take it first


class Server:
    def __init__(self, bundle: Path, log: Path, *extra: str, env: dict[str, str] | None = None,
                 ready_s: float = 90):
        self.grpc_port, self.http_port = _free_port(), _free_port()
        self.log = log
        self.proc = subprocess.Popen(
            HYBRIDREC + ["serve", "inference", "--bundle", str(bundle), "--set", f"model_name={MODEL}",
                         "--set", f"grpc_port={self.grpc_port}", "--set", f"http_port={self.http_port}", *extra],
            cwd=REPO, env=env, stdout=open(log, "w"), stderr=subprocess.STDOUT)
        self.grpc = f"127.0.0.1:{self.grpc_port}"
        self.http = f"127.0.0.1:{self.http_port}"
        deadline = time.monotonic() + ready_s
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, log.read_text()
            try:
                if self.get("/v2/health/ready")[0] == 200:
                    break
            except OSError:
                pass
            time.sleep(0.2)
        else:
            raise TimeoutError(log.read_text())
        self.channel = grpc.insecure_channel(self.grpc)

    def call(self, method: str, request, response_cls):
        fn = self.channel.unary_unary(f"/inference.GRPCInferenceService/{method}",
                                      request_serializer=lambda m: m.SerializeToString(),
                                      response_deserializer=response_cls.FromString)
        return fn(request, timeout=30)

    def get(self, path: str) -> tuple[int, dict]:
        try:
            with urllib.request.urlopen(f"http://{self.http}{path}", timeout=30) as r:
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read())

    def post(self, path: str, body) -> tuple[int, dict]:
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        request = urllib.request.Request(f"http://{self.http}{path}", data=data, method="POST")
        try:
            with urllib.request.urlopen(request, timeout=30) as r:
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read())

    def infer_grpc(self, inputs: dict, *, raw: bool = True, model: str = MODEL, version: str = ""):
        request = oip.ModelInferRequest(model_name=model, model_version=version, id="req-1")
        for name, array in inputs.items():
            dtype = {"ids": "UINT64", "dense": "FP32", "rows": "BYTES"}[name]
            t = request.inputs.add(name=name, datatype=dtype, shape=list(np.shape(array)))
            if name == "rows":
                elems = [s.encode() if isinstance(s, str) else s for s in array]
                if raw:
                    request.raw_input_contents.append(b"".join(len(e).to_bytes(4, "little") + e for e in elems))
                else:
                    t.contents.bytes_contents.extend(elems)
            elif raw:
                request.raw_input_contents.append(np.ascontiguousarray(array).tobytes())
            elif name == "ids":
                t.contents.uint64_contents.extend(np.asarray(array).reshape(-1).tolist())
            else:
                t.contents.fp32_contents.extend(np.asarray(array).reshape(-1).tolist())
        return self.call("ModelInfer", request, oip.ModelInferResponse)

    def stop(self) -> None:
        self.channel.close()
        self.proc.terminate()
        try:
            self.proc.wait(20)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def _probs(response) -> np.ndarray:
    return np.frombuffer(response.raw_output_contents[0], np.float32).reshape(list(response.outputs[0].shape))


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("inference")
    tokens = tokens_for()
    _, known = make_bundle(tmp / "bundle", tokens=tokens)
    server = Server(tmp / "bundle", tmp / "server.log")
    yield server, tmp / "bundle", known, tokens, tmp
    server.stop()


def _samples(known, tokens, n=37, seed=21):
    from services.inference.inputs import InputDecoder, Tensor
    from hybridrec.core.layouts.bundle import read_manifest

    ids = random_ids(known, n, seed=seed)
    dense = np.random.default_rng(seed).random((n, 13), dtype=np.float32)
    lines = criteo_lines(tokens, n, seed=seed)
    return ids, dense, lines


def _rows_reference(bundle, lines):
    from hybridrec.core.layouts.bundle import read_manifest
    from services.inference.inputs import InputDecoder, Tensor

    s = InputDecoder(read_manifest(bundle), 1 << 16).decode([Tensor("rows", "BYTES", (len(lines),),
                                                                    [x.encode() for x in lines])])
    ids, present = columns(s)
    return reference(bundle, ids, s.dense, present)


def test_health_and_metadata(setup):
    server, *_ = setup
    assert server.call("ServerLive", oip.ServerLiveRequest(), oip.ServerLiveResponse).live
    assert server.call("ServerReady", oip.ServerReadyRequest(), oip.ServerReadyResponse).ready
    assert server.call("ModelReady", oip.ModelReadyRequest(name=MODEL), oip.ModelReadyResponse).ready
    assert not server.call("ModelReady", oip.ModelReadyRequest(name="x"), oip.ModelReadyResponse).ready
    meta = server.call("ModelMetadata", oip.ModelMetadataRequest(name=MODEL), oip.ModelMetadataResponse)
    assert list(meta.versions) == ["3"]
    assert [i.name for i in meta.inputs] == ["dense", *(f"C{i}" for i in range(1, 27)), "ids", "rows"]
    assert [list(i.shape) for i in meta.inputs][:2] == [[-1, 13], [-1]] and meta.inputs[1].datatype == "BYTES"
    assert server.call("ServerMetadata", oip.ServerMetadataRequest(), oip.ServerMetadataResponse).name
    health = health_pb2_grpc.HealthStub(server.channel)
    assert health.Check(health_pb2.HealthCheckRequest(service="")).status == health_pb2.HealthCheckResponse.SERVING
    for path in ("/v2/health/live", "/v2/health/ready", "/v2", f"/v2/models/{MODEL}", f"/v2/models/{MODEL}/ready",
                 f"/v2/models/{MODEL}/versions/3", f"/v2/models/{MODEL}/versions/3/ready"):
        assert server.get(path)[0] == 200, path
    assert server.get("/v2/models/x")[0] == 404 and server.get(f"/v2/models/{MODEL}/versions/9")[0] == 404
    with urllib.request.urlopen(f"http://{server.http}/metrics", timeout=10) as r:
        assert b"hybridrec_inference_requests_total" in r.read()


def test_grpc_and_rest_predictions_equal_the_reference(setup):
    server, bundle, known, tokens, _ = setup
    ids, dense, lines = _samples(known, tokens)
    want_ids = reference(bundle, ids, dense)
    want_rows = _rows_reference(bundle, lines)
    for raw in (True, False):
        response = server.infer_grpc({"ids": ids, "dense": dense}, raw=raw)
        assert response.model_version == "3" and response.parameters["model_version"].string_param == "3"
        assert response.id == "req-1"
        np.testing.assert_allclose(_probs(response), want_ids, atol=ATOL)
        np.testing.assert_allclose(_probs(server.infer_grpc({"rows": lines}, raw=raw)), want_rows, atol=ATOL)
    status, body = server.post(f"/v2/models/{MODEL}/infer", {
        "id": "r", "inputs": [{"name": "ids", "datatype": "UINT64", "shape": list(ids.shape), "data": ids.tolist()},
                              {"name": "dense", "datatype": "FP32", "shape": list(dense.shape),
                               "data": dense.reshape(-1).tolist()}]})
    assert status == 200 and body["model_version"] == "3" and body["parameters"]["model_version"] == "3"
    np.testing.assert_allclose(body["outputs"][0]["data"], want_ids, atol=ATOL)
    status, body = server.post(f"/v2/models/{MODEL}/versions/3/infer", {
        "inputs": [{"name": "rows", "datatype": "BYTES", "shape": [len(lines)], "data": lines}],
        "outputs": [{"name": "probability"}]})
    assert status == 200 and body["outputs"][0]["shape"] == [len(lines)]
    np.testing.assert_allclose(body["outputs"][0]["data"], want_rows, atol=ATOL)


def test_stock_oip_client(setup):
    server, bundle, known, tokens, tmp = setup
    ids, dense, lines = _samples(known, tokens, n=9, seed=5)
    np.savez(tmp / "req.npz", ids=ids, dense=dense, rows=np.array(lines))
    out = subprocess.run([sys.executable, str(REPO / "tests/integration/oip_client.py"), str(tmp / "req.npz"),
                          server.grpc, server.http, MODEL], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    results = json.loads(out.stdout)
    want = {"ids+dense": reference(bundle, ids, dense), "rows": _rows_reference(bundle, lines)}
    assert len(results) == 6
    for key, result in results.items():
        assert result["version"] == "3" and result["versions"] == ["3"], key
        np.testing.assert_allclose(result["probability"], want[key.split("/")[1]], atol=ATOL, err_msg=key)


def _grpc_error(server, fn) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as info:
        fn()
    return info.value.code(), info.value.details()


def test_bad_input_is_refused_and_the_service_keeps_serving(setup):
    server, bundle, known, tokens, _ = setup
    ids, dense, lines = _samples(known, tokens, n=4)
    bad_grpc = [
        (lambda: server.infer_grpc({"ids": ids, "dense": dense}, model="nope"), grpc.StatusCode.NOT_FOUND, "unknown model"),
        (lambda: server.infer_grpc({"ids": ids, "dense": dense}, version="7"), grpc.StatusCode.NOT_FOUND, "version"),
        (lambda: server.infer_grpc({"ids": ids}), grpc.StatusCode.INVALID_ARGUMENT, "expected"),
        (lambda: server.infer_grpc({"ids": ids[:, :3], "dense": dense}), grpc.StatusCode.INVALID_ARGUMENT, "shape"),
        (lambda: server.infer_grpc({"ids": ids, "dense": dense.astype(np.float64)}), grpc.StatusCode.INVALID_ARGUMENT,
         "bytes"),
        (lambda: server.infer_grpc({"rows": [b"\xff\xfe\t"]}), grpc.StatusCode.INVALID_ARGUMENT, "not UTF-8"),
        (lambda: server.infer_grpc({"rows": ["1\t2"]}), grpc.StatusCode.INVALID_ARGUMENT, "fields"),
        (lambda: server.infer_grpc({"rows": [lines[0], "x" + "\t" * 38]}), grpc.StatusCode.INVALID_ARGUMENT,
         r"rows[1]: column I1"),
        (lambda: server.infer_grpc({"rows": lines * 2000}), grpc.StatusCode.INVALID_ARGUMENT, "maximum"),
    ]
    for fn, code, text in bad_grpc:
        got, details = _grpc_error(server, fn)
        assert got == code and text in details, (got, details)
    request = oip.ModelInferRequest(model_name=MODEL)
    request.inputs.add(name="rows", datatype="BYTES", shape=[1])
    request.raw_input_contents.append(b"\x09\x00\x00\x00abc")
    got, details = _grpc_error(server, lambda: server.call("ModelInfer", request, oip.ModelInferResponse))
    assert got == grpc.StatusCode.INVALID_ARGUMENT and "runs past the end" in details
    request.raw_input_contents.append(b"")
    got, details = _grpc_error(server, lambda: server.call("ModelInfer", request, oip.ModelInferResponse))
    assert got == grpc.StatusCode.INVALID_ARGUMENT and "raw_input_contents" in details
    got, _ = _grpc_error(server, lambda: server.call("ModelMetadata", oip.ModelMetadataRequest(name="x"),
                                                     oip.ModelMetadataResponse))
    assert got == grpc.StatusCode.NOT_FOUND

    path = f"/v2/models/{MODEL}/infer"
    rows = lambda data, **kw: {"inputs": [{"name": "rows", "datatype": "BYTES", "shape": [len(data)], "data": data,
                                           **kw}]}  # noqa: E731
    bad_rest = [
        ("/v2/models/nope/infer", rows(lines), 404, "unknown model"),
        (f"/v2/models/{MODEL}/versions/2/infer", rows(lines), 404, "version"),
        (path, b"{not json", 400, "not JSON"),
        (path, b"\xff\xfe", 400, "not JSON"),
        (path, {"inputs": []}, 400, "inputs"),
        (path, rows(lines, datatype="FP32"), 400, "data must be FP32"),
        (path, rows(["1\t2"]), 400, "fields"),
        (path, rows(lines * 2000), 400, "maximum"),
        (path, {"inputs": [{"name": "rows", "datatype": "BYTES", "shape": [3], "data": lines[:2]}]}, 400, "needs 3"),
        (path, {"inputs": [{"name": "ids", "datatype": "UINT64", "shape": [4, 26], "data": ids.tolist()},
                           {"name": "dense", "datatype": "FP32", "shape": [4, 13], "data": dense.tolist()},
                           {"name": "more", "datatype": "FP32", "shape": [1], "data": [1.0]}]}, 400, "unknown input"),
        (path, {**rows(lines), "outputs": [{"name": "logit"}]}, 400, "unknown output"),
    ]
    for where, body, status, text in bad_rest:
        got, reply = server.post(where, body)
        assert got == status and text in reply["error"], (where, got, reply)
    # still serving, correctly
    np.testing.assert_allclose(_probs(server.infer_grpc({"ids": ids, "dense": dense})), reference(bundle, ids, dense),
                               atol=ATOL)
    assert server.proc.poll() is None


def test_dynamic_batching_merges_concurrent_requests(setup):
    """Concurrent requests share micro-batches. Its own server with a 200 ms window: with the default 1 ms, a
    loaded machine can deliver a round's requests so far apart that each is answered before the next arrives
    (CI: 64 of 64 alone), which is right for the server and says nothing about merging."""
    _, bundle, known, tokens, tmp = setup
    server = Server(bundle, tmp / "batching.log", "--set", "batching.max_delay_ms=200")
    try:
        ids, dense, _ = _samples(known, tokens, n=128, seed=8)
        want = reference(bundle, ids, dense)
        together = threading.Barrier(16)  # each round's 16 requests leave at once

        def one(i: int):
            together.wait(timeout=60)
            return server.infer_grpc({"ids": ids[i:i + 1], "dense": dense[i:i + 1]})

        merged = []
        for _ in range(5):  # a loaded machine can still send one round's requests one by one: a few rounds
            with concurrent.futures.ThreadPoolExecutor(16) as pool:
                responses = list(pool.map(one, range(128)))
            got = np.concatenate([_probs(r) for r in responses])
            np.testing.assert_allclose(got, want, atol=ATOL)
            merged += [r.parameters["micro_batch_rows"].int64_param for r in responses]
            if max(merged) > 1:
                break
        assert max(merged) > 1, merged  # some requests shared a micro-batch
    finally:
        server.stop()


def test_sigusr2_writes_every_threads_stack_to_the_log_and_the_service_keeps_serving(setup):
    server, bundle, known, tokens, _ = setup
    ids, dense, _ = _samples(known, tokens, n=4, seed=5)
    before = len(server.log.read_text())
    server.proc.send_signal(signal.SIGUSR2)
    deadline = time.monotonic() + 30
    while "_run_module_as_main" not in server.log.read_text()[before:]:  # the main thread's last line, written last
        assert time.monotonic() < deadline and server.proc.poll() is None, server.log.read_text()[before:]
        time.sleep(0.05)
    dump = server.log.read_text()[before:]
    assert dump.count("Thread 0x") >= 2 and "Current thread" in dump, dump[-3000:]  # the event loop's and others
    np.testing.assert_allclose(_probs(server.infer_grpc({"ids": ids, "dense": dense})),
                               reference(bundle, ids, dense), atol=ATOL)


def test_remote_ps_mode_gives_the_same_predictions(setup):
    _, bundle, known, tokens, tmp = setup
    shards = [FakePS(bundle, s) for s in range(2)]
    server = Server(bundle, tmp / "remote.log", *sum((["--ps", s.address] for s in shards), []))
    try:
        ids, dense, lines = _samples(known, tokens, n=50, seed=13)
        np.testing.assert_allclose(_probs(server.infer_grpc({"ids": ids, "dense": dense})),
                                   reference(bundle, ids, dense), atol=ATOL)
        np.testing.assert_allclose(_probs(server.infer_grpc({"rows": lines})), _rows_reference(bundle, lines),
                                   atol=ATOL)
        assert [s.calls for s in shards] == [2, 2]  # one lookup per shard per micro-batch
    finally:
        server.stop()
        for s in shards:
            s.stop()


def test_remote_mode_against_read_only_ps_processes(setup):
    """The real read-only PS (`hybridrec serve embedding_ps --bundle DIR --replica N`) as the shards."""
    import os
    import signal

    from hybridrec.core.runtime import rpc

    _, bundle, known, tokens, tmp = setup
    shards = []
    for replica in range(2):
        address = f"127.0.0.1:{_free_port()}"
        log = open(tmp / f"ro-ps-{replica}.log", "wb")
        shards.append((subprocess.Popen(HYBRIDREC + ["serve", "embedding_ps", "--bundle", str(bundle), "--replica",
                                                     str(replica), "--listen", address],
                                        cwd=REPO, stdout=log, stderr=subprocess.STDOUT, env=dict(os.environ)),
                       address))
    server = None
    try:
        import asyncio

        asyncio.run(rpc.wait_until_serving([a for _, a in shards], timeout_s=90, what="read-only PS"))
        server = Server(bundle, tmp / "ro-remote.log", *sum((["--ps", a] for _, a in shards), []))
        ids, dense, lines = _samples(known, tokens, n=50, seed=17)
        np.testing.assert_allclose(_probs(server.infer_grpc({"ids": ids, "dense": dense})),
                                   reference(bundle, ids, dense), atol=ATOL)
        np.testing.assert_allclose(_probs(server.infer_grpc({"rows": lines})), _rows_reference(bundle, lines),
                                   atol=ATOL)
    finally:
        if server is not None:
            server.stop()
        for proc, _ in shards:
            proc.send_signal(signal.SIGTERM)
        for proc, _ in shards:
            proc.wait(timeout=20)
