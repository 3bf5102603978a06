"""hybridrec's request path as a model of Triton's Python backend (imported by the model.py that
services/inference/triton_repository.py writes; it runs in Triton's backend stub process, not in hybridrec's).

Triton's dynamic batcher hands `execute` the requests that arrived together.
Each is decoded as the built-in server decodes one (`InputDecoder`: the same
checks, the same hashing), the good ones are merged into one micro-batch and
answered by `LoadedModel.predict` (the bundle's mmap'd tables, pooling, the
ONNX Runtime forward), and the answers are split back per request. A request
the decoder refuses gets INVALID_ARGUMENT with the built-in server's message;
the others in its batch are answered.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from hybridrec.config import FeatureKind
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
        samples: list[Samples | None] = []
        errors: dict[int, str] = {}
        for i, request in enumerate(requests):
            try:
                arrays = {t.name(): t.as_numpy() for t in request.inputs()}
                inputs = {name: (_datatype(array), array) for name, array in arrays.items()}
                samples.append(self.decoder.decode(tensors_of(inputs, self.lists)))
            except BadInput as exc:
                samples.append(None)
                errors[i] = str(exc)
        good = [s for s in samples if s is not None]
        probs = run_now(self.model.predict(Samples.concat(good))) if good else None
        responses, at = [], 0
        for i, s in enumerate(samples):
            if s is None:
                responses.append(pb_utils.InferenceResponse(
                    output_tensors=[], error=pb_utils.TritonError(errors[i], pb_utils.TritonError.INVALID_ARG)))
                continue
            part = probs[at:at + len(s)]
            at += len(s)
            responses.append(pb_utils.InferenceResponse(output_tensors=self._outputs(part)))
        return responses

    def _outputs(self, probs: np.ndarray) -> list:
        matrix = probs.reshape(probs.shape[0], -1)
        out = [pb_utils.Tensor(OUTPUT, np.ascontiguousarray(matrix, np.float32))]
        out += [pb_utils.Tensor(task, np.ascontiguousarray(matrix[:, [k]], np.float32))
                for k, task in enumerate(self.tasks)]
        return out

    def finalize(self) -> None:
        pass


def _followed(spec: dict, check: bool, compile: bool):
    """A published version of a training job (`triton_repository.add_followed_version`), loaded as the built-in
    server's follower loads one: the full snapshot and the deltas up to it, merged, with its dense module."""
    from hybridrec.versions import load_version
    from services.inference.follow import inference_model
    from services.inference.model import build_dense

    snapshot = load_version(spec["versions"], int(spec["version"]), check=check)
    return inference_model(snapshot, build_dense(snapshot.manifest, snapshot.dense_state), compile=compile)


def _datatype(array: np.ndarray) -> str:
    """The OIP datatype of an input as the Python backend gives it (BYTES: an object array of bytes)."""
    return "BYTES" if array.dtype == np.object_ or array.dtype.kind in "SU" else _DATATYPES[array.dtype]
