"""A live inference server under hostile load: a well-formed client's latency while another client sends
malformed and oversized requests as fast as it can, against the same client's latency on the idle server, in
one invocation. Writes JSON.

The server is `hybridrec serve inference` of a random bundle of the README's shape (26 features, 13 dense).
The well-formed client sends one-row gRPC requests back to back for --seconds, first alone (idle), then while
the attacker runs: a process that cycles through a malformed REST body, a REST body past max_request_bytes
(refused from its Content-Length), a gRPC request past it (RESOURCE_EXHAUSTED), a BYTES input whose lengths
lie, and an input of the wrong datatype. Reported: p50/p99 of each phase, their ratio, the attacker's
requests per second and the answers it got, and the server's peak RSS against its max_request_bytes.

    python benchmarks/hostile_load.py --seconds 20 --out results/hostile_load.json
"""
from __future__ import annotations

import argparse
import json
import multiprocessing
import shutil
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections import Counter
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from tests.faults.test_inference_bounds import _peak_kib  # noqa: E402
from tests.inference_util import make_bundle, random_ids  # noqa: E402
from tests.integration.test_inference import MODEL, Server  # noqa: E402


def _latencies(server: Server, ids, seconds: float) -> list[float]:
    dense = np.ones((1, 13), np.float32)
    out, end = [], time.monotonic() + seconds
    while time.monotonic() < end:
        started = time.perf_counter()
        server.infer_grpc({"ids": ids, "dense": dense})
        out.append(time.perf_counter() - started)
    return out


def _attack(grpc_address: str, http_address: str, seconds: float, results) -> None:
    """In a process of its own: hostile requests as fast as one client sends them."""
    import grpc

    from hybridrec.proto import grpc_predict_v2_pb2 as oip

    channel = grpc.insecure_channel(grpc_address)
    infer = channel.unary_unary("/inference.GRPCInferenceService/ModelInfer",
                                request_serializer=lambda m: m.SerializeToString(),
                                response_deserializer=oip.ModelInferResponse.FromString)
    big = oip.ModelInferRequest(model_name=MODEL)
    big.inputs.add(name="rows", datatype="BYTES", shape=[1])
    big.raw_input_contents.append(b"\0" * (17 << 20))  # just past the default 16 MiB
    lying = oip.ModelInferRequest(model_name=MODEL)
    lying.inputs.add(name="rows", datatype="BYTES", shape=[3])
    lying.raw_input_contents.append((1 << 30).to_bytes(4, "little") + b"abc")
    wrong = oip.ModelInferRequest(model_name=MODEL)
    wrong.inputs.add(name="ids", datatype="FP32", shape=[1, 26]).contents.fp32_contents.extend([0.5] * 26)
    url = f"http://{http_address}/v2/models/{MODEL}/infer"
    rest = [b'{"inputs": [' * 5000, b'{"inputs": [{"name": "dense", "shape": [0, 1e400]}]}']
    answers: Counter = Counter()
    sent, end = 0, time.monotonic() + seconds
    while time.monotonic() < end:
        kind = sent % 6
        try:
            if kind < 2:
                urllib.request.urlopen(urllib.request.Request(url, data=rest[kind], method="POST"), timeout=30)
                answers["rest 200"] += 1
            elif kind == 2:  # past max_request_bytes: refused from the header alone
                request = urllib.request.Request(url, data=b"x" * 1024, method="POST",
                                                 headers={"Content-Length": str(1 << 30)})
                urllib.request.urlopen(request, timeout=30)
            else:
                infer([big, lying, wrong][kind - 3], timeout=30)
                answers["grpc OK"] += 1
        except urllib.error.HTTPError as exc:
            answers[f"rest {exc.code}"] += 1
        except grpc.RpcError as exc:
            answers[f"grpc {exc.code().name}"] += 1
        except OSError as exc:  # the server closed a connection whose body it would not read
            answers[f"rest {type(exc).__name__}"] += 1
        sent += 1
    results.put({"sent": sent, "answers": dict(answers)})


def _summary(latencies: list[float]) -> dict:
    ms = np.array(latencies) * 1e3
    return {"requests": len(ms), "p50_ms": round(float(np.percentile(ms, 50)), 3),
            "p99_ms": round(float(np.percentile(ms, 99)), 3)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="hostile-"))
    _, known = make_bundle(work / "bundle")
    server = Server(work / "bundle", work / "server.log")
    try:
        ids = random_ids(known, 1)
        _latencies(server, ids, 2.0)  # warm
        idle = _latencies(server, ids, args.seconds)
        results = multiprocessing.get_context("spawn").Queue()
        attacker = multiprocessing.get_context("spawn").Process(
            target=_attack, args=(server.grpc, server.http, args.seconds + 4, results))
        attacker.start()
        time.sleep(2.0)  # the attacker at full rate before the measurement
        busy = _latencies(server, ids, args.seconds)
        attack = results.get(timeout=args.seconds + 120)
        attacker.join(30)
        peak_mib = _peak_kib(server.proc.pid) / 1024
        alive = server.proc.poll() is None
    finally:
        server.stop()
        shutil.rmtree(work, ignore_errors=True)
    result = {"seconds": args.seconds, "idle": _summary(idle), "under_attack": _summary(busy),
              "p99_ratio": round(_summary(busy)["p99_ms"] / _summary(idle)["p99_ms"], 2),
              "attacker": {**attack, "per_s": round(attack["sent"] / (args.seconds + 4), 1)},
              "server_peak_rss_mib": round(peak_mib, 1), "max_request_bytes_mib": 16, "server_alive": alive}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
