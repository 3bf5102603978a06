"""Every model that trains, served by a real `tritonserver` (the nvidia-pytriton wheel's, started as
`hybridrec serve inference --engine triton` starts it): a stock tritonclient builds each request from the
model's metadata alone, over gRPC and over REST, and the answers equal hybridrec's own request path (the
eager forward `hybridrec predict` runs) within 1e-5; a malformed request gets INVALID_ARGUMENT naming the
problem and the server keeps answering.

tritonclient.grpc cannot be imported beside hybridrec's own OIP protobuf code (both declare the package
`inference`), so the gRPC client runs as a script in its own process (triton_grpc_client.py); the REST
client runs here."""
from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import json

import numpy as np
import psutil
import pytest
import tritonclient.http as httpclient
import yaml
from tritonclient.utils import InferenceServerException

from hybridrec.app.run.ports import free_port
from hybridrec.core.config.inference import InferenceConfig
from services.inference.inputs import LENGTHS_SUFFIX, InputDecoder, Tensor
from services.inference.model import load_model, run_now
from services.inference.triton_server import TritonProcess
from tests.inference_util import make_bundle, make_config_bundle

REPO_ROOT = Path(__file__).resolve().parents[2]
VOCABULARY = 500


def _dlrm_config(tmp_path):
    config = yaml.safe_load((REPO_ROOT / "examples/criteo_synth.yaml").read_text())
    config["model"] = {"path": "hybridrec.models:DLRM", "kwargs": {"bottom": [32, 16], "top": [64, 32]}}
    path = tmp_path / "dlrm.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


@pytest.fixture(scope="module", params=["readme", "readme_int8", "dlrm", "din", "multitask", "watch_time"])
def served(request, tmp_path_factory):
    """(bundle, client-side model name, gRPC address, HTTP address) of a running Triton on one model."""
    tmp = tmp_path_factory.mktemp(request.param)
    bundle = tmp / "bundle"
    if request.param in ("readme", "readme_int8"):  # and its tables quantized (export --quantize int8)
        make_bundle(bundle, rows_per_feature=VOCABULARY,
                    quantization="int8" if request.param.endswith("int8") else None)
    elif request.param == "dlrm":
        make_config_bundle(bundle, _dlrm_config(tmp), vocabulary=VOCABULARY)
    else:
        example = {"din": "din_parquet.yaml", "multitask": "multitask_parquet.yaml",
                   "watch_time": "watch_time_parquet.yaml"}[request.param]
        make_config_bundle(bundle, REPO_ROOT / "examples" / example, vocabulary=VOCABULARY)
    settings = InferenceConfig(bundle=str(bundle), model_name=request.param, grpc_port=free_port(),
                               http_port=free_port(), triton_instances=1)  # one model load, not one per core
    triton = TritonProcess(settings, work=tmp / "triton")
    try:
        triton.wait_ready()
        yield bundle, request.param, f"127.0.0.1:{settings.grpc_port}", f"127.0.0.1:{settings.http_port}"
    finally:
        triton.stop()


def _request_from_metadata(metadata: dict, n: int, seed: int) -> dict[str, np.ndarray]:
    """One value per input of the named form (the features by name and `dense`; not `ids`, `rows`, nor the
    dense columns `dense` stands for), shaped and typed from the metadata alone: the batch dimension n, a
    ragged one a random width with lengths within it; integer IDs drawn from the tables' vocabulary."""
    rng = np.random.default_rng(seed)
    inputs = {i["name"]: i for i in metadata["inputs"]}
    chosen = {}
    for name, spec in inputs.items():
        dims = [int(x) for x in spec["shape"]]
        if name in ("ids", "rows") or name.endswith(LENGTHS_SUFFIX) or (spec["datatype"] == "FP32"
                                                                         and dims[1:] == [1]):
            continue
        shape = [n if k == 0 else (int(rng.integers(1, 9)) if d == -1 else d) for k, d in enumerate(dims)]
        if spec["datatype"] == "FP32":
            chosen[name] = rng.random(shape, dtype=np.float32)
        elif spec["datatype"] == "BYTES":
            chosen[name] = rng.integers(0, VOCABULARY, shape).astype(str)
        else:
            chosen[name] = rng.integers(0, VOCABULARY, shape).astype(np.int64)
        if name + LENGTHS_SUFFIX in inputs:
            chosen[name + LENGTHS_SUFFIX] = rng.integers(0, shape[1] + 1, (n, 1)).astype(np.int64)
    return chosen


