"""Spawned ranks for tests/unit/test_gpu_path.py: the NN worker's CPU (control) collectives in a group whose
default backend, like NCCL, serves no CPU tensors (`cuda:gloo`: Gloo registered for CUDA tensors only).

Each rank forms the group through `Membership.join`, checks that the default group really refuses a CPU
tensor, then runs every control collective of the NN worker in the order the service does — the time-checkpoint
vote, the checkpoint's position gather and barrier (and its postponement while a replacement's count is
incomplete), DenseSync's parameter broadcast and averaging of a CPU
model, the hand-over to a fresh rank, the evaluation gather and the statistics reduction — and writes what
each returned.
"""
from __future__ import annotations

import asyncio
import json
import os
import traceback
from pathlib import Path
from types import SimpleNamespace

import numpy as np

WORLD = 2


def rank_main(rank: int, port: int, out_dir: str) -> None:
    out = Path(out_dir)
    try:
        import torch
        import torch.distributed as dist

        from hybridrec.core.config import Config, TrainingConfig
        from services.nn_worker.checkpoint import Checkpointer
        from services.nn_worker.group.distributed import DenseSync, DistEnv, barrier
        from services.nn_worker.group.handover import hand_over
        from services.nn_worker.group.membership import Fingerprint, Membership
        from services.nn_worker.results import gather_eval, reduce_stats
        from services.nn_worker.stats import TrainStats

        torch.set_num_threads(1)
        Membership(rank=rank, world_size=WORLD, rendezvous=f"127.0.0.1:{port}", backend="cuda:gloo",
                   fingerprint=Fingerprint("test", WORLD, "test"), bind_host="127.0.0.1", join_timeout_s=60,
                   collective_timeout_s=60).join(step=None)
        result: dict = {}
        try:  # the premise: the default group takes no CPU tensor, as under NCCL
            dist.all_reduce(torch.ones(1))
            result["default_group_took_cpu"] = True
        except RuntimeError as exc:
            result["default_group_took_cpu"] = False
            result["default_group_error"] = str(exc).splitlines()[0]

        config = Config.model_validate({"data": {"train": ["train.tsv"]},
                                        "checkpoint": {"dir": str(out / "ckpt"), "interval_s": 1.0},
                                        "cluster": {"nn_workers": ["127.0.0.1:0"] * WORLD}})
        stats = TrainStats(steps=10, samples=1000 * (rank + 1), loss_sum=2.0, loss_count=4, started=0.0,
                           finished=1.0, staleness_hist=np.array([3, 1], np.int64))
        trainer = SimpleNamespace(stats=stats, env=SimpleNamespace(world_size=WORLD))
        checkpointer = Checkpointer(config, rank, WORLD)
        checkpointer.last_time -= 5.0 * (rank == 1)  # only rank 1's interval is up: the vote is a MAX
        result["time_up"] = checkpointer.time_up()
        ((seq, position),), samples = checkpointer._gather_position([(40 + rank, (0, rank, 7, 8))], stats.samples)
        result["position"] = [seq, list(position), samples]

        async def direct(fn, *args, after_regroup=None):
            return fn(*args)

        # rank 1 a replacement that has not yet counted its predecessor's share: neither rank writes
        replacement = SimpleNamespace(stats=stats, samples_counted=rank == 0, collective=direct)
        asyncio.run(checkpointer.save(replacement, 10, [(40 + rank, (0, rank, 7, 8))]))
        result["postponed"] = [checkpointer.last_saved, (out / "ckpt").exists()]
        barrier()

        env = DistEnv(rank=rank, world_size=WORLD, backend="cuda:gloo", device=torch.device("cpu"))
        torch.manual_seed(rank)
        model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.ReLU(), torch.nn.Linear(4, 1))
        sync = DenseSync(model, env, TrainingConfig(mode="async", sync_interval=1))  # broadcast from rank 0
        result["broadcast"] = torch.nn.utils.parameters_to_vector(model.parameters()).tolist()
        with torch.no_grad():
            for p in model.parameters():
                p.add_(float(rank))
        sync.after_step(1)  # averaged: rank 0's weights + 0.5
        result["averaged"] = torch.nn.utils.parameters_to_vector(model.parameters()).tolist()

        optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
        if rank == 0:
            model(torch.ones(2, 3)).sum().backward()
            optimizer.step()
        handed = hand_over(model, optimizer, {"steps": 10.0 + rank}, 3.5, source=0)
        state = optimizer.state_dict()["state"]
        result["handed"] = [handed.stats, handed.wall_s, [float(state[i]["exp_avg"].sum()) for i in sorted(state)]]

        preds = np.full(rank + 1, 0.25 * (rank + 1), np.float32)
        all_preds, all_labels = gather_eval(preds, np.ones_like(preds), WORLD)
        result["eval"] = [all_preds.tolist(), all_labels.tolist()]
        totals = reduce_stats(trainer)
        result["totals"] = {k: totals[k] for k in ("samples", "steps", "staleness_hist", "mean_train_loss")}
        barrier()
        dist.destroy_process_group()
        (out / f"rank{rank}.json").write_text(json.dumps(result))
    except BaseException:
        (out / f"rank{rank}.err").write_text(traceback.format_exc())
        os._exit(3)


