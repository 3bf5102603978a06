"""The dense forward pass compiled for serving: the model exported to ONNX and run by ONNX Runtime.

At batch 1 the eager PyTorch forward of a small CTR model is almost all
dispatch: a hundred-odd operator calls through Python and the dispatcher
(the MMoE example: 4 experts, 2 gates and towers and a target attention) cost
several hundred microseconds for a few hundred thousand multiply-adds. ONNX
Runtime runs the same graph from C++, one thread, with its operators fused.

What is exported is `_Flat`: the model behind a flat signature — the dense
matrix, each width's pooled block (batch, features, width) and each
sequence's (values, lengths) — with the sigmoid on top, so the service passes
the pooler's arrays as they are. The batch dimension is dynamic.

A model is exported once per architecture (40-90 ms of the exporter's Python
for the example models, holding the interpreter's lock while requests wait
for it): the graph keeps every weight as an initializer named as in the
state dict (the exporter's constant folding is off; ONNX Runtime folds the
same constants when it builds a session, and runs as fast). A later version
of the same architecture — what a follower loads every few seconds — only
puts its weights into that graph's initializers and builds a session (5-10
ms). Every version's session is checked against its eager model on random
inputs: a model the exporter cannot hold, or that answers differently, is
exported afresh or served eagerly, with the reason logged — never a wrong
answer. bf16 bundles stay eager (they are trained and evaluated under CPU
autocast, which the export would not reproduce).
"""
from __future__ import annotations

import io
import threading
import warnings
from dataclasses import dataclass

import numpy as np
import torch

from hybridrec.core.runtime import log
from hybridrec.core.config import TaskConfig
from hybridrec.core.model.pooling import PooledEmbeddings, SeqEmbedding
from hybridrec.core.model.tasks import answers

TOLERANCE = 1e-5
"""Largest difference from the eager model allowed on the check inputs: a probability's, or a regression task's
value's divided by its scale (its output's difference, before the scale)."""
CHECK_ROWS = 3
TEMPLATES_KEPT = 4
"""Exported graphs kept for re-weighting, newest first: one per architecture a process serves."""


@dataclass(frozen=True)
class FlatInput:
    """One entry of the flat signature: a width's block of pooled features, or a sequence feature."""

    names: tuple[str, ...]
    sequence: bool


class _Flat(torch.nn.Module):
    """The model over flat tensors: rebuilds the `PooledEmbeddings` it was trained with, then its answers (the
    sigmoid of each binary output, a regression output's value: `hybridrec.core.model.tasks.answers`)."""

    def __init__(self, model: torch.nn.Module, slots: list[FlatInput], heads: tuple[TaskConfig, ...] = ()):
        super().__init__()
        self.model, self.slots, self.heads = model, slots, list(heads)

    def forward(self, dense: torch.Tensor, *tensors: torch.Tensor) -> torch.Tensor:
        pooled, i = PooledEmbeddings(), 0
        for slot in self.slots:
            if slot.sequence:
                pooled[slot.names[0]] = SeqEmbedding(tensors[i], tensors[i + 1])
                i += 2
            else:
                block = tensors[i]
                pooled.blocks.append((slot.names, block))
                for j, name in enumerate(slot.names):
                    pooled[name] = block[:, j]
                i += 1
        return answers(self.model(dense, pooled), self.heads)


def slots_of(pooled: PooledEmbeddings) -> list[FlatInput]:
    """The flat signature of what the pooler gives: its blocks, then each other feature (a sequence, or a
    pooled feature outside any block, as a block of one)."""
    slots = [FlatInput(tuple(names), False) for names, _ in pooled.blocks]
    in_blocks = {name for slot in slots for name in slot.names}
    for name, value in pooled.items():
        if name not in in_blocks:
            slots.append(FlatInput((name,), isinstance(value, SeqEmbedding)))
    return slots


def flat_inputs(slots: list[FlatInput], pooled: PooledEmbeddings) -> list[torch.Tensor]:
    blocks = {names: block for names, block in pooled.blocks}
    out = []
    for slot in slots:
        if slot.sequence:
            out += list(pooled[slot.names[0]])
        else:
            out.append(blocks[slot.names] if slot.names in blocks else pooled[slot.names[0]].unsqueeze(1))
    return out