def _expected(bundle, arrays: dict[str, np.ndarray]) -> np.ndarray:
    """hybridrec's own answer to the same samples: the built-in server's decoder on the flat form and the
    eager forward (no ONNX Runtime), as `hybridrec predict` answers."""
    model = load_model(bundle, compile=False)
    tensors = []
    for name, array in arrays.items():
        if name.endswith(LENGTHS_SUFFIX):
            continue
        lengths = arrays.get(name + LENGTHS_SUFFIX)
        if lengths is not None:
            lengths = lengths.reshape(-1)
            flat = array[np.arange(array.shape[1])[None, :] < lengths[:, None]]
            tensors += [Tensor(name, "INT64", flat.shape, flat), Tensor(name + LENGTHS_SUFFIX, "INT64",
                                                                        lengths.shape, lengths)]
        elif array.dtype.kind == "U":
            tensors.append(Tensor(name, "BYTES", (array.shape[0],), [v.encode() for v in array.reshape(-1)]))
        elif name == "dense":
            tensors.append(Tensor(name, "FP32", array.shape, array.reshape(-1)))
        else:
            datatype = "FP32" if array.dtype == np.float32 else "INT64"
            tensors.append(Tensor(name, datatype, (array.shape[0],), array.reshape(-1)))
    samples = InputDecoder(model.manifest, 4096).decode(tensors)
    return run_now(model.predict(samples)).reshape(len(samples), -1)


def _infer(client, name: str, arrays: dict[str, np.ndarray], outputs: list[str]) -> dict[str, np.ndarray]:
    """REST, in this process."""
    result = client.infer(name, _inputs(arrays), outputs=[httpclient.InferRequestedOutput(o) for o in outputs])
    return {o: result.as_numpy(o) for o in outputs}


