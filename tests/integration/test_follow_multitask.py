"""Live versions of a multi-task model: `hybridrec serve inference --follow` during an MMoE Parquet run
(examples/multitask_parquet.yaml: multi-hot `tags`, sequence `hist_cats`, tasks click and conversion) that
publishes every 10 steps. 8 gRPC clients send eval rows by feature name (a list feature as its flat values
and NAME__lengths; the dense columns as one matrix or one FP32 input each) through at least 5 swaps: no
errors, the run's last version served, and every response's probabilities ([batch, 2]) equal (1e-5) a forward
pass, in this process, of the version the response names, through the service's own decoder, pooler and
model over that version's merged table.

The approach is test_publish.py's `test_the_inference_service_follows_a_training_run`; the requests are
test_parquet_examples.py's.
"""
from __future__ import annotations

import asyncio
import json
import re
import struct
import subprocess
import threading
import time
import urllib.request

import numpy as np
import pytest

from hybridrec.core.config import load_config
from hybridrec.app.run.ports import free_port
from hybridrec.app.data.synth_parquet import synthesize_multitask
from hybridrec.core.layouts.versions import list_versions, load_version
from services.inference.follow import inference_model
from services.inference.model import build_dense
from services.inference.inputs import InputDecoder, Tensor
from tests.conftest import HYBRIDREC, REPO
from tests.integration import test_parquet_examples as named

pytestmark = pytest.mark.integration

MODEL = "mmoe"
CLIENTS = 8
REQUEST_ROWS = 50  # rows per request: 200 requests of the 10,000 eval rows
TASKS = 2


@pytest.fixture(scope="module")
def multitask_data(tmp_path_factory):
    out = tmp_path_factory.mktemp("multitask")
    synthesize_multitask(out, rows=30_000, eval_rows=10_000, seed=5)
    return out


def _overrides(data, epochs: int) -> list[str]:
    """test_parquet_examples' small run (one PS shard, one NN worker, fp32 pushes), 1,024 rows a step
    (30 steps an epoch) and a version every 10 steps: ~25 versions, one every ~0.8 s unloaded."""
    return [f"data.train=[{data / 'train.parquet'}]", f"data.eval=[{data / 'eval.parquet'}]",
            f"data.oracle={data / 'oracle.json'}", "training.batch_size=1024", f"training.epochs={epochs}",
            "ps.capacity=100000", "cluster.nn_workers=[127.0.0.1:0]", "cluster.ps=[127.0.0.1:0]",
            "training.compression.fp16=false",
            "publish.interval_steps=10", "publish.full_every=4", "publish.keep=1000"]


def _eval_requests(data, config) -> list[list[Tensor]]:
    """The eval rows as named-feature requests of REQUEST_ROWS rows (test_parquet_examples.requests), dense
    as one [batch, num_dense] matrix and, the same rows again, as one FP32 input per dense column."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(named, "REQUEST_ROWS", REQUEST_ROWS)
        return [tensors for by_column in (False, True)
                for tensors, _ in named.requests(data / "eval.parquet", config, dense_by_column=by_column)]


def _infer_request(tensors: list[Tensor]):
    """A ModelInferRequest of named tensors in raw_input_contents (a BYTES element: 4-byte length, bytes)."""
    from hybridrec.core.wire.proto import grpc_predict_v2_pb2 as oip

    request = oip.ModelInferRequest(model_name=MODEL)
    for t in tensors:
        request.inputs.add(name=t.name, datatype=t.datatype, shape=list(t.shape))
        if t.datatype == "BYTES":
            raw = b"".join(struct.pack("<I", len(v)) + v for v in t.data)
        else:
            raw = np.ascontiguousarray(t.data).tobytes()
        request.raw_input_contents.append(raw)
    return request


class Reference:
    """Forward passes of published versions in this process, as the service computes them: the version's
    merged table and dense module (services.inference.follow.inference_model), the named-input decoder, the
    model's pooler, a lookup of the pooled IDs, and its forward."""

    def __init__(self, root):
        self.root = root
        self.models: dict[int, object] = {}

    def model(self, version: int):
        if version not in self.models:
            snapshot = load_version(self.root, version)
            self.models[version] = (inference_model(snapshot, build_dense(snapshot.manifest, snapshot.dense_state)),
                                    InputDecoder(snapshot.manifest, 1 << 20))
        return self.models[version]

    def predict(self, version: int, tensors: list[Tensor]) -> np.ndarray:
        model, decoder = self.model(version)
        assert model.version == version
        samples = decoder.decode(tensors)
        uniq, bags = model.pooler.from_bags(samples.bags)
        bags.rows = asyncio.run(model.table.lookup(uniq))
        return model.forward(np.ascontiguousarray(samples.dense), bags)


