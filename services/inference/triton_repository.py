"""A hybridrec model bundle as a Triton model repository: what Triton's C++ front end serves.

    REPO/<model_name>/config.pbtxt        inputs, outputs, batching and instances, from the bundle's manifest
    REPO/<model_name>/<version>/model.py  Triton's Python backend runs hybridrec's request path with it
    REPO/<model_name>/<version>/bundle/   the bundle (its files hard-linked where the filesystem allows,
                                          else copied; a symbolic link for `serve inference --engine triton`)

The inputs are the built-in server's (`InputDecoder.metadata`), each with the
batch dimension first, as Triton's dynamic batcher wants: `dense` [n, num_dense],
a scalar feature [n, 1], `ids` [n, num_features], `rows` [n, 1]. A multi-hot or
sequence feature is its values padded to one length, [n, L] (the built-in
server takes them flat), with `NAME__lengths` [n, 1] saying how many of each
row's values count (absent: all of them). Every input is optional: a request
sends one of the three forms, as to the built-in server. Outputs:
`probability` [n, 1] or [n, tasks], and one [n, 1] per named task.

Triton's versions are positive: a bundle's version v is served as version
max(v, 1) (an export is version 0).
"""
from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from hybridrec.core.layouts.bundle import BundleManifest
from hybridrec.core.config import FeatureKind
from hybridrec.core.config.inference import InferenceConfig
from services.inference.inputs import LENGTHS_SUFFIX, InputDecoder

TRITON_TYPES = {"BYTES": "TYPE_STRING", "BOOL": "TYPE_BOOL", "UINT8": "TYPE_UINT8", "UINT16": "TYPE_UINT16",
                "UINT32": "TYPE_UINT32", "UINT64": "TYPE_UINT64", "INT8": "TYPE_INT8", "INT16": "TYPE_INT16",
                "INT32": "TYPE_INT32", "INT64": "TYPE_INT64", "FP16": "TYPE_FP16", "FP32": "TYPE_FP32",
                "FP64": "TYPE_FP64"}
"""Open Inference Protocol datatype -> Triton's model-config type."""

VERSION_FILE = "version.json"
"""In a followed version's directory: {"versions": the job's versions directory, "version": its number}."""

MODEL_PY = '''"""hybridrec's request path in Triton's Python backend (written by hybridrec; see
services/inference/triton_backend.py)."""
import os
import site
import sys

# `hybridrec serve inference --engine triton` passes its interpreter's path: put it first, so the backend
# imports what hybridrec imports there (and not, say, the host's older packages the embedded Python sees).
_before = list(sys.path)
for _path in filter(None, os.environ.get("HYBRIDREC_SITE", "").split(os.pathsep)):
    site.addsitedir(_path)
sys.path[:] = [p for p in sys.path if p not in _before] + _before

from services.inference.triton_backend import TritonPythonModel  # noqa: E402,F401
'''


@dataclass(frozen=True)
class TritonInput:
    name: str
    datatype: str  # OIP datatype
    dims: tuple[int, ...]  # without the batch dimension
    ragged: bool = False


def triton_version(manifest: BundleManifest) -> int:
    return max(int(manifest.version), 1)


def model_inputs(manifest: BundleManifest, max_request_rows: int) -> list[TritonInput]:
    """The built-in server's inputs with the batch dimension first (see the module docstring)."""
    decoder = InputDecoder(manifest, max_request_rows)
    lists = {f.name for f in manifest.features if f.kind == FeatureKind.LIST}
    out = []
    for entry in decoder.metadata():
        name, datatype, shape = entry["name"], entry["datatype"], entry["shape"]
        if name in lists:
            out.append(TritonInput(name, datatype, (-1,), ragged=True))
        elif name.endswith(LENGTHS_SUFFIX) or len(shape) == 1:
            out.append(TritonInput(name, datatype, (1,)))
        else:
            out.append(TritonInput(name, datatype, tuple(shape[1:])))
    return out


