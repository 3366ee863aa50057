"""``k=auto``: the draft length that maximises expected tokens per second, chosen every round.

Expected tokens of a round with draft length k: ``τ(k) = 1 + Σ_{i<=k} Π_{j<=i} a_j`` (a_j: the drafter's
conditional acceptance at position j); its cost in units of one plain step: ``T(1+k)/T(1) + k·c`` (the target's
verify curve, measured once by :func:`eval.planner.verify_costs`, and c, the drafter's measured seconds per
drafted token over T(1)). Acceptance is learnt while decoding: a_j is the running ratio accepted/reached at
position j with a Beta(1, 1) prior, so positions not yet tried look promising until tried (exploration), and
positions that keep failing are dropped. k never goes below 1, so acceptance keeps being measured; choosing k
does not change the output (the decoder stays lossless for any k).
"""
from __future__ import annotations


class AutoK:
    """One per (drafter, temperature); pass it as ``k`` to :meth:`eval.decoder.SpeculativeDecoder.generate`."""

    def __init__(self, verify_ratio: list[float], t1: float, max_k: int | None = None):
        """``verify_ratio[d]`` = T(1+d)/T(1) for d = 0..; ``t1`` = T(1) in seconds; ``max_k`` caps k (default: the curve)."""
        if not verify_ratio or verify_ratio[0] <= 0:
            raise ValueError("verify_ratio must start with T(1)/T(1) = 1")
        self.ratio = list(verify_ratio)
        self.t1 = t1
        self.max_k = min(max_k or len(self.ratio) - 1, len(self.ratio) - 1)
        self.reached = [0] * self.max_k
        self.accepted = [0] * self.max_k
        self.draft_s = 0.0
        self.drafted = 0
        self.chosen: list[int] = []

    def acceptance(self) -> list[float]:
        return [(a + 1) / (r + 2) for a, r in zip(self.accepted, self.reached)]

    def draft_cost(self) -> float:
        """Seconds per drafted token over T(1) (0 until measured)."""
        return self.draft_s / self.drafted / self.t1 if self.drafted else 0.0

    def value(self, k: int) -> float:
        """Expected tokens per unit of plain-step time at draft length k."""
        tau, run = 1.0, 1.0
        for a in self.acceptance()[:k]:
            run *= a
            tau += run
        return tau / (self.ratio[k] + k * self.draft_cost())

    def choose(self, limit: int) -> int:
        """The best k in 1..min(max_k, limit) (0 when limit < 1)."""
        top = min(self.max_k, limit)
        if top < 1:
            return 0
        k = max(range(1, top + 1), key=lambda k: (self.value(k), -k))
        self.chosen.append(k)
        return k

    def update(self, reached: int, accepted: int, draft_s: float, drafted: int) -> None:
        """After a round: positions 1..``reached`` were proposed and reached, the first ``accepted`` accepted."""
        for i in range(min(reached, self.max_k)):
            if i > accepted:
                break
            self.reached[i] += 1
            self.accepted[i] += int(i < accepted)
        self.draft_s += draft_s
        self.drafted += drafted
