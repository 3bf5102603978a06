"""hybridrec's request path as a model of Triton's Python backend (imported by the model.py that
services/inference/triton_repository.py writes; it runs in Triton's backend stub process, not in hybridrec's).

Triton's dynamic batcher hands `execute` the requests that arrived together.
Each is decoded as the built-in server decodes one (`InputDecoder`: the same
checks, the same hashing), the good ones are merged into one micro-batch and
answered by `LoadedModel.predict` (the bundle's mmap'd tables, pooling, the
ONNX Runtime forward), and the answers are split back per request. A request
the decoder refuses gets INVALID_ARGUMENT with the built-in server's message,
and one whose decoding or answer fails otherwise gets INTERNAL; either way the
others in its batch are answered (`answer_requests`).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from hybridrec.core.config import FeatureKind
from services.inference.core import OUTPUT, task_names
from services.inference.inputs import DTYPES, LENGTHS_SUFFIX, BadInput, InputDecoder, Samples, Tensor
from services.inference.model import load_model, run_now
from services.inference.triton_repository import VERSION_FILE

try:  # present in the backend stub; absent where hybridrec only imports this module to test its helpers
    import triton_python_backend_utils as pb_utils
except ImportError:  # pragma: no cover - exercised only outside Triton
    pb_utils = None

_DATATYPES = {np.dtype(v): k for k, v in DTYPES.items()}


def unpad(values: np.ndarray, lengths: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
    """A list feature's [n, L] values padded to one length and its lengths ([n] or [n, 1]; None: every row
    holds L values) as the built-in server's flat values and lengths: the first `length` values of each row."""
    n, width = values.shape
    if lengths is None:
        return values.reshape(-1), np.full(n, width, np.int64)
    lengths = np.asarray(lengths).reshape(-1).astype(np.int64, copy=False)
    if lengths.shape[0] != n:
        raise BadInput(f"{lengths.shape[0]} lengths for {n} rows of values")
    if ((lengths < 0) | (lengths > width)).any():
        raise BadInput(f"lengths must lie in [0, {width}], the width of the padded values")
    return values[np.arange(width)[None, :] < lengths[:, None]], lengths


def tensors_of(inputs: dict[str, tuple[str, np.ndarray]], lists: set[str]) -> list[Tensor]:
    """One request's inputs (name -> (OIP datatype, array with the batch dimension first)) as the decoder's
    tensors: scalars and lengths [n], list features flat with their lengths, the rest as they are."""
    out = []
    for name, (datatype, array) in inputs.items():
        if name.endswith(LENGTHS_SUFFIX) and name[:-len(LENGTHS_SUFFIX)] in lists:
            continue  # sent with its feature below
        if name in lists:
            if array.ndim != 2:
                raise BadInput(f"input {name!r} must have shape [batch, L] (values padded to one length)")
            lengths = inputs.get(name + LENGTHS_SUFFIX)
            values, counts = unpad(array, None if lengths is None else lengths[1])
            out.append(_tensor(name, datatype, values))
            out.append(Tensor(name + LENGTHS_SUFFIX, "INT64", (counts.shape[0],), counts))
        elif array.ndim == 2 and array.shape[1] == 1 and name not in ("dense", "ids"):
            out.append(_tensor(name, datatype, array.reshape(-1)))
        else:
            out.append(_tensor(name, datatype, array))
    return out


def _tensor(name: str, datatype: str, array: np.ndarray) -> Tensor:
    if datatype == "BYTES":
        return Tensor(name, datatype, array.shape, [bytes(v) for v in array.reshape(-1)])
    return Tensor(name, datatype, array.shape, array.reshape(-1))


