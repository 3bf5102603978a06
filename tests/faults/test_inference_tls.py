"""TLS on the inference service (`hybridrec serve inference --tls CA --tls CERT --tls KEY`): both endpoints
speak only TLS, and its lookups in read-only PS shards started with `--tls` are mutual TLS.

A throwaway CA signs one certificate (SAN 127.0.0.1) used by a real read-only PS process, the inference
process and the good client. By default a client needs only to trust the server (a client certificate is
not asked for); with `tls.require_client_cert` one without a certificate of the CA is refused on gRPC and on
REST. A plaintext client reaches neither endpoint; before, the service had no TLS option at all.
"""
from __future__ import annotations

import asyncio
import json
import signal
import ssl
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

import grpc
import numpy as np
import pytest

from hybridrec.core.runtime import rpc
from hybridrec.app.run.ports import free_port
from hybridrec.core.config import TLSConfig
from hybridrec.core.wire.proto import grpc_predict_v2_pb2 as oip
from tests.faults.test_tls import pki  # noqa: F401 - the CA and certificates fixture
from tests.inference_util import make_bundle, random_ids, reference
from tests.conftest import HYBRIDREC, REPO
from tests.integration.test_inference import MODEL

pytestmark = pytest.mark.faults


def _tls_args(pki: Path) -> list[str]:
    return ["--tls", str(pki / "ca.pem"), "--tls", str(pki / "service.pem"), "--tls", str(pki / "service.key")]


def _https(pki: Path, *, client_cert: bool) -> ssl.SSLContext:
    context = ssl.create_default_context(cafile=str(pki / "ca.pem"))
    if client_cert:
        context.load_cert_chain(str(pki / "service.pem"), str(pki / "service.key"))
    return context


def _get(url: str, context: ssl.SSLContext | None) -> int:
    try:
        with urllib.request.urlopen(url, timeout=10, context=context) as r:
            return r.status
    except urllib.error.HTTPError as exc:
        return exc.code


def _infer_rest(http: str, context, ids: np.ndarray, dense: np.ndarray) -> np.ndarray:
    body = {"inputs": [{"name": "ids", "datatype": "UINT64", "shape": list(ids.shape),
                        "data": ids.reshape(-1).tolist()},
                       {"name": "dense", "datatype": "FP32", "shape": list(dense.shape),
                        "data": dense.reshape(-1).tolist()}]}
    request = urllib.request.Request(f"https://{http}/v2/models/{MODEL}/infer", data=json.dumps(body).encode(),
                                     method="POST")
    with urllib.request.urlopen(request, timeout=30, context=context) as r:
        answer = json.loads(r.read())
    return np.asarray(answer["outputs"][0]["data"], np.float32)


def _infer_grpc(channel: grpc.Channel, ids: np.ndarray, dense: np.ndarray) -> np.ndarray:
    request = oip.ModelInferRequest(model_name=MODEL)
    request.inputs.add(name="ids", datatype="UINT64", shape=list(ids.shape))
    request.inputs.add(name="dense", datatype="FP32", shape=list(dense.shape))
    request.raw_input_contents.extend([ids.tobytes(), dense.tobytes()])
    call = channel.unary_unary("/inference.GRPCInferenceService/ModelInfer",
                               request_serializer=lambda m: m.SerializeToString(),
                               response_deserializer=oip.ModelInferResponse.FromString)
    return np.frombuffer(call(request, timeout=30).raw_output_contents[0], np.float32)


