"""Spawned ranks for tests/unit/test_membership.py (a module of its own so that spawn can import it)."""
from __future__ import annotations

import json
import os
import traceback
from pathlib import Path

WORLD = 2


def _membership(rank: int, port: int, fingerprint, timeout_s: float):
    from services.nn_worker.group.membership import Membership

    return Membership(rank=rank, world_size=WORLD, rendezvous=f"127.0.0.1:{port}", fingerprint=fingerprint,
                      backend="gloo", bind_host="127.0.0.1", join_timeout_s=timeout_s, collective_timeout_s=30)


def _model_and_optimizer(seed: int):
    import torch

    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    return model, torch.optim.Adam(model.parameters(), lr=0.01)


def handover_rank(rank: int, port: int, out_dir: str) -> None:
    """Rank 0 trains 5 Adam steps, 'loses' its peer, and the fresh rank 1 takes its state in generation 2."""
    out = Path(out_dir)
    try:
        import torch
        import torch.distributed as dist

        from services.nn_worker.group.handover import hand_over
        from services.nn_worker.group.membership import Fingerprint

        torch.set_num_threads(1)
        fingerprint = Fingerprint("cfg", WORLD, "model")
        membership = _membership(rank, port, fingerprint, 60)
        first = membership.join(step=None)
        model, optimizer = _model_and_optimizer(seed=rank)  # different on purpose: the hand-over equalises
        step = None
        if rank == 0:
            for _ in range(5):
                optimizer.zero_grad()
                model(torch.randn(16, 4)).pow(2).mean().backward()
                optimizer.step()
            step = 5
        dist.barrier()
        plan = membership.join(step=step)  # a second round: rank 0 has state, rank 1 has none
        handed = hand_over(model, optimizer, {"steps": float(step or 0)}, 12.5, plan.source)
        params = torch.nn.utils.parameters_to_vector(model.parameters()).detach().numpy().tolist()
        state = optimizer.state_dict()["state"]
        moments = [float(state[i]["exp_avg"].sum()) for i in sorted(state)]
        steps = [float(state[i]["step"]) for i in sorted(state)]
        (out / f"rank{rank}.json").write_text(json.dumps({
            "first": [first.generation, first.source], "second": [plan.generation, plan.source,
                                                               list(plan.joined_fresh)],
            "params": params, "moments": moments, "steps": steps, "handed": handed.stats, "wall": handed.wall_s}))
        dist.destroy_process_group()
    except BaseException:
        (out / f"rank{rank}.err").write_text(traceback.format_exc())
        os._exit(3)


def refusal_rank(rank: int, port: int, out_dir: str, config_tag: str, timeout_s: float) -> None:
    """Join once with fingerprint config `config_tag`; write what happened."""
    out = Path(out_dir)
    try:
        from services.nn_worker.group.membership import Fingerprint, MembershipError

        membership = _membership(rank, port, Fingerprint(config_tag, WORLD, "model"), timeout_s)
        (out / f"rank{rank}-{config_tag}.ready").touch()  # imported: joins within a second from here
        try:
            plan = membership.join(step=None)
            import torch.distributed as dist

            # Both ranks are in the group before either leaves: a rank that exits at once could close its side
            # while its peer still connects to it (and this says the group works)
            dist.barrier()
            result = {"joined": plan.generation}
            dist.destroy_process_group()
        except MembershipError as exc:
            result = {"error": str(exc)}
        (out / f"rank{rank}-{config_tag}.json").write_text(json.dumps(result))
        os._exit(0)
    except BaseException:
        (out / f"rank{rank}.err").write_text(traceback.format_exc())
        os._exit(3)