def nccl_rank_main(port: int, out_dir: str) -> None:
    """One NCCL rank on a GPU (CUDA hosts only): group formation with its control group, a DDP step, the
    checkpoint vote, a hand-over of GPU state, and its checkpoint read back on the CPU."""
    out = Path(out_dir)
    try:
        import torch

        from hybridrec.core.config import Config, TrainingConfig
        from services.nn_worker.checkpoint import Checkpointer, load_dense, on_cpu
        from services.nn_worker.group.distributed import DenseSync, close_groups, control_group, resolve_backend
        from services.nn_worker.group.handover import hand_over
        from services.nn_worker.group.membership import Fingerprint, Membership

        env = resolve_backend("nccl", 0, 1)
        env.bind_thread()
        Membership(rank=0, world_size=1, rendezvous=f"127.0.0.1:{port}", backend=env.backend, device=env.device,
                   fingerprint=Fingerprint("test", 1, "test"), bind_host="127.0.0.1", join_timeout_s=60,
                   collective_timeout_s=60, dense_timeout_s=60).join(step=None)
        model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.ReLU(), torch.nn.Linear(4, 1)).to(env.device)
        sync = DenseSync(model, env, TrainingConfig(mode="hybrid"))
        optimizer = torch.optim.Adam(sync.module.parameters(), lr=0.01)
        sync.module(torch.ones(2, 3, device=env.device)).sum().backward()
        optimizer.step()
        config = Config.model_validate({"data": {"train": ["train.tsv"]}, "cluster": {"nn_workers": ["a:1"]},
                                        "checkpoint": {"dir": str(out / "ckpt"), "interval_s": 1000.0}})
        time_up = Checkpointer(config, 0, 1).time_up()
        hand_over(model, optimizer, {"steps": 1.0}, 1.0, source=0)
        state = optimizer.state_dict()["state"][0]
        torch.save(on_cpu({"model": model.state_dict(), "optimizer": optimizer.state_dict()}), out / "dense.pt")
        cpu_model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.ReLU(), torch.nn.Linear(4, 1))
        load_dense(out / "dense.pt", cpu_model, torch.optim.Adam(cpu_model.parameters(), lr=0.01))
        reloaded = torch.equal(cpu_model[0].weight, model[0].weight.cpu())
        result = {"backend": env.backend, "control_group": control_group() is not None, "time_up": time_up,
                  "state_devices": {k: state[k].device.type for k in ("exp_avg", "step")},
                  "reloaded_on_cpu": reloaded}
        close_groups()
        (out / "nccl.json").write_text(json.dumps(result))
    except BaseException:
        (out / "nccl.err").write_text(traceback.format_exc())
        os._exit(3)
