"""Live services under hostile load: a well-formed client's latency while another client sends malformed and
oversized requests as fast as it can, against the same client's latency on the idle service, in one
invocation; an inference server (`--target inference`) and a PS shard (`--target ps`). Writes JSON.

The server is `hybridrec serve inference` of a random bundle of the README's shape (26 features, 13 dense).
The well-formed client sends one-row gRPC requests back to back for --seconds a phase, alone (idle) and while
the attacker runs, the phases alternated --rounds times and each kind's latencies pooled. The attacker is a
process that cycles through a malformed REST body, a REST body past max_request_bytes (refused from its
Content-Length), a gRPC request past it (RESOURCE_EXHAUSTED), a BYTES input whose lengths lie, and an input of
the wrong datatype. Reported: p50/p99 of each phase, their ratio, the attacker's
requests per second and the answers it got, and the server's peak RSS against its max_request_bytes. As a
control, the same attack aimed at a second inference server on the machine: on two cores the attacker's own
CPU slows the client down wherever it aims, and the difference is what the attacked server adds.

The PS shard is `hybridrec serve embedding_ps` of the README's shape (26 features of width 16, batches of
4,096, so `frames.max_ids` 212,992 and a receive limit of about 50 MB). The well-formed client is a training
job's lookup: 50,000 unique IDs with `train`, back to back. The attacker cycles through a lookup of
`max_ids` + 1 IDs (read and refused: INVALID_ARGUMENT), an update of as many, a frame past the receive limit
(RESOURCE_EXHAUSTED before it is read) and a frame bomb (1 MB asking for 4 GiB).

    python benchmarks/hostile_load.py --target both --seconds 20 --rounds 3 --out results/hostile_load.json
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


def _attack(grpc_address: str, http_address: str, seconds: float, results, kinds: list[int]) -> None:
    """In a process of its own: hostile requests of `kinds` (indices of KINDS) in turn, as fast as one client
    sends them."""
    import grpc

    from hybridrec.core.wire.proto import grpc_predict_v2_pb2 as oip

    channel = grpc.insecure_channel(grpc_address)
    call = channel.unary_unary("/inference.GRPCInferenceService/ModelInfer",  # requests serialized once, below
                               response_deserializer=oip.ModelInferResponse.FromString)
    big = oip.ModelInferRequest(model_name=MODEL)
    big.inputs.add(name="rows", datatype="BYTES", shape=[1])
    big.raw_input_contents.append(b"\0" * (17 << 20))  # just past the default 16 MiB
    lying = oip.ModelInferRequest(model_name=MODEL)
    lying.inputs.add(name="rows", datatype="BYTES", shape=[3])
    lying.raw_input_contents.append((1 << 30).to_bytes(4, "little") + b"abc")
    wrong = oip.ModelInferRequest(model_name=MODEL)
    wrong.inputs.add(name="ids", datatype="FP32", shape=[1, 26]).contents.fp32_contents.extend([0.5] * 26)
    grpc_requests = [r.SerializeToString() for r in (big, lying, wrong)]
    url = f"http://{http_address}/v2/models/{MODEL}/infer"
    rest = [b'{"inputs": [' * 5000, b'{"inputs": [{"name": "dense", "shape": [0, 1e400]}]}']
    answers: Counter = Counter()
    spent: Counter = Counter()  # seconds each kind of request took, sent and answered
    sent, end = 0, time.monotonic() + seconds
    while time.monotonic() < end:
        kind = kinds[sent % len(kinds)]
        started = time.perf_counter()
        try:
            if kind < 2:
                urllib.request.urlopen(urllib.request.Request(url, data=rest[kind], method="POST"), timeout=30)
                answers["rest 200"] += 1
            elif kind == 2:  # past max_request_bytes: refused from the header alone
                request = urllib.request.Request(url, data=b"x" * 1024, method="POST",
                                                 headers={"Content-Length": str(1 << 30)})
                urllib.request.urlopen(request, timeout=30)
            else:
                call(grpc_requests[kind - 3], timeout=30)
                answers["grpc OK"] += 1
        except urllib.error.HTTPError as exc:
            answers[f"rest {exc.code}"] += 1
        except grpc.RpcError as exc:
            answers[f"grpc {exc.code().name}"] += 1
        except OSError as exc:  # the server closed a connection whose body it would not read
            answers[f"rest {type(exc).__name__}"] += 1
        spent[KINDS[kind]] += time.perf_counter() - started
        sent += 1
    results.put({"sent": sent, "answers": dict(answers), "ms_per_request": {
        k: round(1e3 * v / max(1, sent // len(kinds)), 2) for k, v in spent.items()}})


KINDS = ["rest unbalanced json", "rest 1e400 shape", "rest 1 GiB content-length", "grpc 17 MiB",
         "grpc lying bytes lengths", "grpc wrong datatype"]


PS_FEATURES = 26
PS_WIDTH = 16
TRAINING_IDS = 50_000


def _ps_config(work: Path, address: str) -> Path:
    import yaml

    path = work / "ps.yaml"
    path.write_text(yaml.safe_dump({
        "data": {"train": ["unused.tsv"]},
        "features": [{"name": f"C{i + 1}", "group": i, "dim": PS_WIDTH} for i in range(PS_FEATURES)],
        "ps": {"capacity": 4_000_000, "shm_dir": str(work / "shm")},
        "cluster": {"ps": [address], "bind_host": "127.0.0.1"}}))
    return path


async def _ps_latencies(address: str, seconds: float, seed: int) -> list[float]:
    from hybridrec.core.runtime import rpc
    from hybridrec.core.wire.frames import PSLookup

    rng = np.random.default_rng(seed)
    out, end = [], time.monotonic() + seconds
    async with rpc.channel(address) as channel:
        call = rpc.raw_method(channel, "EmbeddingPS", "Lookup")
        while time.monotonic() < end:
            ids = np.unique(rng.integers(1, 2_000_000, TRAINING_IDS * 11 // 10, dtype=np.uint64))[:TRAINING_IDS]
            frame = PSLookup({PS_WIDTH: ids}, train=True).encode()
            started = time.perf_counter()
            await call(frame, timeout=60)
            out.append(time.perf_counter() - started)
    return out


def _attack_ps(address: str, config_path: str, seconds: float, results) -> None:
    """In a process of its own: oversized and malformed PS requests as fast as one client sends them."""
    import asyncio

    import grpc

    from hybridrec.core.runtime import rpc
    from hybridrec.core.config import load_config
    from hybridrec.core.wire.compress import ValueCodec
    from hybridrec.core.wire.frames import PSLookup, PSUpdate, max_ids, max_request_bytes
    from tests.frame_bombs import bomb

    config = load_config(config_path)
    past = np.arange(1, max_ids(config) + 2, dtype=np.uint64)
    frames = [("Lookup", PSLookup({PS_WIDTH: past}, train=True).encode()),
              ("Update", PSUpdate({PS_WIDTH: past}, {PS_WIDTH: np.zeros((past.size, PS_WIDTH), np.float32)},
                                  update_id=1).encode(ValueCodec())),
              ("Lookup", b"\0" * (max_request_bytes(config) + (1 << 20))),
              ("Lookup", bomb([f"p{i}" for i in range(16)], 256 << 20))]

    async def run() -> dict:
        answers: Counter = Counter()
        sent, end = 0, time.monotonic() + seconds
        async with rpc.channel(address) as channel:
            while time.monotonic() < end:
                method, frame = frames[sent % len(frames)]
                try:
                    await rpc.raw_method(channel, "EmbeddingPS", method)(frame, timeout=60)
                    answers[f"{method} OK"] += 1
                except grpc.aio.AioRpcError as exc:
                    answers[f"{method} {exc.code().name}"] += 1
                sent += 1
        return {"sent": sent, "answers": dict(answers)}

    results.put(asyncio.run(run()))


def _ps_trial(work: Path, seconds: float) -> dict:
    """A PS shard's training lookups, idle and under oversized requests."""
    import asyncio
    import subprocess

    from hybridrec.core.runtime import rpc
    from hybridrec.app.run.ports import free_port
    from tests.conftest import HYBRIDREC

    address = f"127.0.0.1:{free_port()}"
    config = _ps_config(work, address)
    proc = subprocess.Popen(HYBRIDREC + ["serve", "embedding_ps", "--config", str(config), "--replica", "0"],
                            cwd=REPO, stdout=subprocess.DEVNULL, stderr=(work / "ps.log").open("wb"))
    try:
        asyncio.run(rpc.wait_until_serving([address], timeout_s=180))
        asyncio.run(_ps_latencies(address, 3.0, seed=0))  # warm: the table admits its first IDs
        idle = asyncio.run(_ps_latencies(address, seconds, seed=1))
        context = multiprocessing.get_context("spawn")
        results = context.Queue()
        attacker = context.Process(target=_attack_ps, args=(address, str(config), seconds + 6, results))
        attacker.start()
        time.sleep(4.0)  # the attacker's frames built and at full rate before the measurement
        busy = asyncio.run(_ps_latencies(address, seconds, seed=2))
        attack = results.get(timeout=seconds + 300)
        attacker.join(60)
        peak_mib = _peak_kib(proc.pid) / 1024
        alive = proc.poll() is None
    finally:
        proc.terminate()
        proc.wait(30)
    return {"idle": _summary(idle), "under_attack": _summary(busy),
            "p99_ratio": round(_summary(busy)["p99_ms"] / _summary(idle)["p99_ms"], 2),
            "p50_ratio": round(_summary(busy)["p50_ms"] / _summary(idle)["p50_ms"], 2),
            "attacker": {**attack, "per_s": round(attack["sent"] / (seconds + 6), 1)},
            "ps_peak_rss_mib": round(peak_mib, 1), "ps_alive": alive}


