"""On the inference service: serve the newest live version of a training job (docs/serving.md#live-versions).

`FollowSource(root)` is a model source with the `current()` seam: a
background thread polls the versions directory (`hybridrec.core.layouts.versions.Follower`
loads, verifies and merges), builds the new version's dense module, and then
swaps embedding table and dense module together by replacing one reference.
A request handler calls `current()` once per micro-batch and uses only what
it got, so no response mixes two versions, and nothing a request holds is
ever modified (a newer version is a new object). A version that does not
verify is skipped with a logged reason and the previous one keeps serving.

`hybridrec serve inference --follow DIR` (services/inference/server.py)
builds `FollowSource(DIR, make_model=inference_model)`, starts it (waiting
for a first version), hands it to the batcher as its model source, registers
`stats` as metrics, and stops it on shutdown.
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from hybridrec.core.runtime import log
from hybridrec.core.layouts.bundle import BundleManifest, EmbeddingTable
from hybridrec.core.layouts.versions import Follower, Snapshot, version_age_s
from services.inference.model import build_dense

POLL_S = 0.5


@dataclass(frozen=True)
class FollowedModel:
    """One served version: what `current()` returns unless the service passes its own `make_model`."""

    version: int
    step: int
    manifest: BundleManifest
    dense: torch.nn.Module
    table: EmbeddingTable
    published: float
    """Unix time the version was published."""


def inference_model(snapshot: Snapshot, dense: torch.nn.Module, *, compile: bool = True) -> Any:
    """make_model for the inference service: its LoadedModel over the version's merged table, in this process
    (`compile`: its dense forward in ONNX Runtime, services.inference.compiled)."""
    from services.inference.model import LocalTable, assemble

    return assemble(snapshot.manifest, dense, LocalTable(snapshot.table), compile=compile)


def _default_make_model(snapshot: Snapshot, dense: torch.nn.Module) -> FollowedModel:
    return FollowedModel(snapshot.version, snapshot.step, snapshot.manifest, dense, snapshot.table,
                         snapshot.published)


class FollowSource:
    """The newest verified version of a versions directory, swapped in the background."""

    def __init__(self, root: str | Path, *, poll_s: float = POLL_S, check: bool = True,
                 make_model: Callable[[Snapshot, torch.nn.Module], Any] = _default_make_model,
                 warm_up: Callable[[], None] | None = None):
        """`warm_up`: what to load before the first poll (kernels, the exporter), so that a first version
        published meanwhile is not kept waiting by it; the table lookup's kernel is always loaded."""
        self.root = Path(root)
        self.poll_s = poll_s
        self.make_model = make_model
        self.warm_up = warm_up
        self.follower = Follower(self.root, check=check, build=self._build)
        self.log = log.get()
        self._current: Any = None
        self._served: Snapshot | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._loaded = threading.Event()
        self.swaps = 0
        self.load_errors = 0
        self.last_swap_lag_s = float("nan")
        self.last_load_s = float("nan")

    # -- the seam ---------------------------------------------------------------------------
    def current(self) -> Any:
        """The model being served (one reference, read once per micro-batch); LookupError before the first."""
        model = self._current
        if model is None:
            raise LookupError(f"no complete version under {self.root} yet")
        return model

    # -- loading ----------------------------------------------------------------------------
    def poll_once(self) -> bool:
        """Load and swap in a newer version if there is one; True if it swapped. (The background thread's
        step; tests call it directly.)"""
        started = time.monotonic()
        snapshot = self.follower.poll()  # loads, verifies, merges and builds (`_build`) off the request path
        if snapshot is None:
            return False
        self._current, self._served = self.follower.built, snapshot  # the swap: one reference
        self.swaps += 1
        self.last_load_s = time.monotonic() - started
        self.last_swap_lag_s = version_age_s(snapshot)
        self._loaded.set()
        self.log.info("version_swapped", version=snapshot.version, step=snapshot.step,
                      base_version=snapshot.manifest.base_version, load_s=round(self.last_load_s, 3),
                      lag_s=round(self.last_swap_lag_s, 3), behind=self.follower.behind,
                      passed_over=self.follower.passed_over)
        return True

    def _build(self, snapshot: Snapshot) -> Any:
        return self.make_model(snapshot, build_dense(snapshot.manifest, snapshot.dense_state))

    def _run(self) -> None:
        from hybridrec.core.model import table_lookup

        # numba's first kernel load (about 0.7 s of a cold 1.1 s first load on this machine, several seconds
        # while a run starts beside it) and the exporter's first call are paid now, while no version may exist
        # yet, not by the first swap.
        started = time.monotonic()
        table_lookup.warm_up()
        if self.warm_up is not None:
            self.warm_up()
        self.log.info("follow_warmed", seconds=round(time.monotonic() - started, 3))
        while not self._stop.is_set():
            try:
                if self.poll_once():
                    continue  # versions published while this one loaded are picked up now, not a poll later
            except Exception as exc:  # noqa: BLE001 - a bad version must not stop following; logged, counted
                self.load_errors += 1
                self.log.warning("version_load_failed", error=f"{type(exc).__name__}: {exc}")
            self._stop.wait(self.poll_s)

    def start(self, wait_s: float | None = None) -> "FollowSource":
        """Start following; with `wait_s`, block until a first version is served (TimeoutError after it)."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="follow-versions", daemon=True)
            self._thread.start()
        if wait_s is not None and not self._loaded.wait(wait_s):
            raise TimeoutError(f"no complete, verified version under {self.root} after {wait_s:.0f} s")
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    # -- metrics ----------------------------------------------------------------------------
    def stats(self) -> dict[str, float]:
        """Prometheus values (`hybridrec.core.runtime.metrics.register_stats("inference", replica, source.stats)`)."""
        served = self._served
        return {
            "served_version": float(served.version if served else 0),
            "served_step": float(served.step if served else 0),
            "version_age_seconds": version_age_s(served),
            "versions_behind": float(self.follower.behind),
            "newest_version": float(self.follower.newest_seen),
            "version_swaps_total": float(self.swaps),
            "versions_skipped_total": float(len(self.follower.skipped)),
            "version_load_errors_total": float(self.load_errors),
            "last_swap_lag_seconds": self.last_swap_lag_s,
            "last_version_load_seconds": self.last_load_s,
        }
