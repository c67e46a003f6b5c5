"""The inner optimizer of every strategy: AdamW, or Muon for the hidden matrices (MuLoCo).

Muon (`torch.optim.Muon`) orthogonalises the momentum of a 2-D weight; it takes only 2-D
parameters, and its authors, MuLoCo and Moonlight keep AdamW for embeddings, norms and biases.
So with `inner_optimizer="muon"` the weights of `nn.Linear` layers go to Muon and everything
else (embeddings and a head tied to them, positions, norms, biases) to AdamW. Muon's step is
scaled to AdamW's update size (`adjust_lr_fn="match_rms_adamw"`, as Moonlight), so one inner lr
and its schedule drive both; the drivers set `group["lr"]` on `param_groups` as for AdamW alone.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from trainer.config import TrainConfig


class CombinedOptimizer:
    """Several torch optimizers stepped as one (the learner and the ddp loop need one object).

    `param_groups` is the concatenation of theirs (the same dicts, so setting a group's lr
    reaches the optimizer that owns it); the state dict holds one entry per optimizer."""

    def __init__(self, optimizers: list[torch.optim.Optimizer]) -> None:
        self.optimizers = optimizers

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return [g for o in self.optimizers for g in o.param_groups]

    @property
    def state(self) -> dict:
        """Per-parameter state of all the optimizers (a parameter belongs to one of them)."""
        out: dict = {}
        for o in self.optimizers:
            out.update(o.state)
        return out

    def step(self) -> None:
        for o in self.optimizers:
            o.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for o in self.optimizers:
            o.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict[str, Any]:
        return {"optimizers": [o.state_dict() for o in self.optimizers]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        parts = state.get("optimizers")
        if parts is None or len(parts) != len(self.optimizers):
            raise ValueError("optimizer state does not match the inner optimizer (adamw / muon)")
        for o, s in zip(self.optimizers, parts, strict=True):
            o.load_state_dict(s)

    def forget(self, params: list[torch.Tensor]) -> None:
        """Drop the state (moments, step counts) of these parameters: they start afresh."""
        for o in self.optimizers:
            for p in params:
                o.state.pop(p, None)


def forget_state(optimizer: Any, params: list[torch.Tensor]) -> None:
    """Drop the optimizer state of `params` (AdamW alone or combined)."""
    if isinstance(optimizer, CombinedOptimizer):
        optimizer.forget(params)
        return
    for p in params:
        optimizer.state.pop(p, None)


def _adamw(groups: list[dict], config: TrainConfig, device: torch.device) -> torch.optim.AdamW:
    kwargs = {"fused": True} if device.type in ("cpu", "cuda") else {}
    return torch.optim.AdamW(groups, lr=config.inner_lr, betas=tuple(config.betas), **kwargs)


def muon_params(model: nn.Module) -> list[torch.Tensor]:
    """The hidden matrices Muon takes: weights of `nn.Linear` layers (a tied head is an embedding)."""
    embedded = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    out, seen = [], set()
    for m in model.modules():
        w = getattr(m, "weight", None)
        if isinstance(m, nn.Linear) and w.requires_grad and id(w) not in embedded and id(w) not in seen:
            seen.add(id(w))
            out.append(w)
    return out


def make_optimizer(model: nn.Module, config: TrainConfig, device: torch.device) -> Any:
    """The inner optimizer `config.inner_optimizer` names, weight decay on matrices only."""
    params = [p for p in model.parameters() if p.requires_grad]
    hidden = muon_params(model) if config.inner_optimizer == "muon" else []
    taken = {id(p) for p in hidden}
    rest = [p for p in params if id(p) not in taken]
    groups = [
        {"params": [p for p in rest if p.dim() >= 2], "weight_decay": config.weight_decay},
        {"params": [p for p in rest if p.dim() < 2], "weight_decay": 0.0},
    ]
    adamw = _adamw(groups, config, device)
    if not hidden:
        return adamw
    muon = torch.optim.Muon(
        hidden, lr=config.inner_lr, weight_decay=config.weight_decay,
        momentum=config.muon_momentum, adjust_lr_fn="match_rms_adamw",
    )
    return CombinedOptimizer([muon, adamw])
