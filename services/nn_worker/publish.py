"""On NN worker rank 0: publishing live model versions while training (docs/serving.md#live-versions).

Every `publish.interval_steps` steps (or `publish.interval_s` seconds) the
trainer calls `maybe_publish`: the dense state_dict is copied on the compute
thread (where every torch call runs; a copy, because training goes on
mutating the parameters), and the rest runs as a background task so training
does not wait for it:

1. every PS shard writes its rows of version v (`EmbeddingPS.Publish`): a full
   snapshot every `publish.full_every`-th version, otherwise the rows changed
   since version v-1 (the previous complete version). A shard that cannot
   write that delta (it restarted, or an earlier publish failed) answers
   FAILED_PRECONDITION, and every shard is asked again for a full snapshot;
2. rank 0 writes `dense.pt`, then the manifest last and atomically (listing
   every file with its size and sha256): a directory without it is incomplete;
3. old versions are compacted (`hybridrec.core.layouts.versions.compact`).

At most one publish is in flight: a step interval that comes while one is
still running is skipped and counted; a time interval waits for it, and a
version that took longer than `interval_s` to write starts the next interval
when it is complete, so versions stay `interval_s` apart (a follower that polls
more often serves each: two written back to back, the second 70 ms after the
first, were merged into one swap). A failed publish is logged and counted, its
directory removed, and the next version is a full snapshot; training goes on.
The version is a snapshot of the PS as it is at that moment, not a
synchronised cut: other ranks' updates may be in flight (as for any lookup in
hybrid training).
"""
from __future__ import annotations

import asyncio
import shutil
import time
from concurrent.futures import Executor
from pathlib import Path
from typing import Any

import grpc
import torch
from pydantic import Field

from hybridrec.core.runtime import log, rpc
from hybridrec.core.layouts.bundle import (CONFIG, DENSE, MANIFEST, BundleManifest, FileEntry, file_entry, input_types,
                             write_config)
from hybridrec.core.config import Config
from hybridrec.core.layouts.files import write_json_atomic
from hybridrec.core.layouts.summary import PublishSummary
from hybridrec.core.wire.proto import pb
from hybridrec.core.layouts.versions import compact, newest_version_number, version_dir

PS_TIMEOUT_S = 600.0


class PublishStats(PublishSummary):
    """The publisher's record as it goes: the run summary's counters (`PublishSummary`'s fields, defined
    once there) and the figures of each version that the summary's means and maximum are made of."""

    seconds: list[float] = Field(default_factory=list)
    """Wall time of each published version, from the dense copy to the manifest."""
    delta_rows: list[int] = Field(default_factory=list)
    """Rows written by each delta version (all shards and widths)."""
    full_rows: list[int] = Field(default_factory=list)
    """Rows written by each full snapshot."""

    def summary(self, directory: str) -> PublishSummary:
        """The run summary's `publish` field: the counters, and each figure's mean (none without versions)."""
        mean = lambda xs: sum(xs) / len(xs) if xs else None  # noqa: E731
        counters = self.model_dump(include=set(PublishSummary.model_fields))
        return PublishSummary(**{**counters, "mean_s": mean(self.seconds), "max_s": max(self.seconds, default=None),
                                 "mean_delta_rows": mean(self.delta_rows), "mean_full_rows": mean(self.full_rows),
                                 "directory": directory})


