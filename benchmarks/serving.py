"""Inference-service benchmark: one run, one JSON; every ratio is against a baseline measured in the same run.

Models: the README example's size (DNN over 26 features of width 16 and 13
dense features, hidden sizes from examples/criteo_synth.yaml) and the DIN
example (examples/din_parquet.yaml: scalar, multi-hot and a 30-long behaviour
sequence, two tasks), random weights, bundles of random rows in 2 shards.

For each model:
1. baseline: the same model in process, no RPC: pooling + embedding lookup +
   forward (what one micro-batch costs the service), rows/s at batch 512;
2. `hybridrec serve inference` as a process, sequential gRPC requests at
   batch 1, 32 and 512 (Criteo: hashed `ids` + `dense`; DIN: features by
   name, the sequence at its full 30): p50/p99 latency, rows/s;
3. throughput at concurrency 16 with batch-1 requests, dynamic batching on
   and off (the server restarted with batching.enabled=false).
And the cost of a call: the server CPU of an empty RPC (ServerLive) against
a bare grpc.aio + uvloop server answering the same RPC with no interceptors
(`--bare-server`, started by this script), and of a batch-1 ModelInfer.

Targets: Criteo batch-1 p50 <= 1 ms and p99 <= 5 ms; DIN batch-1 p50 <= 2 ms;
batch 512 >= 0.7x in-process rows/s; batching on >= 2x off at concurrency 16;
empty-call CPU <= 1.2x the bare server's; batch-1 ModelInfer CPU <= 2x an
empty call's.

`--h2load` measures instead as a user's non-Python client would: h2load (C,
benchmarks/h2load.py) on one HTTP/2 connection against the README model
(batch 1, one TSV line in `rows`) and the multi-task example (MMoE over
scalars, multi-hot tags and a 30-long sequence: batch 1 and 16 rows), each
beside an empty ServerLive call in the same server: means, p50/p99, and the
request rate with 16 batch-1 requests in flight against one at a time.

    python benchmarks/serving.py --out results/serving.json
    python benchmarks/serving.py --h2load --out results/serving_h2load.json
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import grpc  # noqa: E402
import torch  # noqa: E402

from hybridrec.core.wire.proto import grpc_predict_v2_pb2 as oip  # noqa: E402
from services.inference.inputs import InputDecoder, Tensor  # noqa: E402
from services.inference.model import load_model  # noqa: E402
from tests.inference_util import make_bundle, make_config_bundle, random_ids  # noqa: E402
from hybridrec.app.run.ports import free_port  # noqa: E402

MODEL = "ctr"
METHOD = "/inference.GRPCInferenceService/ModelInfer"


_free_port = free_port  # below the ephemeral range: no outgoing connection can take it first


def request_bytes(ids: np.ndarray, dense: np.ndarray) -> bytes:
    req = oip.ModelInferRequest(model_name=MODEL)
    req.inputs.add(name="ids", datatype="UINT64", shape=list(ids.shape))
    req.inputs.add(name="dense", datatype="FP32", shape=list(dense.shape))
    req.raw_input_contents.extend([ids.tobytes(), dense.tobytes()])
    return req.SerializeToString()


def named_request_bytes(inputs: dict[str, np.ndarray]) -> bytes:
    """A ModelInferRequest of named tensors (raw contents): INT64 features and lengths, FP32 dense."""
    req = oip.ModelInferRequest(model_name=MODEL)
    for name, value in inputs.items():
        datatype = "FP32" if value.dtype == np.float32 else "INT64"
        req.inputs.add(name=name, datatype=datatype, shape=list(value.shape))
        req.raw_input_contents.append(np.ascontiguousarray(value).tobytes())
    return req.SerializeToString()


def din_inputs(n: int, vocabulary: int, seed: int, seq_len: int = 30) -> dict[str, np.ndarray]:
    """n samples of the DIN example by feature name: the scalars, 1-8 tags, a full 30-long sequence."""
    rng = np.random.default_rng(seed)
    tags = rng.integers(1, 9, n)
    return {"user_id": rng.integers(0, vocabulary, n), "item_id": rng.integers(0, vocabulary, n),
            "item_cat": rng.integers(0, vocabulary, n),
            "tags": rng.integers(0, vocabulary, int(tags.sum())), "tags__lengths": tags.astype(np.int64),
            "hist_cats": rng.integers(0, vocabulary, n * seq_len),
            "hist_cats__lengths": np.full(n, seq_len, np.int64),
            "dense": rng.random((n, 4), dtype=np.float32)}


def bare_server(port: int) -> None:
    """The floor: grpc.aio on uvloop answering ServerLive, no interceptors, nothing else (`--bare-server`)."""
    import uvloop

    async def live(request, context):
        return oip.ServerLiveResponse(live=True)

    async def run() -> None:
        server = grpc.aio.server()
        handler = grpc.unary_unary_rpc_method_handler(live, request_deserializer=oip.ServerLiveRequest.FromString,
                                                      response_serializer=lambda m: m.SerializeToString())
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(
            "inference.GRPCInferenceService", {"ServerLive": handler, "ServerReady": handler}),))
        server.add_insecure_port(f"127.0.0.1:{port}")
        await server.start()
        await server.wait_for_termination()

    uvloop.run(run())


class Process:
    """A server process this benchmark started: its CPU time so far, and stopping it."""

    proc: subprocess.Popen
    address: str

    def cpu_s(self) -> float:
        import psutil

        t = psutil.Process(self.proc.pid).cpu_times()
        return t.user + t.system

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(20)
        except subprocess.TimeoutExpired:
            self.proc.kill()


class BareServer(Process):
    """`bare_server` in its own process."""

    def __init__(self, log: Path):
        self.port = _free_port()
        self.proc = subprocess.Popen([sys.executable, __file__, "--bare-server", str(self.port)], cwd=REPO,
                                     stdout=open(log, "w"), stderr=subprocess.STDOUT)
        self.address = f"127.0.0.1:{self.port}"
        grpc.channel_ready_future(grpc.insecure_channel(self.address)).result(timeout=60)


class TritonServer(Process):
    """`hybridrec serve inference --engine triton`'s server (services/inference/triton_server.py) on a bundle."""

    def __init__(self, bundle: Path, log: Path, *sets: str):
        from hybridrec.core.config.inference import load_inference_config
        from services.inference.triton_server import TritonProcess

        settings = load_inference_config(None, values={"bundle": str(bundle), "model_name": MODEL,
                                                       "grpc_port": _free_port(), "http_port": _free_port()},
                                         overrides=list(sets))
        self.triton = TritonProcess(settings, log_path=log)
        self.triton.wait_ready()
        self.proc = self.triton.proc
        self.address = f"127.0.0.1:{settings.grpc_port}"

    def stop(self) -> None:
        self.triton.stop()


