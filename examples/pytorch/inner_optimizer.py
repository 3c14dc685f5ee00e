"""The inner optimizer of diloco-learner in plain PyTorch: a port of core/train/inner_optimizer.{h,cc}.

AdamW (betas 0.9, 0.95, eps 1e-8) with decoupled weight decay on tensors of rank >= 2 only (not
on biases and layer-norm gains, whose scale is meaningful), a linear warmup then a cosine down to
10 % of the peak lr at train.total_steps, and clipping of the global gradient norm. Its moments
stay local to the learner and survive the adoption of new global parameters, as in DiLoCo.
"""
from __future__ import annotations

import math
from collections.abc import Iterable

import torch

FINAL_LR_RATIO = 0.1


def lr_at(train: dict, step: int) -> float:
    """Learning rate of inner step `step` (0 for the first step) under the [train] section:
    lr * (step + 1) / warmup during the warmup, then a cosine from lr down to lr * 0.1 at
    total_steps, and lr * 0.1 after (learners may train past the planned total)."""
    lr, warmup, total = train["lr"], train["warmup_steps"], train["total_steps"]
    if step < warmup:
        return lr * (step + 1) / warmup
    final_lr = lr * FINAL_LR_RATIO
    if step >= total:
        return final_lr
    progress = (step - warmup) / (total - warmup)
    return final_lr + 0.5 * (lr - final_lr) * (1.0 + math.cos(math.pi * progress))


class InnerOptimizer:
    """AdamW with the schedule of lr_at and gradient clipping, from a run config's [train] section."""

    def __init__(self, parameters: Iterable[torch.nn.Parameter], train: dict):
        self.train = train
        self.parameters = list(parameters)
        groups = [{"params": [p for p in self.parameters if p.dim() >= 2], "weight_decay": train["weight_decay"]},
                  {"params": [p for p in self.parameters if p.dim() < 2], "weight_decay": 0.0}]
        self.adamw = torch.optim.AdamW([g for g in groups if g["params"]], lr=train["lr"],
                                       betas=(0.9, 0.95), eps=1e-8)

    def step(self, step: int) -> float:
        """Sets the learning rate of inner step `step`, clips the gradients, updates the parameters;
        returns the global gradient norm before clipping."""
        for group in self.adamw.param_groups:
            group["lr"] = lr_at(self.train, step)
        # With max_norm = inf clip_grad_norm_ only measures (grad_clip = 0 disables clipping).
        max_norm = self.train["grad_clip"] or math.inf
        norm = torch.nn.utils.clip_grad_norm_(self.parameters, max_norm)
        self.adamw.step()
        return float(norm)

    def zero_grad(self) -> None:
        self.adamw.zero_grad(set_to_none=True)