class Serving:
    """A read-only PS shard and an inference server in front of it, both with --tls."""

    def __init__(self, tmp: Path, bundle: Path, pki: Path, *extra: str):
        self.procs: list[subprocess.Popen] = []
        ps = f"127.0.0.1:{free_port()}"
        self._start(tmp / "ps.log", "embedding_ps", "--bundle", str(bundle), "--replica", "0", "--listen", ps,
                    *_tls_args(pki))
        # use_tls is process-wide: reset it at once, or every later test of this process speaks TLS
        rpc.use_tls(TLSConfig(ca=str(pki / "ca.pem"), cert=str(pki / "service.pem"), key=str(pki / "service.key")))
        try:
            asyncio.run(rpc.wait_until_serving([ps], timeout_s=90, what="read-only PS"))
        finally:
            rpc.use_tls(None)
        self.grpc, self.http = f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"
        self.log = tmp / "inference.log"
        self._start(self.log, "inference", "--bundle", str(bundle), "--ps", ps, "--set", f"model_name={MODEL}",
                    "--set", f"grpc_port={self.grpc.split(':')[1]}", "--set", f"http_port={self.http.split(':')[1]}",
                    *_tls_args(pki), *extra)
        context = _https(pki, client_cert=True)
        deadline = time.monotonic() + 90
        while _ready(self.http, context) != 200:
            assert self.procs[-1].poll() is None, self.log.read_text()
            assert time.monotonic() < deadline, self.log.read_text()
            time.sleep(0.2)

    def _start(self, log: Path, *argv: str) -> None:
        self.procs.append(subprocess.Popen(HYBRIDREC + ["serve", *argv], cwd=REPO, stdout=open(log, "w"),
                                           stderr=subprocess.STDOUT))

    def stop(self) -> None:
        for proc in reversed(self.procs):
            proc.send_signal(signal.SIGTERM)
            proc.wait(30)


def _ready(http: str, context) -> int | None:
    try:
        return _get(f"https://{http}/v2/health/ready", context)
    except OSError:
        return None


@pytest.fixture(scope="module")
def bundle(tmp_path_factory):
    path = tmp_path_factory.mktemp("tls-bundle") / "bundle"
    _, known = make_bundle(path, num_shards=1, rows_per_feature=50)
    return path, known


def _channel(address: str, pki: Path | None, *, client_cert: bool = False) -> grpc.Channel:
    if pki is None:
        return grpc.insecure_channel(address)
    ca = (pki / "ca.pem").read_bytes()
    if client_cert:
        creds = grpc.ssl_channel_credentials(root_certificates=ca, private_key=(pki / "service.key").read_bytes(),
                                             certificate_chain=(pki / "service.pem").read_bytes())
    else:
        creds = grpc.ssl_channel_credentials(root_certificates=ca)
    return grpc.secure_channel(address, creds)


def test_both_endpoints_speak_tls_and_look_rows_up_over_mutual_tls(tmp_path, pki, bundle):
    path, known = bundle
    served = Serving(tmp_path, path, pki)
    try:
        ids = random_ids(known, 8, seed=3)
        dense = np.random.default_rng(3).random((8, 13), dtype=np.float32)
        expected = reference(path, ids, dense).reshape(-1)
        with _channel(served.grpc, pki) as channel:  # trusts the server; no certificate of its own
            np.testing.assert_allclose(_infer_grpc(channel, ids, dense), expected, atol=1e-5)
        np.testing.assert_allclose(_infer_rest(served.http, _https(pki, client_cert=False), ids, dense), expected,
                                   atol=1e-5)
        with _channel(served.grpc, None) as plaintext, pytest.raises(grpc.RpcError) as refused:
            _infer_grpc(plaintext, ids, dense)
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
        with pytest.raises((urllib.error.URLError, ConnectionError)):
            _get(f"http://{served.http}/v2/health/live", None)
        assert "server certificate" in served.log.read_text()  # the endpoints' TLS, logged at start
    finally:
        served.stop()


def test_with_require_client_cert_a_client_without_one_is_refused(tmp_path, pki, bundle):
    path, known = bundle
    served = Serving(tmp_path, path, pki, "--set", "tls.require_client_cert=true")
    try:
        ids = random_ids(known, 4, seed=5)
        dense = np.ones((4, 13), np.float32)
        with _channel(served.grpc, pki, client_cert=True) as channel:
            assert _infer_grpc(channel, ids, dense).shape == (4,)
        assert _infer_rest(served.http, _https(pki, client_cert=True), ids, dense).shape == (4,)
        with _channel(served.grpc, pki) as no_cert, pytest.raises(grpc.RpcError) as refused:
            _infer_grpc(no_cert, ids, dense)
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
        with pytest.raises((urllib.error.URLError, ssl.SSLError, ConnectionError)):
            _infer_rest(served.http, _https(pki, client_cert=False), ids, dense)
    finally:
        served.stop()
