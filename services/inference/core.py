"""The transport-neutral part of the Open Inference Protocol: names, versions, metadata, inference.

The gRPC servicer (`grpc_api.py`) and the REST app (`rest.py`) only convert
their wire formats to `Tensor`s and back; every check and every answer is
made here once, so both endpoints behave the same.
"""
from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np
from services.inference.batcher import Batcher
from services.inference.inputs import BadInput, InputDecoder, NotFound, NotReady, Samples, Tensor
from services.inference.model import ModelSource

SERVER_NAME = "hybridrec-inference"
OUTPUT = "probability"
PLATFORM = "hybridrec_pytorch"
SERVER_VERSION = "0.1.0"
DECODE_ON_LOOP_BYTES = 256 << 10
"""A request whose inputs take fewer bytes is decoded on the event loop; a larger one on a thread (`_decode`)."""


def _nbytes(tensor: Tensor) -> int:
    data = tensor.data
    if isinstance(data, np.ndarray):
        return data.nbytes
    if isinstance(data, list):
        return sum(len(item) for item in data)
    return data.data.nbytes  # ByteElements


@dataclass
class Answer:
    model_name: str
    model_version: str
    outputs: dict[str, np.ndarray]  # name -> float32: `probability` (batch,) or (batch, tasks); a task (batch,)
    parameters: dict[str, Any] = field(default_factory=dict)


def output_metadata(model) -> list[dict[str, Any]]:
    """`probability`, and for a multi-task model whose bundle names its tasks, one output per task (that
    task's column of `probability`), so a client can ask for a task by name."""
    outputs = [{"name": OUTPUT, "datatype": "FP32", "shape": [-1] if model.outputs == 1 else [-1, model.outputs]}]
    return outputs + [{"name": task, "datatype": "FP32", "shape": [-1]} for task in task_names(model)]


def task_names(model) -> list[str]:
    tasks = list(model.manifest.tasks)
    return tasks if model.outputs > 1 and len(tasks) == model.outputs else []


class InferenceCore:
    def __init__(self, model_name: str, max_request_rows: int):
        self.model_name = model_name
        self.source: ModelSource | None = None
        self.batcher: Batcher | None = None
        self.max_request_rows = max_request_rows
        self._decoder_of: tuple[object, InputDecoder] | None = None  # (manifest, its decoder)
        self._truncated_before = 0  # truncated_rows of the decoders of versions no longer served
        self.counters = {"bad_requests_total": 0, "not_found_total": 0}
        self._decoding = ThreadPoolExecutor(max_workers=1, thread_name_prefix="decode")

    def serve(self, source: ModelSource, batcher: Batcher) -> None:
        """Start answering with `source` (the model is loaded)."""
        self.source, self.batcher = source, batcher

    @property
    def ready(self) -> bool:
        return self.source is not None

    def current(self):
        if self.source is None:
            raise NotReady("the model is still loading")
        return self.source.current()

    # -- names and versions ---------------------------------------------------------------------
    def check_model(self, name: str, version: str = "") -> int | None:
        """The version a request asks for (None: any); NotFound for another model or version."""
        if name != self.model_name:
            self.counters["not_found_total"] += 1
            raise NotFound(f"unknown model {name!r}; this server serves {self.model_name!r}")
        current = self.current().version
        if not version:
            return None
        if not version.isdigit() or int(version) != current:
            self.counters["not_found_total"] += 1
            raise NotFound(f"model {name!r} has no version {version!r}; serving version {current}")
        return int(version)

    def model_ready(self, name: str, version: str = "") -> bool:
        try:
            self.check_model(name, version)
        except (NotFound, NotReady):
            return False
        return True

    def server_metadata(self) -> dict[str, Any]:
        return {"name": SERVER_NAME, "version": SERVER_VERSION, "extensions": []}

    def model_metadata(self, name: str, version: str = "") -> dict[str, Any]:
        self.check_model(name, version)
        model = self.current()
        return {
            "name": self.model_name,
            "versions": [str(model.version)],
            "platform": PLATFORM,
            "inputs": self.decoder().metadata(),
            "outputs": output_metadata(model),
        }

    # -- inference --------------------------------------------------------------------------------
    def decoder(self) -> InputDecoder:
        """The current version's decoder (every version of a followed job has the same features; one decoder
        is kept, not one per version ever served)."""
        manifest = self.current().manifest
        if self._decoder_of is None or self._decoder_of[0] is not manifest:
            if self._decoder_of is not None:
                self._truncated_before += self._decoder_of[1].truncated_rows
            self._decoder_of = (manifest, InputDecoder(manifest, self.max_request_rows))
        return self._decoder_of[1]

    async def infer(self, name: str, version: str, tensors: Sequence[Tensor],
                    outputs: Sequence[str] = ()) -> Answer:
        pinned = self.check_model(name, version)
        tasks = task_names(self.current())
        try:
            for out in outputs:
                if out != OUTPUT and out not in tasks:
                    raise BadInput(f"unknown output {out!r}; this model answers "
                                   f"{', '.join(repr(o) for o in [OUTPUT, *tasks])}")
            samples = await self._decode(tensors)
        except BadInput:
            self.counters["bad_requests_total"] += 1
            raise
        result = await self.batcher.infer(samples, pinned)
        probs = result.probability
        answers = {out: probs if out == OUTPUT else probs[:, tasks.index(out)] for out in outputs or [OUTPUT]}
        return Answer(self.model_name, str(result.version), answers,
                      {"model_version": str(result.version), "micro_batch_rows": int(result.micro_batch_rows)})

    async def _decode(self, tensors: Sequence[Tensor]) -> Samples:
        """The request's samples: decoded on the event loop when small (a thread hop would cost a one-row
        request more than its decoding), on a thread of its own when large, so that one large request does not
        hold up every other request and the health probes."""
        decoder = self.decoder()
        if sum(_nbytes(t) for t in tensors) < DECODE_ON_LOOP_BYTES:
            return decoder.decode(tensors)
        return await asyncio.get_running_loop().run_in_executor(self._decoding, decoder.decode, tensors)

    def stats(self) -> dict[str, float]:
        return {**{k: float(v) for k, v in self.counters.items()},
                "truncated_rows_total": float(self._truncated_before
                                              + (self._decoder_of[1].truncated_rows if self._decoder_of else 0)),
                **({k: float(v) for k, v in self.batcher.counters.items()} if self.batcher else {}),
                "model_version": float(self.current().version) if self.ready else -1.0,
                "ready": float(self.ready)}