class CompiledDense:
    """One version's dense forward in ONNX Runtime: `__call__(dense, pooled)` gives float32 answers (a binary
    output's probability, a regression output's value), shaped as the model answers its outputs."""

    def __init__(self, session, slots: list[FlatInput], names: list[str], reweighted: bool = False,
                 heads: tuple[TaskConfig, ...] = ()):
        """Use `build`."""
        self.session, self.slots, self.names, self.heads = session, slots, names, heads
        self._outputs = [o.name for o in session.get_outputs()]
        # The session's C++ `run` itself where the binding exposes it (every ONNX Runtime release so far): the
        # public wrapper checks the feeds' names again on every call, a quarter of a batch-1 forward's time
        # here; ours are the graph's own input names, fixed when it was exported.
        inner = getattr(session, "_sess", None)
        self._run = inner.run if inner is not None and hasattr(inner, "run") else session.run
        self.reweighted = reweighted
        """True when this version's weights went into an earlier export of its architecture (no export)."""

    def __call__(self, dense: np.ndarray, pooled: PooledEmbeddings) -> np.ndarray:
        """Probabilities of `dense` and the pooler's numpy arrays (`Pooler.pool_host`)."""
        feeds = {"dense": dense}
        feeds.update(zip(self.names, flat_inputs(self.slots, pooled)))
        return self._run(self._outputs, feeds, None)[0]

    @classmethod
    def build(cls, model: torch.nn.Module, pooled: PooledEmbeddings, num_dense: int,
              *, precision: str = "fp32", heads: tuple[TaskConfig, ...] = ()) -> "CompiledDense | None":
        """`model` compiled, given what the pooler makes of a probe batch (`pooled`, from `pool` or `pool_host`:
        its structure, not its values) and the tasks of its outputs (`heads`; empty: all binary); None, with the reason
        logged, when it cannot be (the service then runs it eagerly)."""
        why = _cannot(precision)
        heads = () if all(h.binary for h in heads) else tuple(heads)  # (): every output a probability
        if why is None:
            slots = slots_of(pooled)
            key = _architecture(model, slots, num_dense, heads)
            compiled = _TEMPLATES.reweight(key, model, slots, heads)
            if compiled is not None and compiled._answers_as(model, pooled, num_dense):
                return compiled
            try:
                compiled = cls.export(model, slots, pooled, num_dense, key, heads)
                why = compiled._differs(model, pooled, num_dense)
            except Exception as exc:  # noqa: BLE001 - any exporter or runtime refusal: the eager path serves
                why = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        if why is not None:
            log.get().warning("dense_forward_eager", why=why)
            return None
        return compiled

    @classmethod
    def export(cls, model: torch.nn.Module, slots: list[FlatInput], pooled: PooledEmbeddings,
                num_dense: int, key: str, heads: tuple[TaskConfig, ...] = ()) -> "CompiledDense":
        example = _random_inputs(slots, pooled, num_dense, rows=2, seed=0)
        names = [f"in{i}" for i in range(len(example) - 1)]
        buf = io.BytesIO()
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the TorchScript exporter's deprecation notice
            # No constant folding: every weight stays an initializer named as in the state dict, so a later
            # version's weights can be put in by name (`_Templates.reweight`); ONNX Runtime folds the constants.
            torch.onnx.export(_Flat(model, slots, heads).eval(), tuple(example), buf, input_names=["dense", *names],
                              output_names=["probability"], dynamo=False, do_constant_folding=False,
                              dynamic_axes={name: {0: "batch"} for name in ["dense", *names, "probability"]})
        graph = buf.getvalue()
        compiled = cls(_session(graph), slots, names, heads=heads)
        _TEMPLATES.keep(key, graph, names)
        return compiled

    def _answers_as(self, model: torch.nn.Module, pooled: PooledEmbeddings, num_dense: int) -> bool:
        """Whether a re-weighted session passes the check (a refusal counts as not: the caller exports)."""
        try:
            why = self._differs(model, pooled, num_dense)
        except Exception as exc:  # noqa: BLE001 - ONNX Runtime refusing the feeds: export afresh
            why = f"{type(exc).__name__}: {exc}"
        if why is not None:
            log.get().info("dense_forward_reexported", why=why)
        return why is None

    def _differs(self, model: torch.nn.Module, pooled: PooledEmbeddings, num_dense: int) -> str | None:
        """Why this session cannot stand in for `model` (answers off by more than TOLERANCE), or None."""
        dense, *tensors = _random_inputs(self.slots, pooled, num_dense, rows=CHECK_ROWS, seed=1)
        with torch.inference_mode():
            want = _Flat(model, self.slots, self.heads)(dense, *tensors).numpy()
        feeds = {"dense": dense.numpy(), **{n: t.numpy() for n, t in zip(self.names, tensors)}}
        got = self.session.run(None, feeds)[0]
        if got.shape != want.shape:
            return f"the exported model answers shape {got.shape}, the model {want.shape}"
        diff = float((np.abs(got - want).reshape(got.shape[0], -1) / self._scales(got)).max())
        return None if diff <= TOLERANCE else f"the exported model differs from the model by {diff:.2e}"

    def _scales(self, answers: np.ndarray) -> np.ndarray:
        """What each answer column's difference is divided by: 1 for a probability, a regression task's scale
        for its value (an ulp of the output before the scale is an ulp times the scale after it)."""
        columns = 1 if answers.ndim == 1 else answers.shape[1]
        heads = list(self.heads) if self.heads and len(self.heads) == columns else []
        return np.array([1.0 if h.binary else max(1.0, abs(h.scale)) for h in heads]
                        or [1.0] * columns, np.float32)


