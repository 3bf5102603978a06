"""On the NN worker: handing the dense state from one rank to every other, after the group was re-formed.

Collective, on the compute thread, right after `Membership.join` returned a
plan with a source rank: the source broadcasts a JSON description (its step
and counters, and the layout of its optimizer state), then every model
parameter and buffer, then every optimizer-state tensor in that layout's
order. Ranks that are already identical (the survivors) receive the same
values they hold; a replacement builds its optimizer state from the layout
and loads it. Only tensors and JSON cross: no pickle.

Each tensor travels on its own device through the group that serves it
(`distributed.group_for`): the JSON and, say, Adam's CPU `step` counters
through the control group; parameters and moments on the GPU through NCCL.
The layout records each state tensor's device kind, so a replacement
allocates it where the source holds it.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from services.nn_worker.group.distributed import broadcast_parameters, control_group, group_for

STATS_FIELDS = ("steps", "samples", "loss_sum", "loss_count", "last_loss", "train_auc", "restored_samples")
"""The trainer counters a replacement takes over from its source (the per-rank share of the run)."""


@dataclass(frozen=True)
class Handed:
    """What the source's description said, as the receiving rank applies it."""

    stats: dict[str, Any]  # numbers, and lists of them (the trainer's steps per data loader)
    wall_s: float


def _broadcast_json(value: Any, source: int) -> Any:
    data = json.dumps(value).encode() if dist.get_rank() == source else b""
    size = torch.tensor([len(data)], dtype=torch.int64)
    dist.broadcast(size, src=source, group=control_group())
    buf = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(int(size), dtype=torch.uint8)
    dist.broadcast(buf, src=source, group=control_group())
    return json.loads(bytes(buf.numpy()).decode())


def _layout(optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The optimizer's state_dict with each tensor replaced by ["tensor", shape, dtype, device kind]."""
    state = optimizer.state_dict()
    layout = {}
    for index, entry in state["state"].items():
        layout[str(index)] = {key: (["tensor", list(value.shape), str(value.dtype).removeprefix("torch."),
                                     value.device.type] if torch.is_tensor(value) else ["value", value])
                              for key, value in entry.items()}
    return {"state": layout, "param_groups": state["param_groups"]}


def _tensors_in_order(layout: dict[str, Any]) -> list[tuple[str, str]]:
    return [(index, key) for index in sorted(layout["state"], key=int)
            for key in sorted(layout["state"][index]) if layout["state"][index][key][0] == "tensor"]


def hand_over(model: torch.nn.Module, optimizer: torch.optim.Optimizer, stats: dict[str, Any],
              wall_s: float, source: int) -> Handed:
    """Make every rank's model and optimizer equal to `source`'s; returns the source's counters."""
    mine = dist.get_rank() == source
    device = next(model.parameters()).device  # the rank's device: where a state tensor not on the CPU belongs
    description = _broadcast_json({"stats": stats, "wall_s": wall_s, "optimizer": _layout(optimizer)} if mine
                                  else None, source)
    broadcast_parameters(model, source)
    layout = description["optimizer"]
    current = optimizer.state_dict()["state"]
    state: dict[int, dict[str, Any]] = {}
    for index, entry in layout["state"].items():
        state[int(index)] = {key: spec[1] for key, spec in entry.items() if spec[0] == "value"}
    for index, key in _tensors_in_order(layout):
        _, shape, dtype, kind = layout["state"][index][key]
        held = current.get(int(index), {}).get(key) if mine else None
        tensor = held if held is not None else torch.empty(shape, dtype=getattr(torch, dtype),
                                                           device="cpu" if kind == "cpu" else device)
        dist.broadcast(tensor, src=source, group=group_for(tensor))
        state[int(index)][key] = tensor
    if not mine:
        optimizer.load_state_dict({"state": state, "param_groups": layout["param_groups"]})
    return Handed({k: v if isinstance(v, list) else float(v) for k, v in description["stats"].items()},
                  float(description["wall_s"]))
