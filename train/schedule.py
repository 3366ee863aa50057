"""Learning-rate schedules shared by every training recipe."""
from __future__ import annotations

import math
from typing import Callable

import torch


def cosine(t: float, min_ratio: float) -> float:
    """The decay part of both schedules: 1 at t=0 down to ``min_ratio`` at t=1."""
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * min(1.0, t)))


def warmup_cosine(opt: torch.optim.Optimizer, warmup_steps: int, total_steps: int, min_ratio: float = 0.1) -> torch.optim.lr_scheduler.LambdaLR:
    """Linear warm-up to the base lr, then cosine decay to ``min_ratio`` × base lr at ``total_steps``."""
    warmup_steps = max(0, int(warmup_steps))
    total_steps = max(warmup_steps + 1, int(total_steps))

    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        return cosine((step - warmup_steps) / (total_steps - warmup_steps), min_ratio)

    return torch.optim.lr_scheduler.LambdaLR(opt, factor)


def warmup_cosine_by(opt: torch.optim.Optimizer, progress: Callable[[], float], warmup: float,
                     min_ratio: float = 0.1) -> torch.optim.lr_scheduler.LambdaLR:
    """The same shape on a progress fraction instead of steps: ``progress()`` in [0, 1] (the share of a time
    budget spent, read when the scheduler steps); linear warm-up over the first ``warmup`` of it, then cosine."""
    def factor(_: int) -> float:
        p = min(1.0, max(0.0, float(progress())))
        if p < warmup:
            return max(p / warmup, 1e-3)
        return cosine((p - warmup) / max(1e-9, 1 - warmup), min_ratio)

    return torch.optim.lr_scheduler.LambdaLR(opt, factor)