def config_pbtxt(manifest: BundleManifest, settings: InferenceConfig, *, outputs: int, tasks: list[str],
                 instances: int) -> str:
    """The model's config.pbtxt: Python backend, dynamic batching up to `max_request_rows` rows, `instances` CPU
    instances, hybridrec's serving settings as parameters.

    The batcher never waits for company (`max_queue_delay_microseconds: 0`): what queues while an instance
    runs forms the next batch, as in the built-in server, where a lone request never waits. Triton's delay
    would hold every request, a lone one too (batching.max_delay_ms as Triton's delay: 1.49 ms for a
    sequential batch-1 request of the README model, against 0.47 ms for the built-in server)."""
    lines = [f'name: "{settings.model_name}"', 'backend: "python"', f"max_batch_size: {settings.max_request_rows}"]
    if settings.batching.enabled:
        lines.append("dynamic_batching { max_queue_delay_microseconds: 0 }")
    lines.append(f"instance_group [ {{ count: {instances} kind: KIND_CPU }} ]")
    fields = []
    for i in model_inputs(manifest, settings.max_request_rows):
        dims = ", ".join(str(d) for d in i.dims)
        fields.append(f'  {{ name: "{i.name}" data_type: {TRITON_TYPES[i.datatype]} dims: [ {dims} ] optional: true'
                      + (" allow_ragged_batch: true" if i.ragged else "") + " }")
    lines += ["input [", ",\n".join(fields), "]"]
    outs = [f'  {{ name: "probability" data_type: TYPE_FP32 dims: [ {outputs} ] }}']
    outs += [f'  {{ name: "{task}" data_type: TYPE_FP32 dims: [ 1 ] }}' for task in tasks]
    lines += ["output [", ",\n".join(outs), "]"]
    params = {"max_request_rows": settings.max_request_rows, "torch_threads": settings.torch_threads,
              "verify_bundle": int(settings.verify_bundle), "compile_dense": int(settings.compile_dense)}
    lines += [f'parameters: {{ key: "{k}" value: {{ string_value: "{v}" }} }}' for k, v in params.items()]
    return "\n".join(lines) + "\n"


def instances_of(settings: InferenceConfig) -> int:
    """Python-backend instances: `triton_instances`, or one per core (at most 8): an instance answers one batch
    at a time, and its requests' Python work is most of their cost."""
    return settings.triton_instances or max(1, min(os.cpu_count() or 1, 8))


def write_repository(bundle: Path, repo: Path, settings: InferenceConfig, *, link: bool = False) -> Path:
    """Write `repo` (created if missing; the model's directory must not exist) serving `bundle`; returns the
    model's directory. `link`: the version holds a symbolic link to the bundle instead of its files."""
    from services.inference.model import load_model

    model = load_model(bundle, check=settings.verify_bundle)
    model_dir = write_model(repo, settings, model)
    version_dir = model_dir / str(triton_version(model.manifest))
    version_dir.mkdir()
    (version_dir / "model.py").write_text(MODEL_PY)
    if link:
        (version_dir / "bundle").symlink_to(bundle.resolve(), target_is_directory=True)
    else:
        shutil.copytree(bundle, version_dir / "bundle", copy_function=_link_or_copy)
    return model_dir


def write_model(repo: Path, settings: InferenceConfig, model) -> Path:
    """The model's directory with its config.pbtxt, for the inputs and outputs of `model` (a `LoadedModel`:
    how many outputs and which tasks, as the built-in server answers them); FileExistsError if it exists."""
    from services.inference.core import task_names

    model_dir = repo / settings.model_name
    if model_dir.exists():
        raise FileExistsError(f"{model_dir} exists: give a new repository or model name")
    model_dir.mkdir(parents=True)
    (model_dir / "config.pbtxt").write_text(config_pbtxt(model.manifest, settings, outputs=model.outputs,
                                                         tasks=task_names(model), instances=instances_of(settings)))
    return model_dir


def add_followed_version(model_dir: Path, versions: Path, number: int) -> Path:
    """Version `number` of a training job's versions directory as Triton's version `number`: model.py and a
    `version.json` naming it; the backend loads it as the built-in server's follower does (its full snapshot
    and the deltas up to it, merged; `hybridrec.core.layouts.versions.load_version`)."""
    version_dir = model_dir / str(number)
    version_dir.mkdir()
    (version_dir / "model.py").write_text(MODEL_PY)
    (version_dir / VERSION_FILE).write_text(json.dumps({"versions": str(Path(versions).resolve()),
                                                        "version": number}) + "\n")
    return version_dir


def _link_or_copy(src: str, dst: str) -> None:
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)
