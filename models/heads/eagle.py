"""EAGLE-1 draft head (Li et al., "EAGLE: Speculative Sampling Requires Rethinking Feature Uncertainty",
arXiv 2401.15077): the simple floor every family here must clear.

It drafts in the target's own feature space: step 0 reads the target's top-layer feature ``f_t`` (the final-norm
output that feeds the target's ``lm_head``) and the next token, and its output ``h`` is trained to *be* the next
feature ``f_{t+1}`` (smooth-L1, weight ``feature_weight``) as well as to give the target's distribution through the
target's own frozen ``lm_head`` (soft cross-entropy, no norm in between: ``f`` is already normed). Drafting feeds
``h`` back as the next step's feature. One decoder layer, the full target vocabulary, one training step
(``ttt_steps: 1``; EAGLE-1 has no training-time test, more steps give HASS-style unrolling).

A thin subclass of :class:`models.heads.eagle3.Eagle3Head`: the same decoder layer (token embedding and feature
enter attention side by side), the same chain and tree drafting; what differs is ``fuse`` (no ``fc`` over
taps: the feature itself), ``feature_of`` (no norm: the output is the feature) and the defaults (the feature
regression on, the target's frozen head over the full vocabulary, one step).
"""
from __future__ import annotations

from typing import Any

import torch

from models.heads.eagle3 import Eagle3Head


class EagleHead(Eagle3Head):
    family = "eagle"
    tap_method = "last"  # recorded only
    reads_taps = False  # the head reads the final-norm feature (TargetOutput.last_state)

    def __init__(self, target: Any, feature_weight: float = 0.1, ttt_steps: int = 1, draft_vocab_size: int | None = None,
                 step_decay: float = 0.8, num_heads: int | None = None, num_kv_heads: int | None = None,
                 intermediate_size: int | None = None, rope_theta: float | None = None, rms_eps: float = 1e-6,
                 freeze_lm_head: bool = True):
        super().__init__(target, ttt_steps=ttt_steps, draft_vocab_size=draft_vocab_size, step_decay=step_decay,
                         num_heads=num_heads, num_kv_heads=num_kv_heads, intermediate_size=intermediate_size,
                         rope_theta=rope_theta, rms_eps=rms_eps, freeze_lm_head=freeze_lm_head,
                         feature_weight=feature_weight)
        del self.fc, self.norm  # the feature enters as it is and leaves straight into lm_head

    def fuse(self, feats: Any) -> torch.Tensor:
        """Step 0's hidden input: the target's final-norm feature itself, [B, T, d]."""
        return feats.last_state.to(self.lm_head.weight.dtype)

    def feature_of(self, h: torch.Tensor) -> torch.Tensor:
        """h is a predicted feature: the head applies to it directly, as the target's head to its own feature."""
        return h

    def serving_dims(self) -> dict:
        return {"hidden_size": self.lm_head.in_features, "vocab_size": self.t2d.numel(),
                "draft_vocab_size": self.draft_vocab_size, "num_hidden_layers": 1}