def warm_up() -> None:
    """Export and run a one-layer model once: the exporter's and ONNX Runtime's first call (imports, lazily built
    tables: about a second on a loaded machine) then happens before a first version is loaded, not during it."""
    class _One(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = torch.nn.Linear(2, 1)

        def forward(self, dense, embeddings):
            return self.linear(dense).squeeze(-1)

    if _cannot("fp32") is None:
        one = CompiledDense.export(_One().eval(), [], PooledEmbeddings(), 2, key="warm-up")
        one(np.zeros((1, 2), np.float32), PooledEmbeddings())


def _session(graph: bytes):
    import onnxruntime

    options = onnxruntime.SessionOptions()
    options.intra_op_num_threads = options.inter_op_num_threads = 1  # one request's work: one thread
    options.execution_mode = onnxruntime.ExecutionMode.ORT_SEQUENTIAL
    options.log_severity_level = 3
    return onnxruntime.InferenceSession(graph, options, providers=["CPUExecutionProvider"])


def _architecture(model: torch.nn.Module, slots: list[FlatInput], num_dense: int, heads: tuple[TaskConfig, ...]) -> str:
    """What must match for one export to serve another version: the model's class and structure (its repr:
    layers and their sizes), the flat signature, the outputs' tasks, and every weight's name, shape
    and dtype."""
    weights = [(name, tuple(t.shape), str(t.dtype)) for name, t in _Flat(model, slots).state_dict().items()]
    return repr((type(model).__module__, type(model).__qualname__, repr(model), slots, num_dense, tuple(heads),
                 weights))


class _Templates:
    """The last `TEMPLATES_KEPT` exported graphs, by architecture, to put a later version's weights into."""

    def __init__(self):
        self._lock = threading.Lock()
        self._graphs: dict[str, tuple[bytes, list[str]]] = {}

    def keep(self, key: str, graph: bytes, names: list[str]) -> None:
        with self._lock:
            self._graphs.pop(key, None)
            self._graphs[key] = (graph, names)
            while len(self._graphs) > TEMPLATES_KEPT:
                del self._graphs[next(iter(self._graphs))]

    def reweight(self, key: str, model: torch.nn.Module, slots: list[FlatInput],
                 heads: tuple[TaskConfig, ...] = ()) -> CompiledDense | None:
        """`model` in a session of the graph exported for its architecture, with its own weights; None when
        there is none (or ONNX Runtime refuses it: the caller exports afresh). Still to be checked (`_differs`)."""
        with self._lock:
            found = self._graphs.get(key)
        if found is None:
            return None
        import onnx
        from onnx import numpy_helper

        graph, names = found
        proto = onnx.ModelProto()
        proto.ParseFromString(graph)
        state = _Flat(model, slots).state_dict()
        try:
            for init in proto.graph.initializer:
                if init.name in state:  # others are the graph's own constants (the heads' masks, offsets): kept
                    init.CopyFrom(numpy_helper.from_array(state[init.name].detach().cpu().numpy(), init.name))
            return CompiledDense(_session(proto.SerializeToString()), slots, names, reweighted=True, heads=heads)
        except Exception as exc:  # noqa: BLE001 - an initializer that is not a weight, a refused graph: export
            log.get().info("dense_forward_reexported", why=f"{type(exc).__name__}: {exc}")
            return None


_TEMPLATES = _Templates()


def _cannot(precision: str) -> str | None:
    if precision == "bf16":
        return "a bf16 bundle is answered under CPU autocast, as it was evaluated"
    try:
        import onnxruntime  # noqa: F401
    except ImportError:
        return "onnxruntime is not installed"
    return None


def _random_inputs(slots: list[FlatInput], pooled: PooledEmbeddings, num_dense: int, *, rows: int,
                   seed: int) -> list[torch.Tensor]:
    """Inputs of the flat signature shaped like `pooled`'s but `rows` long, with random values (sequences
    of random lengths, empty ones included)."""
    gen = torch.Generator().manual_seed(seed)
    out = [torch.randn(rows, num_dense, generator=gen)]
    shaped = iter(flat_inputs(slots, pooled))
    for slot in slots:
        values = next(shaped)
        out.append(torch.randn((rows, *values.shape[1:]), generator=gen) * 0.5)
        if slot.sequence:
            next(shaped)
            out.append(torch.randint(0, values.shape[1] + 1, (rows,), generator=gen))
    return out