def test_the_inference_service_follows_a_multitask_run(tmp_path, multitask_data):
    import grpc

    from hybridrec.core.wire.proto import grpc_predict_v2_pb2 as oip

    overrides = _overrides(multitask_data, epochs=8)
    config = load_config(REPO / "examples/multitask_parquet.yaml", overrides)
    batches = _eval_requests(multitask_data, config)
    wire = [_infer_request(tensors).SerializeToString() for tensors in batches]

    run_dir = tmp_path / "run"
    root = run_dir / "versions"  # where `hybridrec run` publishes (publish.dir unset)
    grpc_port, http_port = free_port(), free_port()
    log = tmp_path / "inference.log"
    server = subprocess.Popen(HYBRIDREC + ["serve", "inference", "--follow", str(root), "--set", f"model_name={MODEL}",
                                           "--set", f"grpc_port={grpc_port}", "--set", f"http_port={http_port}",
                                           "--set", "follow_poll_s=0.2"],
                              cwd=REPO, stdout=open(log, "w"), stderr=subprocess.STDOUT)
    run: subprocess.Popen | None = None
    stop = threading.Event()
    responses: list[tuple[int, int, np.ndarray]] = []  # (version named, request index, probabilities)
    errors: list[str] = []
    threads: list[threading.Thread] = []

    def get(path: str) -> bytes:
        with urllib.request.urlopen(f"http://127.0.0.1:{http_port}{path}", timeout=10) as r:
            return r.read()

    def wait_for(what: str, check, deadline_s: float) -> None:
        deadline = time.monotonic() + deadline_s
        while time.monotonic() < deadline:
            assert server.poll() is None, log.read_text()[-3000:]
            try:
                if check():
                    return
            except OSError:
                pass
            time.sleep(0.2)
        raise TimeoutError(f"{what} after {deadline_s:.0f} s; service log: {log.read_text()[-3000:]}")

    def served_version() -> int:
        text = get("/metrics").decode()
        return int(float(re.search(r"^hybridrec_inference_served_version\{[^}]*\} (\S+)$", text, re.M)[1]))

    def client(seed: int) -> None:
        r = np.random.default_rng(seed)
        with grpc.insecure_channel(f"127.0.0.1:{grpc_port}") as channel:
            infer = channel.unary_unary("/inference.GRPCInferenceService/ModelInfer",
                                        request_serializer=lambda raw: raw,  # serialized once, up front
                                        response_deserializer=oip.ModelInferResponse.FromString)
            while not stop.is_set():
                index = int(r.integers(len(wire)))
                try:
                    response = infer(wire[index], timeout=60)
                    version = int(response.model_version)
                    named_param = response.parameters["model_version"].string_param
                    assert named_param == response.model_version, (named_param, response.model_version)
                    rows = batches[index][0].shape[0]
                    assert list(response.outputs[0].shape) == [rows, TASKS], list(response.outputs[0].shape)
                    probs = np.frombuffer(response.raw_output_contents[0], np.float32).reshape(rows, TASKS)
                    responses.append((version, index, probs))
                except grpc.RpcError as exc:
                    errors.append(f"{exc.code()}: {exc.details()}")
                except Exception as exc:  # noqa: BLE001 - a malformed answer is an error too
                    errors.append(f"{type(exc).__name__}: {exc}")
                time.sleep(0.02)

    started = time.monotonic()
    try:
        # The service listens before it has a version (live, not ready): start the run only then, so the
        # service follows from the first version on however slowly it starts on a loaded machine.
        wait_for("the service is not live", lambda: get("/v2/health/live") is not None, 120)
        args = HYBRIDREC + ["run", "examples/multitask_parquet.yaml", "--run-dir", str(run_dir)]
        for item in overrides:
            args += ["--set", item]
        run = subprocess.Popen(args, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        wait_for("the service has no version", lambda: get("/v2/health/ready") is not None, 240)
        threads = [threading.Thread(target=client, args=(i,)) for i in range(CLIENTS)]
        for t in threads:
            t.start()
        _, stderr = run.communicate(timeout=600)
        assert run.returncode == 0, stderr[-3000:]
        last = json.loads((run_dir / "summary.json").read_text())["publish"]["last_version"]
        # The clients keep asking until the service serves the run's last version and a response names it.
        wait_for(f"version {last} is not served", lambda: served_version() == last, 60)
        wait_for(f"no response from version {last}", lambda: any(v == last for v, *_ in responses[-200:]), 60)
    finally:
        stop.set()
        for t in threads:
            t.join()
        for proc in (run, server):
            if proc is not None and proc.poll() is None:
                proc.terminate()
                proc.wait(20)
    served_s = time.monotonic() - started

    summary = json.loads((run_dir / "summary.json").read_text())
    assert not errors, errors[:5]
    served = sorted({v for v, *_ in responses})
    published = [v.version for v in list_versions(root)[0]]
    print(f"\ninference --follow (MMoE, 2 tasks): {len(responses)} responses from {CLIENTS} clients over "
          f"{len(served)} versions {served} ({len(served) - 1} swaps seen) of {len(published)} published, "
          f"{served_s:.1f} s; publish {summary['publish']}")
    assert len(served) >= 6, served  # at least 5 swaps
    assert served[-1] == summary["publish"]["last_version"] == published[-1], (served, published)

    reference = Reference(root)
    checked: dict[tuple[int, int], np.ndarray] = {}
    worst = 0.0
    for version, index, probs in responses:
        key = (version, index)
        if key not in checked:
            checked[key] = reference.predict(version, batches[index])
            assert checked[key].shape == (batches[index][0].shape[0], TASKS)
        np.testing.assert_allclose(probs, checked[key], rtol=0, atol=1e-5,
                                   err_msg=f"version {version}, request {index}")
        worst = max(worst, float(np.abs(probs - checked[key]).max()))
    # Histories longer than hist_cats' max_len were sent: the decoder cut them, as in training.
    assert any(decoder.truncated_rows > 0 for _, decoder in reference.models.values())
    print(f"compared {len(responses)} responses ({len(checked)} distinct version/request pairs) with forward "
          f"passes of {len(reference.models)} versions: max |difference| {worst:.2e}; "
          f"{time.monotonic() - started:.1f} s in all")