def triton_form(inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Named inputs as the Triton engine takes them (services/inference/triton_repository.py): every input
    with the batch dimension first; a list feature's flat values padded to [n, L] beside its [n, 1] lengths."""
    n = inputs["dense"].shape[0]
    out = {}
    for name, value in inputs.items():
        if name.endswith("__lengths"):
            continue
        lengths = inputs.get(name + "__lengths")
        if lengths is not None:
            padded = np.zeros((n, int(lengths.max())), value.dtype)
            padded[np.arange(padded.shape[1])[None, :] < lengths[:, None]] = value
            out[name], out[name + "__lengths"] = padded, lengths.reshape(n, 1)
        else:
            out[name] = value if value.ndim == 2 else value.reshape(n, 1)
    return out


class Server(Process):
    def __init__(self, bundle: Path, log: Path, *sets: str):
        self.port = _free_port()
        http = _free_port()
        args = [sys.executable, "-m", "hybridrec", "serve", "inference", "--bundle", str(bundle),
                "--set", f"model_name={MODEL}", "--set", f"grpc_port={self.port}", "--set", f"http_port={http}"]
        for s in sets:
            args += ["--set", s]
        self.proc = subprocess.Popen(args, cwd=REPO, stdout=open(log, "w"), stderr=subprocess.STDOUT,
                                     env={**os.environ, "PYTHONPATH": str(REPO)})
        self.address = f"127.0.0.1:{self.port}"
        channel = grpc.insecure_channel(self.address)
        ready = channel.unary_unary("/inference.GRPCInferenceService/ServerReady",
                                    request_serializer=lambda m: m.SerializeToString(),
                                    response_deserializer=oip.ServerReadyResponse.FromString)
        deadline = time.monotonic() + 120
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(log.read_text())
            try:
                if ready(oip.ServerReadyRequest(), timeout=2).ready:
                    break
            except grpc.RpcError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(log.read_text())
            time.sleep(0.2)
        channel.close()


def rpc_cost(server: "Process", payload: bytes | None = None, n: int = 3000) -> dict:
    """Server CPU (us) per call over n sequential calls: an empty RPC (ServerLive) and, given a request's
    bytes, a ModelInfer (`ModelInfer_batch1`)."""
    channel = grpc.insecure_channel(server.address)
    calls = {"ServerLive": (channel.unary_unary("/inference.GRPCInferenceService/ServerLive", request_serializer=None,
                                                response_deserializer=oip.ServerLiveResponse.FromString), b"")}
    if payload is not None:
        calls["ModelInfer_batch1"] = (channel.unary_unary(METHOD, request_serializer=None,
                                                          response_deserializer=oip.ModelInferResponse.FromString),
                                      payload)
    out = {}
    for name, (call, arg) in calls.items():
        for _ in range(200):
            call(arg, timeout=30)
        cpu = server.cpu_s()
        for _ in range(n):
            call(arg, timeout=30)
        out[name] = (server.cpu_s() - cpu) / n * 1e6
    channel.close()
    return out


def sequential(address: str, payload: bytes, n: int, warmup: int) -> dict:
    channel = grpc.insecure_channel(address, options=[("grpc.max_receive_message_length", 1 << 30),
                                                      ("grpc.max_send_message_length", 1 << 30)])
    call = channel.unary_unary(METHOD, request_serializer=None, response_deserializer=oip.ModelInferResponse.FromString)
    for _ in range(warmup):
        call(payload, timeout=30)
    lat = np.empty(n)
    for i in range(n):
        t = time.perf_counter()
        call(payload, timeout=30)
        lat[i] = time.perf_counter() - t
    channel.close()
    return {"requests": n, "p50_ms": float(np.percentile(lat, 50) * 1e3), "p99_ms": float(np.percentile(lat, 99) * 1e3),
            "mean_ms": float(lat.mean() * 1e3)}


def _client_process(address: str, payloads: list[bytes], concurrency: int, seconds: float, start_at: float,
                    queue) -> None:
    queue.put(asyncio.run(_concurrent(address, payloads, concurrency, seconds, start_at)))


def concurrent_load(address: str, payloads: list[bytes], concurrency: int, seconds: float, processes: int) -> dict:
    """`concurrency` closed-loop callers spread over `processes` client processes (one Python client
    process cannot keep a server busy: its own gRPC overhead per call is as large as the server's)."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    start_at = time.time() + 3.0  # every process warms up, then measures the same window
    per = [concurrency // processes + (i < concurrency % processes) for i in range(processes)]
    procs = [ctx.Process(target=_client_process, args=(address, payloads, c, seconds, start_at, queue))
             for c in per if c]
    for p in procs:
        p.start()
    parts = [queue.get() for _ in procs]
    for p in procs:
        p.join()
    done = sum(p["requests"] for p in parts)
    wall = max(p["wall_s"] for p in parts)
    merged = sum(p["mean_micro_batch_rows"] * p["requests"] for p in parts) / max(done, 1)
    return {"requests": done, "all_requests": done + sum(p["warmup_requests"] for p in parts), "wall_s": wall,
            "requests_per_s": done / wall, "client_processes": len(procs),
            "mean_micro_batch_rows": merged}


async def _concurrent(address: str, payloads: list[bytes], concurrency: int, seconds: float,
                      start_at: float) -> dict:
    channel = grpc.aio.insecure_channel(address)
    call = channel.unary_unary(METHOD, request_serializer=None,
                               response_deserializer=oip.ModelInferResponse.FromString)
    done = 0
    merged: list[int] = []
    stop_at = 0.0

    async def worker(k: int) -> None:
        nonlocal done
        i = k
        while time.perf_counter() < stop_at:
            reply = await call(payloads[i % len(payloads)], timeout=30)
            done += 1
            merged.append(reply.parameters["micro_batch_rows"].int64_param)
            i += concurrency

    stop_at = time.perf_counter() + max(0.2, start_at - time.time())  # warm-up until the common start
    await asyncio.gather(*(worker(k) for k in range(concurrency)))
    warmup = done
    done, merged = 0, []
    started = time.perf_counter()
    stop_at = started + seconds
    await asyncio.gather(*(worker(k) for k in range(concurrency)))
    wall = time.perf_counter() - started
    await channel.close()
    return {"requests": done, "warmup_requests": warmup, "wall_s": wall, "requests_per_s": done / wall,
            "mean_micro_batch_rows": float(np.mean(merged)) if merged else 0.0}


def in_process(bundle: Path, tensors: list[Tensor], repeats: int) -> dict:
    """Decoded samples through pooling, lookup and forward in this process: what a micro-batch costs."""
    model = load_model(bundle)
    samples = InputDecoder(model.manifest, 1 << 16).decode(tensors)

    async def pipeline() -> None:
        uniq, bags = model.pooler.from_bags(samples.bags)
        bags.rows = await model.table.lookup(uniq)
        model.forward(samples.dense, bags)

    async def run() -> float:
        for _ in range(5):
            await pipeline()
        t = time.perf_counter()
        for _ in range(repeats):
            await pipeline()
        return time.perf_counter() - t

    wall = asyncio.run(run())
    n = len(samples)
    return {"batch": n, "rows_per_s": n * repeats / wall, "ms_per_batch": wall / repeats * 1e3}


def tensors_of_request(payload: bytes) -> list[Tensor]:
    from services.inference.grpc_api import tensors_of

    return tensors_of(oip.ModelInferRequest.FromString(payload))


def busy_jiffies() -> tuple[int, int]:
    """(busy, total) CPU time of the whole machine so far, in clock ticks (/proc/stat)."""
    values = [int(v) for v in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    return sum(values) - values[3] - values[4], sum(values)


def loaded(server: "Server", address: str, payloads: list[bytes], args) -> dict:
    """Concurrency 16 of batch-1 callers; with the server's CPU per request and its share of the machine's
    busy time (the rest is the load generator's: where that share is small, the clients bound the run)."""
    cpu, (busy0, total0) = server.cpu_s(), busy_jiffies()
    out = concurrent_load(address, payloads, 16, args.seconds, args.client_processes)
    used, (busy1, total1) = server.cpu_s() - cpu, busy_jiffies()
    tick = os.sysconf("SC_CLK_TCK")
    out["server_cpu_us_per_request"] = used / out["all_requests"] * 1e6
    out["machine_busy"] = (busy1 - busy0) / max(total1 - total0, 1)
    out["server_share_of_busy"] = used / max((busy1 - busy0) / tick, 1e-9)
    return out


def measure_model(bundle: Path, payloads: dict[int, bytes], singles: list[bytes], tmp: Path, name: str,
                  args) -> dict:
    """One model: the in-process baseline, sequential gRPC at each batch size, the cost of a call, and
    concurrency 16 with batching on and off."""
    result: dict = {"in_process_batch512": in_process(bundle, tensors_of_request(payloads[512]), repeats=200)}
    sets = [f"torch_threads={args.torch_threads}"]
    server = Server(bundle, tmp / f"{name}-on.log", *sets)
    try:
        seq = {}
        for n, reps in ((1, 3000), (32, 2000), (512, 300)):
            seq[f"batch{n}"] = sequential(server.address, payloads[n], reps, warmup=50)
            seq[f"batch{n}"]["rows_per_s"] = n / (seq[f"batch{n}"]["mean_ms"] / 1e3)
        result["grpc_sequential"] = seq
        result["server_cpu_us_per_call"] = rpc_cost(server, payloads[1])
        on = loaded(server, server.address, singles, args)
    finally:
        server.stop()
    server = Server(bundle, tmp / f"{name}-off.log", *sets, "batching.enabled=false")
    try:
        off = loaded(server, server.address, singles, args)
    finally:
        server.stop()
    result["grpc_concurrency16_batch1"] = {"batching_on": on, "batching_off": off}
    result["ratios"] = {
        "batch512_vs_in_process": seq["batch512"]["rows_per_s"] / result["in_process_batch512"]["rows_per_s"],
        "batching_on_vs_off": on["requests_per_s"] / off["requests_per_s"],
        # What batching saves the server per request: the throughput gain where the server, not the
        # load generator, is what runs out of CPU.
        "server_cpu_per_request_off_vs_on": off["server_cpu_us_per_request"] / on["server_cpu_us_per_request"],
        "model_infer_batch1_vs_empty_call_cpu": (result["server_cpu_us_per_call"]["ModelInfer_batch1"]
                                                 / result["server_cpu_us_per_call"]["ServerLive"]),
    }
    return result


def _checked(address: str, payload: bytes) -> bytes:
    """`payload` after one ModelInfer answered it without an error (h2load counts a gRPC error as a success)."""
    channel = grpc.insecure_channel(address)
    try:
        channel.unary_unary(METHOD, request_serializer=None,
                            response_deserializer=oip.ModelInferResponse.FromString)(payload, timeout=30)
    finally:
        channel.close()
    return payload


def h2load_model(server: "Server", payloads: dict[str, bytes], requests: int) -> dict:
    """An empty call, each payload sequentially, and the first payload 16 in flight, all from h2load."""
    from benchmarks import h2load

    live = "/inference.GRPCInferenceService/ServerLive"
    out = {"ServerLive": h2load.unary(server.address, live, b"", requests=requests)}
    for name, payload in payloads.items():
        out[name] = h2load.unary(server.address, METHOD, _checked(server.address, payload), requests=requests)
    first = next(iter(payloads))
    out[f"{first}_in_flight16"] = h2load.unary(server.address, METHOD, payloads[first], requests=requests * 2,
                                               in_flight=16)
    empty = out["ServerLive"]["mean_ms"]
    out["ratios"] = {**{f"{name}_mean_vs_empty_call": out[name]["mean_ms"] / empty for name in payloads},
                     "in_flight16_vs_sequential_rate": (out[f"{first}_in_flight16"]["requests_per_s"]
                                                        / out[first]["requests_per_s"])}
    return out


def h2load_figures(tmp: Path, args) -> dict:
    """The request-path figures of both engines (built-in, Triton): the README model at batch 1 (a TSV line) and
    the multi-task example at 1 and 16 rows."""
    from tests.inference_util import criteo_lines, tokens_for

    hidden = yaml.safe_load((REPO / "examples/criteo_synth.yaml").read_text())["model"]["kwargs"]["hidden"]
    tokens = tokens_for()
    criteo = tmp / "criteo"
    make_bundle(criteo, hidden=hidden, rows_per_feature=args.rows_per_feature, num_shards=2, tokens=tokens)
    lines = [line.encode() for line in criteo_lines(tokens, 16)]

    def rows_request(n: int, engine: str) -> bytes:
        """n TSV lines in `rows`: [n] for the built-in server, [n, 1] for Triton."""
        request = oip.ModelInferRequest(model_name=MODEL)
        request.inputs.add(name="rows", datatype="BYTES", shape=[n] if engine == "builtin" else [n, 1])
        request.raw_input_contents.append(b"".join(struct.pack("<I", len(x)) + x for x in lines[:n]))
        return request.SerializeToString()

    mmoe = tmp / "mmoe"
    make_config_bundle(mmoe, REPO / "examples/multitask_parquet.yaml", vocabulary=args.rows_per_feature)
    multi = {"batch1": din_inputs(1, args.rows_per_feature, seed=1), "batch16": din_inputs(16, args.rows_per_feature,
                                                                                           seed=16)}
    result: dict = {}
    for engine, server_of in (("builtin", Server), ("triton", TritonServer)):
        named = (lambda x: x) if engine == "builtin" else triton_form
        result[engine] = {}
        for name, bundle, payloads in (
                ("readme_dnn", criteo, {"batch1_rows": rows_request(1, engine),
                                        "batch16_rows": rows_request(16, engine)}),
                ("multitask_mmoe", mmoe, {k: named_request_bytes(named(v)) for k, v in multi.items()})):
            server = server_of(bundle, tmp / f"{engine}-{name}.log", f"torch_threads={args.torch_threads}")
            try:
                result[engine][name] = h2load_model(server, payloads, args.requests)
            finally:
                server.stop()
    builtin, triton = result["builtin"], result["triton"]
    readme, multi = builtin["readme_dnn"], builtin["multitask_mmoe"]
    t_readme, t_multi = triton["readme_dnn"], triton["multitask_mmoe"]
    result["targets"] = {
        "builtin": {
            "readme_batch1_mean<=1.5x_empty_call": readme["ratios"]["batch1_rows_mean_vs_empty_call"] <= 1.5,
            "readme_batch1_mean_ms<=0.5": readme["batch1_rows"]["mean_ms"] <= 0.5,
            "multitask_batch16_p99_ms<=2": multi["batch16"]["p99_ms"] <= 2.0,
            "multitask_batch16_mean<=2x_empty_call": multi["ratios"]["batch16_mean_vs_empty_call"] <= 2.0,
            "readme_in_flight16>=4x_sequential": readme["ratios"]["in_flight16_vs_sequential_rate"] >= 4.0,
            "multitask_in_flight16>=4x_sequential": multi["ratios"]["in_flight16_vs_sequential_rate"] >= 4.0},
        "triton": {
            "readme_batch1_mean_ms<=0.7": t_readme["batch1_rows"]["mean_ms"] <= 0.7,
            "readme_in_flight16_req_per_s>=5000": t_readme["batch1_rows_in_flight16"]["requests_per_s"] >= 5000,
            "readme_in_flight16>=4x_sequential": t_readme["ratios"]["in_flight16_vs_sequential_rate"] >= 4.0,
            "multitask_batch16_p99_ms<=2": t_multi["batch16"]["p99_ms"] <= 2.0},
    }
    result["triton_vs_builtin"] = {
        "readme_batch1_mean": t_readme["batch1_rows"]["mean_ms"] / readme["batch1_rows"]["mean_ms"],
        "readme_in_flight16_rate": (t_readme["batch1_rows_in_flight16"]["requests_per_s"]
                                    / readme["batch1_rows_in_flight16"]["requests_per_s"]),
        "multitask_batch16_p99": t_multi["batch16"]["p99_ms"] / multi["batch16"]["p99_ms"]}
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path)
    parser.add_argument("--bare-server", type=int, metavar="PORT", help=argparse.SUPPRESS)
    parser.add_argument("--rows-per-feature", type=int, default=20_000)
    parser.add_argument("--seconds", type=float, default=5.0, help="Each concurrency-16 measurement.")
    parser.add_argument("--torch-threads", type=int, default=1,
                        help="Server and baseline (0: torch's default). 1 by default: on a small shared machine "
                             "torch's OpenMP threads spin against other processes (9x slower at 2 threads here).")
    parser.add_argument("--client-processes", type=int, default=4, help="Load-generator processes at concurrency 16.")
    parser.add_argument("--h2load", action="store_true", help="Measure with h2load (a C client) instead.")
    parser.add_argument("--requests", type=int, default=3000, help="--h2load: requests per measurement.")
    args = parser.parse_args()
    if args.bare_server is not None:
        return bare_server(args.bare_server)
    if args.out is None:
        parser.error("--out is required")
    if args.torch_threads:
        torch.set_num_threads(args.torch_threads)
    args.seconds = max(args.seconds, 1.0)
    hidden = yaml.safe_load((REPO / "examples/criteo_synth.yaml").read_text())["model"]["kwargs"]["hidden"]
    tmp = Path(tempfile.mkdtemp(prefix="serving-bench-"))
    result: dict = {"machine": {"cpus": os.cpu_count(), "torch_threads": torch.get_num_threads(),
                                "python": platform.python_version(), "torch": torch.__version__}}
    if args.h2load:
        result["h2load"] = h2load_figures(tmp, args)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2) + "\n")
        print(json.dumps(result, indent=2))
        return

    # The floor: an empty call on a bare grpc.aio server, then on ours (same client, same run).
    bare = BareServer(tmp / "bare.log")
    try:
        bare_us = rpc_cost(bare)["ServerLive"]
    finally:
        bare.stop()

    criteo = tmp / "criteo"
    _, known = make_bundle(criteo, hidden=hidden, rows_per_feature=args.rows_per_feature, num_shards=2)
    rng = np.random.default_rng(0)
    batches = {n: (random_ids(known, n, seed=n, unknown=0.1, absent=0.05), rng.random((n, 13), dtype=np.float32))
               for n in (1, 32, 512)}
    payloads = {n: request_bytes(*b) for n, b in batches.items()}
    singles = [request_bytes(batches[512][0][i:i + 1], batches[512][1][i:i + 1]) for i in range(512)]
    result["criteo"] = {"model": {"path": "hybridrec.models:DNN", "hidden": hidden, "features": 26, "dim": 16,
                                  "num_dense": 13, "rows_in_bundle": 26 * args.rows_per_feature},
                        **measure_model(criteo, payloads, singles, tmp, "criteo", args)}

    din = tmp / "din"
    make_config_bundle(din, REPO / "examples/din_parquet.yaml", vocabulary=args.rows_per_feature)
    payloads = {n: named_request_bytes(din_inputs(n, args.rows_per_feature, seed=n)) for n in (1, 32, 512)}
    singles = [named_request_bytes(din_inputs(1, args.rows_per_feature, seed=1000 + i)) for i in range(512)]
    result["din"] = {"model": {"path": "hybridrec.models:DIN", "config": "examples/din_parquet.yaml",
                               "sequence_length": 30, "tasks": 2},
                     **measure_model(din, payloads, singles, tmp, "din", args)}

    ours = result["criteo"]["server_cpu_us_per_call"]["ServerLive"]
    result["empty_call_cpu_us"] = {"bare_grpc_aio": bare_us, "hybridrec": ours, "ratio": ours / bare_us}
    c, d = result["criteo"], result["din"]
    result["targets"] = {
        "criteo_batch1_p50_ms<=1": c["grpc_sequential"]["batch1"]["p50_ms"] <= 1.0,
        "criteo_batch1_p99_ms<=5": c["grpc_sequential"]["batch1"]["p99_ms"] <= 5.0,
        "din_batch1_p50_ms<=2": d["grpc_sequential"]["batch1"]["p50_ms"] <= 2.0,
        "criteo_batch512_vs_in_process>=0.7": c["ratios"]["batch512_vs_in_process"] >= 0.7,
        "din_batch512_vs_in_process>=0.7": d["ratios"]["batch512_vs_in_process"] >= 0.7,
        "criteo_batching_on_vs_off>=2": c["ratios"]["batching_on_vs_off"] >= 2.0,
        "din_batching_on_vs_off>=2": d["ratios"]["batching_on_vs_off"] >= 2.0,
        "empty_call_cpu_vs_bare<=1.2": result["empty_call_cpu_us"]["ratio"] <= 1.2,
        "criteo_model_infer_vs_empty_call_cpu<=2": c["ratios"]["model_infer_batch1_vs_empty_call_cpu"] <= 2.0,
        "din_model_infer_vs_empty_call_cpu<=2": d["ratios"]["model_infer_batch1_vs_empty_call_cpu"] <= 2.0,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
