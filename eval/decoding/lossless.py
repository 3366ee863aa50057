"""Is a greedy speculative generation the target's own? Identical, a numerical tie, or a defect.

Verifying 1+k tokens in one forward and decoding one token at a time run different kernels (other
blockings, other reduction orders). In float32 they agree to ~1e-6 and greedy output is identical; in
bfloat16 or float16 every op rounds to 8 (11) significant bits, the logits of the two paths differ by a
few units in the last place (ulp) of their own scale, and where the target's top two tokens are that
close the argmax can flip. Such a flip is a property of the arithmetic, not of the decoder.

A divergence is classified at its *first* position ``i`` (the outputs agree before it, so both runs saw
the same context), using the plain run's logits there:
- *numerical tie*: the speculative token is among the plain run's top tokens and its logit is within
  ``tie_bound`` of the plain top-1 logit;
- *defect*: anything else (a wrong acceptance rule, a cache bug, a drafter leaking into the output).

``tie_bound = ulps · eps(dtype) · max(|top-1 logit|, 1)``: ``eps`` is the dtype's machine epsilon (bf16
2^-7, fp16 2^-10, fp32 2^-23), so the bound is ``ulps`` units in the last place of the logit's magnitude.
A flip needs the margin to be at most the two logits' combined error, ``|Δ top| + |Δ other| ≤ 2 · gap``, where
``gap`` is the largest block-vs-step logit difference. ``python -m eval.bench_ties`` measures it (SmolLM2-135M,
8-token blocks after MT-Bench prompts): max 3.7 ulps in bfloat16, 20.5 ulps in float32 with the target's
packed oneDNN linear layers (15.1 with MKL's; many more reduction steps reach fp32's last place). Hence the
defaults :data:`TIE_ULPS`: 8 for bf16/fp16, 48 for fp32 (about twice the measured gap, rounded up to a
multiple of 8); ``tie_ulps=`` overrides them for every dtype.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

TIE_ULPS = {torch.bfloat16: 8.0, torch.float16: 8.0, torch.float32: 48.0}


def tie_bound(dtype: torch.dtype, top_logit: float, ulps: float | None = None) -> float:
    """The largest top-1/other logit margin that the arithmetic of ``dtype`` can flip (``ulps``: None = the default)."""
    ulps = TIE_ULPS.get(dtype, 8.0) if ulps is None else ulps
    return ulps * torch.finfo(dtype).eps * max(abs(top_logit), 1.0)


@dataclass
class Verdict:
    kind: str                  # "identical" | "tie" | "defect"
    position: int | None = None  # first divergent new token
    margin: float | None = None  # plain top-1 logit minus the logit of the speculative token (None: not in the top)
    bound: float | None = None

    def as_dict(self) -> dict:
        return {"kind": self.kind, "position": self.position,
                "margin": None if self.margin is None else round(self.margin, 6),
                "bound": None if self.bound is None else round(self.bound, 6)}


def classify(plain: list[int], spec: list[int], plain_top: list[tuple[list[int], list[float]]], dtype: torch.dtype,
             ulps: float | None = None) -> Verdict:
    """Compare a speculative greedy output with plain decoding's; ``plain_top[i]``: the plain run's top
    (ids, logits) at new token i (``SpeculativeDecoder.generate(record_top=...)``)."""
    if spec == plain:
        return Verdict("identical")
    n = min(len(plain), len(spec))
    i = next((j for j in range(n) if plain[j] != spec[j]), n)
    if i >= n or i >= len(plain_top):  # one output is a strict prefix of the other: never a rounding effect
        return Verdict("defect", position=i)
    ids, logits = plain_top[i]
    bound = tie_bound(dtype, logits[0], ulps)
    if spec[i] not in ids:
        return Verdict("defect", position=i, bound=bound)
    margin = logits[0] - logits[ids.index(spec[i])]
    return Verdict("tie" if margin <= bound else "defect", position=i, margin=margin, bound=bound)