def _infer_grpc(address: str, name: str, arrays: dict[str, np.ndarray], outputs: list[str], tmp: Path) -> dict:
    """gRPC, from triton_grpc_client.py in its own process: {"version", "outputs"} or {"status", "message"}."""
    request = tmp / f"request-{len(list(tmp.glob('request-*.npz')))}.npz"
    np.savez(request, **arrays)
    out = subprocess.run([sys.executable, str(Path(__file__).with_name("triton_grpc_client.py")), str(request),
                          address, name, ",".join(outputs)], cwd=REPO_ROOT, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    answer = json.loads(out.stdout)
    if "outputs" in answer:
        answer["outputs"] = {o: np.asarray(v, np.float32) for o, v in answer["outputs"].items()}
    return answer


@pytest.mark.parametrize("n", [1, 16])
def test_triton_answers_as_hybridrec_over_grpc_and_rest(served, n, tmp_path):
    bundle, name, grpc_address, http_address = served
    client = httpclient.InferenceServerClient(http_address)
    metadata = client.get_model_metadata(name)
    outputs = [o["name"] for o in metadata["outputs"]]
    arrays = _request_from_metadata(metadata, n, seed=n)
    expected = _expected(bundle, arrays)
    over_grpc = _infer_grpc(grpc_address, name, arrays, outputs, tmp_path)
    for got in (_infer(client, name, arrays, outputs), over_grpc["outputs"]):
        assert got["probability"].shape == expected.shape
        np.testing.assert_allclose(got["probability"], expected, atol=1e-5, rtol=0)
        for k, task in enumerate(outputs[1:]):  # one output per named task: its column
            np.testing.assert_allclose(got[task][:, 0], expected[:, k], atol=1e-5, rtol=0)
    if name == "watch_time":  # a binary and a regression task, each output by name (tests/unit/test_tasks.py
        assert outputs[1:] == ["click", "watch_time"]  # shows the regression one is not a sigmoid)


def test_a_malformed_request_is_refused_by_name_and_the_server_keeps_answering(served, tmp_path):
    bundle, name, grpc_address, http_address = served
    client = httpclient.InferenceServerClient(http_address)
    metadata = client.get_model_metadata(name)
    arrays = _request_from_metadata(metadata, 2, seed=3)
    arrays["dense"] = np.full_like(arrays["dense"], np.nan)
    refused = _infer_grpc(grpc_address, name, arrays, ["probability"], tmp_path)
    assert refused["status"] == "StatusCode.INVALID_ARGUMENT" and "NaN" in refused["message"], refused
    with pytest.raises(InferenceServerException) as over_rest:
        _infer(client, name, arrays, ["probability"])
    assert over_rest.value.status() == "400" and "NaN" in over_rest.value.message()
    arrays = _request_from_metadata(metadata, 2, seed=4)
    got = _infer_grpc(grpc_address, name, arrays, ["probability"], tmp_path)["outputs"]
    np.testing.assert_allclose(got["probability"], _expected(bundle, arrays), atol=1e-5, rtol=0)


HYBRIDREC = [sys.executable, "-m", "hybridrec"]


def test_serve_inference_engine_triton_answers_and_stops_cleanly_on_sigterm(tmp_path):
    """The CLI as a user runs it: `hybridrec serve inference --engine triton` serves the bundle until SIGTERM,
    then stops Triton and exits 0, leaving no tritonserver behind."""
    bundle = tmp_path / "bundle"
    make_bundle(bundle, rows_per_feature=VOCABULARY)
    grpc_port, http_port = free_port(), free_port()
    log = (tmp_path / "serve.log").open("w")
    proc = subprocess.Popen(HYBRIDREC + ["serve", "inference", "--engine", "triton", "--bundle", str(bundle),
                                         "--set", f"grpc_port={grpc_port}", "--set", f"http_port={http_port}"],
                            cwd=REPO_ROOT, stdout=log, stderr=subprocess.STDOUT)
    try:
        client = httpclient.InferenceServerClient(f"127.0.0.1:{http_port}")
        deadline = time.monotonic() + 180
        while not _ready(client, "hybridrec"):
            assert proc.poll() is None, (tmp_path / "serve.log").read_text()
            assert time.monotonic() < deadline, (tmp_path / "serve.log").read_text()
            time.sleep(0.2)
        metadata = client.get_model_metadata("hybridrec")
        arrays = _request_from_metadata(metadata, 4, seed=5)
        got = _infer(client, "hybridrec", arrays, ["probability"])
        np.testing.assert_allclose(got["probability"], _expected(bundle, arrays), atol=1e-5, rtol=0)
        servers = _tritonservers(grpc_port)
        assert len(servers) == 1
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0, (tmp_path / "serve.log").read_text()
    assert not any(psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE for p in servers)


def test_export_triton_writes_a_repository_that_tritonserver_serves(tmp_path):
    bundle = tmp_path / "bundle"
    make_config_bundle(bundle, REPO_ROOT / "examples/din_parquet.yaml", vocabulary=VOCABULARY)
    repo = tmp_path / "repo"
    out = subprocess.run(HYBRIDREC + ["export", "--triton", str(repo), "--model-name", "din", str(bundle)],
                         cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    config = (repo / "din" / "config.pbtxt").read_text()
    assert 'backend: "python"' in config and "allow_ragged_batch: true" in config
    assert (repo / "din" / "1" / "bundle" / "manifest.json").is_file()  # hard-linked files, not a link
    assert not (repo / "din" / "1" / "bundle").is_symlink()
    settings = InferenceConfig(bundle=str(bundle), model_name="din", grpc_port=free_port(), http_port=free_port())
    triton = TritonProcess(settings, work=tmp_path / "triton", repository=repo)
    try:
        triton.wait_ready()
        client = httpclient.InferenceServerClient(f"127.0.0.1:{settings.http_port}")
        metadata = client.get_model_metadata("din")
        arrays = _request_from_metadata(metadata, 3, seed=6)
        got = _infer(client, "din", arrays, ["probability"])
        np.testing.assert_allclose(got["probability"], _expected(bundle, arrays), atol=1e-5, rtol=0)
    finally:
        triton.stop()
    again = subprocess.run(HYBRIDREC + ["export", "--triton", str(repo), "--model-name", "din", str(bundle)],
                           cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    assert again.returncode == 2 and "exists" in again.stderr


@pytest.mark.parametrize("args, message", [
    (["--bundle", "B", "--ps", "127.0.0.1:1"], "--ps is not supported"),
    (["--follow", "versions", "--set", "http_port=null"], "http_port may not be null"),
    (["--bundle", "B", "--tritonserver", "/nonexistent/tritonserver"], "not an executable file"),
    (["--bundle", "B", "--engine", "onnx"], "--engine is 'builtin' or 'triton'"),
    (["--bundle", "B", "--tls", "ca.pem", "--tls", "cert.pem", "--tls", "key.pem"], "tls is not supported"),
])
def test_serve_engine_triton_refuses_what_it_cannot_do_by_name(tmp_path, args, message):
    bundle = tmp_path / "B"
    make_bundle(bundle, rows_per_feature=10)
    (tmp_path / "versions").mkdir()
    argv = ["serve", "inference", "--engine", "triton", *args] if "--engine" not in args else \
        ["serve", "inference", *args]
    out = subprocess.run(HYBRIDREC + argv, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert out.returncode == 2 and message in out.stderr, out.stderr


def _ready(client, name: str) -> bool:
    try:
        return client.is_model_ready(name)
    except Exception:  # noqa: BLE001 - not listening yet
        return False


def _tritonservers(grpc_port: int) -> list[int]:
    """PIDs of tritonserver processes serving on `grpc_port`."""
    return [p.pid for p in psutil.process_iter(["cmdline"])
            if p.info["cmdline"] and p.info["cmdline"][0].endswith("tritonserver")
            and f"--grpc-port={grpc_port}" in p.info["cmdline"]]


def test_follow_swaps_in_each_version_without_a_failed_request_and_skips_a_broken_one(tmp_path):
    """`--engine triton --follow`: each new version is loaded by Triton beside the served one, which it retires
    once the new one is ready; a client sending requests throughout sees no error and versions only growing,
    and the last version answers as hybridrec's own eager forward of it. A version that does not load is
    skipped; the served one keeps answering."""
    from hybridrec.core.layouts.versions import load_version
    from services.inference.follow import inference_model
    from services.inference.model import build_dense
    from tests.unit.test_follow import write

    rng = np.random.default_rng(0)
    root = tmp_path / "versions"
    write(root, 1, rng)
    settings = InferenceConfig(follow=str(root), model_name="live", grpc_port=free_port(), http_port=free_port())
    triton = TritonProcess(settings, work=tmp_path / "triton")
    ids = np.stack([np.arange(1, 9, dtype=np.uint64),
                    (np.uint64(1) << np.uint64(56)) + np.arange(1, 9, dtype=np.uint64)], axis=1)  # C1, C2
    dense = np.random.default_rng(1).random((8, 3), dtype=np.float32)
    seen, answers, errors, stop, first = [], [], [], threading.Event(), threading.Event()

    def client() -> None:
        c = httpclient.InferenceServerClient(f"127.0.0.1:{settings.http_port}")
        while not stop.is_set():
            try:
                result = c.infer("live", _inputs({"ids": ids, "dense": dense}))
                seen.append(int(result.get_response()["model_version"]))
                answers.append(result.as_numpy("probability"))
            except InferenceServerException as exc:
                errors.append(str(exc))
            first.set()

    thread = threading.Thread(target=client)
    try:
        triton.wait_ready()
        thread.start()
        assert first.wait(60)
        for version, base in ((2, None), (3, 2)):
            write(root, version, rng, base=base)
            assert triton.poll_versions() == version
        answered = len(seen)
        bad = write(root, 4, rng, base=3)
        (bad / "dense.pt").write_bytes(b"not a tensor file")
        assert triton.poll_versions() is None and 4 in triton.skipped and triton.served == 3
        deadline = time.monotonic() + 30
        while len(seen) < answered + 20 and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        stop.set()
        thread.join(timeout=60)
        triton.stop()
    assert errors == [] and len(seen) >= answered + 20
    assert seen == sorted(seen) and seen[-1] == 3 and {1, 3} <= set(seen)
    snapshot = load_version(root, 3)
    model = inference_model(snapshot, build_dense(snapshot.manifest, snapshot.dense_state), compile=False)
    samples = InputDecoder(model.manifest, 64).decode([Tensor("ids", "UINT64", ids.shape, ids.reshape(-1)),
                                                       Tensor("dense", "FP32", dense.shape, dense.reshape(-1))])
    np.testing.assert_allclose(answers[-1], run_now(model.predict(samples)).reshape(-1, 1), atol=1e-5, rtol=0)


def _inputs(arrays: dict[str, np.ndarray]) -> list:
    """REST input tensors: text arrays as BYTES."""
    out = []
    for key, array in arrays.items():
        if array.dtype.kind == "U":
            array = np.vectorize(str.encode, otypes=[np.object_])(array)
        datatype = {np.dtype(np.float32): "FP32", np.dtype(np.int64): "INT64",
                    np.dtype(np.uint64): "UINT64"}.get(array.dtype, "BYTES")
        tensor = httpclient.InferInput(key, list(array.shape), datatype)
        tensor.set_data_from_numpy(array)
        out.append(tensor)
    return out