def _summary(latencies: list[float]) -> dict:
    ms = np.array(latencies) * 1e3
    return {"requests": len(ms), "p50_ms": round(float(np.percentile(ms, 50)), 3),
            "p99_ms": round(float(np.percentile(ms, 99)), 3)}


ATTACKS = {"oversized and malformed": list(range(len(KINDS))), "malformed only": [0, 1, 4, 5]}
"""The inference attacker's mixes: every kind in turn (its pace set by the 17 MiB request), and the small
malformed requests alone (hundreds a second)."""


def _attacked(server: Server, target: Server, ids, seconds: float, kinds: list[int]) -> dict:
    """`server`'s well-formed client while one attacker of `kinds` sends to `target` (the same server, or
    another one: the machine's share of the slowdown, two cores shared by the three processes)."""
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    attacker = context.Process(target=_attack, args=(target.grpc, target.http, seconds + 4, results, kinds))
    attacker.start()
    time.sleep(2.0)  # the attacker at full rate before the measurement
    busy = _latencies(server, ids, seconds)
    attack = results.get(timeout=seconds + 120)
    attacker.join(30)
    return {"client": _summary(busy), "latencies": busy,
            "attacker": {**attack, "per_s": round(attack["sent"] / (seconds + 4), 1)}}


def _inference_trial(work: Path, seconds: float, rounds: int) -> dict:
    """An inference server's one-row requests, idle and under each attack of ATTACKS; and, as a control, under
    the same attack aimed at a second server on the machine.

    The phases alternate, `rounds` times: idle, then for each attack the control and the attacked phase. On
    this shared two-core machine a single idle phase's p99 moves by 2x from one run to the next (other
    tenants), so the ratio is taken between the latencies pooled over every idle phase and those pooled over
    every attacked phase of the same run, which saw the same conditions in turn; each round's own ratio (its
    attacked phase against the idle phase just before it) is reported beside it."""
    _, known = make_bundle(work / "bundle")
    server = Server(work / "bundle", work / "server.log")
    decoy = Server(work / "bundle", work / "decoy.log")
    out: dict = {"max_request_bytes_mib": 16, "rounds": rounds, "seconds_per_phase": seconds}
    idle: list[float] = []
    pooled: dict[str, dict[str, list[float]]] = {name: {"attacked": [], "control": []} for name in ATTACKS}
    rounds_out: dict[str, list] = {name: [] for name in ATTACKS}
    try:
        ids = random_ids(known, 1)
        _latencies(server, ids, 2.0)  # warm
        for round_no in range(rounds):
            round_idle = _latencies(server, ids, seconds)
            idle += round_idle
            if round_no == 0:  # before the first attack
                out["server_peak_rss_mib_idle"] = round(_peak_kib(server.proc.pid) / 1024, 1)
            for name, kinds in ATTACKS.items():
                control = _attacked(server, decoy, ids, seconds, kinds)
                attacked = _attacked(server, server, ids, seconds, kinds)
                pooled[name]["control"] += control.pop("latencies")
                pooled[name]["attacked"] += attacked.pop("latencies")
                rounds_out[name].append({
                    "idle": _summary(round_idle), **attacked, "control_attack_on_another_server": control,
                    "p99_ratio": round(attacked["client"]["p99_ms"] / _summary(round_idle)["p99_ms"], 2)})
        out["idle"] = _summary(idle)
        for name in ATTACKS:
            attacked, control = _summary(pooled[name]["attacked"]), _summary(pooled[name]["control"])
            out[name] = {"client": attacked, "p99_ratio": round(attacked["p99_ms"] / out["idle"]["p99_ms"], 2),
                         "control_client": control,
                         "control_p99_ratio": round(control["p99_ms"] / out["idle"]["p99_ms"], 2),
                         "rounds": rounds_out[name]}
        out["server_peak_rss_mib"] = round(_peak_kib(server.proc.pid) / 1024, 1)
        out["server_alive"] = server.proc.poll() is None
    finally:
        server.stop()
        decoy.stop()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", choices=["inference", "ps", "both"], default="both")
    parser.add_argument("--seconds", type=float, default=20.0, help="each phase's length")
    parser.add_argument("--rounds", type=int, default=3,
                        help="inference: idle and attacked phases alternated this many times")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    result: dict = {"seconds": args.seconds}
    for target in ("inference", "ps"):
        if args.target in (target, "both"):
            work = Path(tempfile.mkdtemp(prefix=f"hostile-{target}-"))
            try:
                result[target] = (_inference_trial(work, args.seconds, args.rounds) if target == "inference"
                                  else _ps_trial(work, args.seconds))
            finally:
                shutil.rmtree(work, ignore_errors=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