class TritonPythonModel:
    """Triton's Python-backend interface: `initialize`, `execute`, `finalize`."""

    def initialize(self, args: dict) -> None:
        config = json.loads(args["model_config"])
        params = {k: v["string_value"] for k, v in config.get("parameters", {}).items()}
        version_dir = Path(args["model_repository"]) / args["model_version"]
        threads = int(params.get("torch_threads", "0"))
        if threads:
            import torch
            torch.set_num_threads(threads)
        check, compile = params.get("verify_bundle", "1") == "1", params.get("compile_dense", "1") == "1"
        if (version_dir / VERSION_FILE).is_file():
            self.model = _followed(json.loads((version_dir / VERSION_FILE).read_text()), check, compile)
        else:
            self.model = load_model(version_dir / "bundle", check=check, compile=compile)
        self.decoder = InputDecoder(self.model.manifest, int(params.get("max_request_rows", "4096")))
        self.lists = {f.name for f in self.model.manifest.features if f.kind == FeatureKind.LIST}
        self.tasks = task_names(self.model)

    def execute(self, requests: list) -> list:
        inputs = [{t.name(): t.as_numpy() for t in request.inputs()} for request in requests]
        responses = []
        for answer in answer_requests(self.model, self.decoder, self.lists, inputs):
            if isinstance(answer, Refusal):
                code = pb_utils.TritonError.INVALID_ARG if answer.bad_input else pb_utils.TritonError.INTERNAL
                responses.append(pb_utils.InferenceResponse(output_tensors=[],
                                                            error=pb_utils.TritonError(answer.message, code)))
            else:
                responses.append(pb_utils.InferenceResponse(output_tensors=self._outputs(answer)))
        return responses

    def _outputs(self, probs: np.ndarray) -> list:
        matrix = probs.reshape(probs.shape[0], -1)
        out = [pb_utils.Tensor(OUTPUT, np.ascontiguousarray(matrix, np.float32))]
        out += [pb_utils.Tensor(task, np.ascontiguousarray(matrix[:, [k]], np.float32))
                for k, task in enumerate(self.tasks)]
        return out

    def finalize(self) -> None:
        pass


@dataclass(frozen=True)
class Refusal:
    """Why one request of a dynamic batch is not answered: its own input (`bad_input`: INVALID_ARGUMENT, the
    built-in server's message) or an error while answering it (INTERNAL)."""

    message: str
    bad_input: bool


def answer_requests(model, decoder: InputDecoder, lists: set[str],
                    inputs: list[dict[str, np.ndarray]]) -> list[np.ndarray | Refusal]:
    """Each request's probabilities, or why it is refused: the decodable ones in one micro-batch. A request
    fails alone: one whose decoding raises anything is refused by itself, and when the merged micro-batch
    fails, each of its requests is answered on its own, so only the one that fails is refused (Triton's
    dynamic batch holds other clients' requests)."""
    answers: list[np.ndarray | Refusal | Samples] = []
    for arrays in inputs:
        try:
            named = {name: (_datatype(array), array) for name, array in arrays.items()}
            answers.append(decoder.decode(tensors_of(named, lists)))
        except BadInput as exc:
            answers.append(Refusal(str(exc), bad_input=True))
        except Exception as exc:  # noqa: BLE001 - one request's failure, whatever it is, is its own
            answers.append(Refusal(f"this request could not be decoded: {type(exc).__name__}: {exc}", False))
    good = [i for i, a in enumerate(answers) if isinstance(a, Samples)]
    if not good:
        return answers
    try:
        probs = run_now(model.predict(Samples.concat([answers[i] for i in good])))
    except Exception:  # noqa: BLE001 - find the request that fails: each of the batch alone
        for i in good:
            answers[i] = _predict_alone(model, answers[i])
        return answers
    at = 0
    for i in good:
        n = len(answers[i])
        answers[i], at = probs[at:at + n], at + n
    return answers


def _predict_alone(model, samples: Samples) -> np.ndarray | Refusal:
    try:
        return run_now(model.predict(samples))
    except Exception as exc:  # noqa: BLE001 - reported to this request's client, the others answered
        return Refusal(f"this request could not be answered: {type(exc).__name__}: {exc}", bad_input=False)


def _followed(spec: dict, check: bool, compile: bool):
    """A published version of a training job (`triton_repository.add_followed_version`), loaded as the built-in
    server's follower loads one: the full snapshot and the deltas up to it, merged, with its dense module."""
    from hybridrec.core.layouts.versions import load_version
    from services.inference.follow import inference_model
    from services.inference.model import build_dense

    snapshot = load_version(spec["versions"], int(spec["version"]), check=check)
    return inference_model(snapshot, build_dense(snapshot.manifest, snapshot.dense_state), compile=compile)


def _datatype(array: np.ndarray) -> str:
    """The OIP datatype of an input as the Python backend gives it (BYTES: an object array of bytes)."""
    return "BYTES" if array.dtype == np.object_ or array.dtype.kind in "SU" else _DATATYPES[array.dtype]