class Publisher:
    """Built before the trainer (server.py), with what it needs of the training process: the dense `model` the
    trainer trains and the `compute` thread every torch call runs on (a state_dict copy is one). Takes the whole
    config, not only its `publish` section: every version carries the job's config and its schema."""

    def __init__(self, config: Config, model: torch.nn.Module, compute: Executor):
        p = config.publish
        if not p.dir:
            raise ValueError("publish.dir must be set when publish.interval_steps or publish.interval_s is")
        self.config, self.model, self.compute = config, model, compute
        self.root = Path(p.dir)
        self.root.mkdir(parents=True, exist_ok=True)
        self.interval_steps, self.interval_s = p.interval_steps, p.interval_s
        self.full_every, self.keep, self.at_end = p.full_every, p.keep, p.at_end
        self.ps_addresses = config.cluster.ps
        self.input_types = input_types(config)  # read once: the training data's schema does not change
        self.next_version = newest_version_number(self.root) + 1  # a restarted job goes on numbering
        self.base: int | None = None  # the last version this job completed: a delta's base
        self.since_full = 0
        self.last_started = time.monotonic()  # the time interval's start: see `start_clock`
        self.task: asyncio.Task | None = None
        self.finished = False  # the final version was published
        self.stats = PublishStats()
        self.log = log.get()

    def start_clock(self) -> None:
        """Count the time interval from now: the server calls it once the group is set up and restored from a
        checkpoint, right before training (the publisher is built before the trainer, so that set-up would
        otherwise count towards the first interval)."""
        self.last_started = time.monotonic()

    def due(self, step: int) -> bool:
        if self.interval_steps and step % self.interval_steps == 0:
            return True
        return bool(self.interval_s) and time.monotonic() - self.last_started >= self.interval_s

    async def maybe_publish(self, step: int) -> None:
        """Called by the trainer after every step; starts a publish in the background when one is due."""
        if not self.due(step):
            return
        if self.task is not None and not self.task.done():
            if self.interval_steps and step % self.interval_steps == 0:
                self.stats.skipped += 1
                self.log.warning("publish_skipped", step=step, reason="the previous version is still being written")
            return  # a time interval waits for it (its clock restarts when it is done: `_publish`)
        await self._start(step)

    async def _start(self, step: int) -> None:
        self.last_started = time.monotonic()
        state = await asyncio.get_running_loop().run_in_executor(self.compute, self._dense_copy)
        version, self.next_version = self.next_version, self.next_version + 1
        self.task = asyncio.ensure_future(self._publish(version, step, state, self.last_started))

    async def finish(self, step: int) -> None:
        """At the end of training (after the final checkpoint's barrier, when there is one: every rank's updates
        are applied): wait for the publish in flight, then publish the final state (publish.at_end)."""
        if self.task is not None:
            await self.task
        if self.at_end and not self.finished:
            self.finished = True
            await self._start(step)
            await self.task

    def _dense_copy(self) -> dict[str, torch.Tensor]:
        return {k: v.detach().to("cpu", copy=True) for k, v in self.model.state_dict().items()}

    async def _ps_publish(self, version: int, full: bool) -> list[pb.PublishReply]:
        async def one(address: str) -> pb.PublishReply:
            async with rpc.channel(address) as ch:
                call = rpc.control_method(ch, "EmbeddingPS", "Publish")
                request = pb.PublishRequest(version=version, full=full, base_version=self.base or 0)
                return await rpc.retry(lambda: call(request, timeout=PS_TIMEOUT_S), deadline_s=PS_TIMEOUT_S)

        return await asyncio.gather(*(one(a) for a in self.ps_addresses))

    async def _publish(self, version: int, step: int, state: dict[str, Any], started: float) -> None:
        try:
            await self._write_version(version, step, state, started)
        finally:
            if self.interval_s and time.monotonic() - self.last_started >= self.interval_s:
                self.last_started = time.monotonic()  # it overran its interval: the next one starts now

    async def _write_version(self, version: int, step: int, state: dict[str, Any], started: float) -> None:
        path = version_dir(self.root, version)
        full = self.base is None or self.since_full + 1 >= self.full_every
        try:
            try:
                replies = await self._ps_publish(version, full)
            except grpc.aio.AioRpcError as exc:
                if full or exc.code() != grpc.StatusCode.FAILED_PRECONDITION:
                    raise
                self.log.info("publish_full_instead", version=version, reason=exc.details())
                full = True
                replies = await self._ps_publish(version, True)
            files: dict[str, FileEntry] = {}
            rows: dict[int, int] = {}
            for reply in replies:
                files.update({f.path: FileEntry(bytes=f.bytes, sha256=f.sha256) for f in reply.files})
                for dim, n in reply.rows_by_dim.items():
                    rows[dim] = rows.get(dim, 0) + n
            t = self.config.training
            manifest = BundleManifest(
                version=version, base_version=None if full else self.base, step=step,
                features=list(self.config.features), num_dense=self.config.num_dense, model=self.config.model,
                num_tasks=self.config.num_tasks,
                precision=t.precision, num_shards=len(self.ps_addresses), rows=rows, files=files,
                input_types=self.input_types, dense_columns=self.config.dense_columns,
                tasks=self.config.data.label_names, heads=self.config.data.tasks)
            await asyncio.get_running_loop().run_in_executor(None, self._write_dense_and_manifest, path, state,
                                                             manifest, self.config)
        except Exception as exc:  # noqa: BLE001 - a failed version is counted; training goes on
            self.stats.failed += 1
            self.base = None  # the shards' change logs may have moved on: the next version is full
            self.log.warning("publish_failed", version=version, step=step, error=str(exc))
            shutil.rmtree(path, ignore_errors=True)
            return
        seconds = time.monotonic() - started
        total = sum(rows.values())
        self.base, self.since_full = version, 0 if full else self.since_full + 1
        s = self.stats
        s.published += 1
        s.full += full
        s.last_version, s.last_step = version, step
        s.seconds.append(seconds)
        (s.full_rows if full else s.delta_rows).append(total)
        self.log.info("version_published", version=version, step=step, full=full, rows=total,
                      seconds=round(seconds, 3))
        try:
            removed = await asyncio.get_running_loop().run_in_executor(None, compact, self.root, self.keep)
            if removed:
                self.log.info("versions_compacted", removed=removed)
        except OSError as exc:
            self.log.warning("compaction_failed", error=str(exc))

    @staticmethod
    def _write_dense_and_manifest(path: Path, state: dict[str, Any], manifest: BundleManifest,
                                  config: Config) -> None:
        path.mkdir(parents=True, exist_ok=True)
        torch.save(state, path / DENSE)
        manifest.files[DENSE] = file_entry(path / DENSE)
        manifest.files[CONFIG] = write_config(config, path)
        manifest.created = time.time()
        write_json_atomic(path / MANIFEST, manifest.model_dump(mode="json"))

    def summary(self) -> PublishSummary:
        """What goes into the run summary's `publish` field."""
        return self.stats.summary(str(self.root))

    def metrics(self) -> dict[str, float]:
        s = self.stats
        return {"versions_published_total": s.published, "versions_skipped_total": s.skipped,
                "versions_failed_total": s.failed, "published_version": s.last_version or 0,
                "last_publish_seconds": s.seconds[-1] if s.seconds else 0.0}
