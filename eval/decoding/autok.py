"""``k=auto``: the draft length that maximises expected tokens per second, chosen every round.

Expected tokens of a round with draft length k: ``τ(k) = 1 + Σ_{i<=k} Π_{j<=i} a_j`` (a_j: the drafter's
conditional acceptance at position j); its cost in units of one plain step: ``T(1+k)/T(1) + (c0 + k·c)`` (the
target's verify curve, measured once by :func:`eval.decoding.autok.verify_costs`, and the drafter's measured seconds
per round over T(1), fitted as c0 + k·c by least squares: a fixed part, such as the ``commit`` forward after each
verify or a block drafter's one forward for the whole block, and a part per drafted token; until two lengths were
tried, all of it per token). The fit runs through each length's *median* over its last ``WINDOW`` rounds, weighted
by their count, and a prompt's first round is left out: that round also catches the drafter up on the whole
prompt (MTP runs every depth over it), and the rounds after a long stretch at a shorter length catch deeper MTP
depths up on the positions they missed. Such rounds cost several ordinary ones (MTP's first rounds: 1.8–3.3 T(1)
against 0.65–0.94 for a usual 3-token round), so in a plain least-squares sum a few of them at the longer lengths
tilt the slope until the longer drafts look dear and k stays at 1 although later positions accept well; medians
are robust to them. Acceptance is learnt while decoding:
position j's accepted/reached counts give a Beta(1 + accepted, 1 + rejected) posterior, and each round k is chosen for a_j *drawn* from those posteriors
(Thompson sampling), not for their means. With the means alone, a position that failed a few early tries looks
bad, k stops reaching it, and its estimate is never corrected; drawing keeps trying a position in proportion to
the chance that it pays, and
settles on the best k as the counts grow. k never goes below 1, so acceptance keeps being measured; choosing k
does not change the output (the decoder stays lossless for any k). Draws come from a seeded generator.

The verify curve is learnt while decoding too. The curve measured at the start is one short benchmark, and one
disturbance during it (another process on a shared core) is enough to make one length look dear to every round
after; single rounds' verify times are too noisy to replace it (on a 2-core CPU the verify passes of 3 drafted
tokens spread by a factor of 1.7 between the 10th and 90th percentiles). So the cost of verifying d drafted tokens is taken as a line, α + β·d for
d >= 1 (β >= 0), fitted by weighted least squares through the start curve's points (``PRIOR_WEIGHT`` rounds each)
and, per size verified while decoding (``MIN_VERIFY`` rounds or more), the median of its last ``VERIFY_WINDOW``
verify times (as many rounds each). One bad point of the start curve then moves the line a little instead of
making one length look dear, the line soon follows the sizes decoding actually verifies (at the context decoding
runs at), and sizes not tried take what the line says (see :attr:`AutoK.curve`).

With a tree (a drafter entry with both ``tree:`` and ``k: auto``) k is the tree's depth: the budget, top-k and
min_prob stay as configured and each round grows a tree at most k levels deep. a_j is then the chance that the
accepted path, having reached depth j−1, reaches depth j; the verify cost is the curve at the round's node count
(the mean over the rounds that chose k; before any, the most the budget and top-k allow at depth k), and c is the
draft's seconds per level (one draft forward of the level's nodes) over T(1).
"""
from __future__ import annotations

import random
import statistics
import time
from collections import deque
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from models.heads.drafting import TreeSpec


class AutoK:
    """One per (drafter, temperature); pass it as ``k`` to :meth:`eval.decoding.decoder.SpeculativeDecoder.generate`."""

    WINDOW = 32  # rounds per length whose median draft time enters the cost fit
    VERIFY_WINDOW = 128  # rounds per verified size whose median verify time enters the verify line
    PRIOR_WEIGHT = 2  # rounds each point of the start curve counts as in the verify line
    MIN_VERIFY = 5  # rounds a verified size needs before its median enters the line (a median of 2 is their mean)

    def __init__(self, verify_ratio: list[float], t1: float, max_k: int | None = None, tree: "TreeSpec | None" = None,
                 explore: bool = True, seed: int = 0, learn_verify: bool = True):
        """``verify_ratio[d]`` = T(1+d)/T(1) for d = 0..; ``t1`` = T(1) in seconds; ``max_k`` caps k (default: the
        curve; with ``tree`` its depth); ``explore=False`` chooses for the posterior means (no exploration);
        ``learn_verify=False`` keeps the start curve point by point (no line; verify seconds given to :meth:`update`
        are ignored)."""
        if not verify_ratio or verify_ratio[0] <= 0:
            raise ValueError("verify_ratio must start with T(1)/T(1) = 1")
        self.ratio = list(verify_ratio)
        self.t1 = t1
        self.tree = tree
        cap = len(self.ratio) - 1 if tree is None else tree.depth
        self.max_k = min(max_k or cap, cap)
        self.nodes_seen: dict[int, list[float]] = {}  # k -> [sum of verified nodes, rounds]
        self.reached = [0] * self.max_k
        self.accepted = [0] * self.max_k
        self.times: dict[int, deque] = {}  # drafted tokens (tree: levels) → draft seconds of its last WINDOW rounds
        self._fit: list[float] | None = None  # the sums of ``fit``, until the next timed update
        self.learn_verify = learn_verify
        self.verify_times: dict[int, deque] = {}  # drafted tokens verified → verify seconds of its last rounds
        self._curve: list[float] | None = None  # ``curve``, until the next verify time
        self._medians: dict[int, float] = {}  # verified size → median of its window, until its next verify time
        self.chosen: list[int] = []
        self.rng = random.Random(seed) if explore else None

    def acceptance(self) -> list[float]:
        """Posterior mean acceptance per position."""
        return [(a + 1) / (r + 2) for a, r in zip(self.accepted, self.reached)]

    def drawn_acceptance(self) -> list[float]:
        """One draw per position from its Beta posterior (the means when not exploring)."""
        if self.rng is None:
            return self.acceptance()
        return [self.rng.betavariate(a + 1, r - a + 1) for a, r in zip(self.accepted, self.reached)]

    @property
    def fit(self) -> list[float]:
        """Sums for the cost fit, over the lengths seen, each length's median draft seconds m_k weighted by its
        round count w_k: [Σw, Σw·k, Σw·k², Σw·m_k, Σw·k·m_k]."""
        if self._fit is None:
            self._fit = [0.0] * 5
            for k, ts in self.times.items():
                w, m = len(ts), statistics.median(ts)
                for i, v in enumerate((w, w * k, w * k * k, w * m, w * k * m)):
                    self._fit[i] += v
        return self._fit

    def draft_cost(self) -> float:
        """Seconds per drafted token over T(1) (0 until measured)."""
        drafted, draft_s = self.fit[1], self.fit[3]
        return draft_s / drafted / self.t1 if drafted else 0.0

    def round_cost(self, k: int) -> float:
        """Draft seconds of a round that drafts k tokens (tree: levels) over T(1): c0 + k·c fitted by least
        squares, both parts kept >= 0; before two lengths were tried, k·(seconds per drafted token)."""
        n, sx, sxx, sy, sxy = self.fit
        var = n * sxx - sx * sx
        if n < 2 or var <= 1e-9 * max(n * sxx, 1.0):
            return k * self.draft_cost()
        c = (n * sxy - sx * sy) / var
        c0 = (sy - c * sx) / n
        if c0 < 0:  # through the origin
            c0, c = 0.0, sxy / sxx
        elif c < 0:  # no part per token
            c0, c = sy / n, 0.0
        return (c0 + k * c) / self.t1

    def nodes(self, k: int) -> float:
        """Drafted tokens verified in a round of length (tree: depth) k: measured, or before that k for a chain and
        for a tree the most its budget and top-k allow."""
        total, rounds = self.nodes_seen.get(k, (0.0, 0))
        if rounds:
            return total / rounds
        t = self.tree
        return k if t is None else min(t.budget, t.topk + (k - 1) * t.topk ** 2)

    @property
    def curve(self) -> list[float]:
        """T(1+d)/T(1) for d = 0.. (in units of the start's T(1)): d = 0 as measured at the start, d >= 1 on the line
        α + β·d fitted by weighted least squares through the start curve (``PRIOR_WEIGHT`` each) and the median
        verify time over ``t1`` of each size verified in ``MIN_VERIFY`` rounds or more (weighted by its rounds);
        β >= 0 (a verify pass does not get cheaper with more tokens)."""
        if not self.learn_verify:
            return self.ratio
        if self._curve is None:
            pts = [(d, r, float(self.PRIOR_WEIGHT)) for d, r in enumerate(self.ratio) if d >= 1]
            for d, ts in self.verify_times.items():  # one round changes one size: only its median is recomputed
                if d >= 1 and len(ts) >= self.MIN_VERIFY:
                    if d not in self._medians:
                        self._medians[d] = statistics.median(ts)
                    pts.append((d, self._medians[d] / self.t1, float(len(ts))))
            if not pts:  # a curve of T(1) alone
                self._curve = list(self.ratio)
                return self._curve
            n = sum(w for _, _, w in pts)
            mx, my = sum(w * d for d, _, w in pts) / n, sum(w * r for _, r, w in pts) / n
            var = sum(w * (d - mx) ** 2 for d, _, w in pts)
            beta = max(sum(w * (d - mx) * (r - my) for d, r, w in pts) / var, 0.0) if var > 0 else 0.0
            alpha = my - beta * mx
            self._curve = [self.ratio[0]] + [alpha + beta * d for d in range(1, len(self.ratio))]
        return self._curve

    def verify_ratio(self, n: float) -> float:
        """T(1+n)/T(1), interpolated between sizes (the last one beyond the curve)."""
        curve = self.curve
        n = min(max(n, 0.0), len(curve) - 1)
        lo = int(n)
        hi = min(lo + 1, len(curve) - 1)
        return curve[lo] + (n - lo) * (curve[hi] - curve[lo])

    def value(self, k: int, acceptance: list[float] | None = None) -> float:
        """Expected tokens per unit of plain-step time at draft length (tree: depth) k, for ``acceptance`` per
        position (default: the posterior means)."""
        tau, run = 1.0, 1.0
        for a in (self.acceptance() if acceptance is None else acceptance)[:k]:
            run *= a
            tau += run
        return tau / (self.verify_ratio(self.nodes(k)) + self.round_cost(k))

    def choose(self, limit: int) -> int:
        """The best k in 1..min(max_k, limit) for one posterior draw of the acceptance (0 when limit < 1)."""
        top = min(self.max_k, limit)
        if top < 1:
            return 0
        acc = self.drawn_acceptance()
        k = max(range(1, top + 1), key=lambda k: (self.value(k, acc), -k))
        self.chosen.append(k)
        return k

    def update(self, reached: int, accepted: int, draft_s: float, drafted: int, nodes: int | None = None,
               timed: bool = True, verify_s: float | None = None) -> None:
        """After a round: positions 1..``reached`` were proposed and reached, the first ``accepted`` accepted;
        ``drafted`` tokens (tree: levels) cost ``draft_s``; ``nodes`` tokens were verified (default ``drafted``) in
        ``verify_s`` seconds (None: not measured). ``timed=False``: the round's times are not a usual round's (a
        prompt's first) and stay out of both cost estimates."""
        if self.chosen:
            seen = self.nodes_seen.setdefault(self.chosen[-1], [0.0, 0])
            seen[0] += drafted if nodes is None else nodes
            seen[1] += 1
        for i in range(min(reached, self.max_k)):
            if i > accepted:
                break
            self.reached[i] += 1
            self.accepted[i] += int(i < accepted)
        if timed:
            self.times.setdefault(drafted, deque(maxlen=self.WINDOW)).append(draft_s)
            self._fit = None
            if verify_s is not None and self.learn_verify:
                size = drafted if nodes is None else nodes
                self.verify_times.setdefault(size, deque(maxlen=self.VERIFY_WINDOW)).append(verify_s)
                self._medians.pop(size, None)
                self._curve = None


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


@torch.no_grad()
def verify_costs(model, max_d: int, context: int, reps: int, device: str) -> list[float]:
    """Median seconds of a forward of 1+D tokens over a cache of ``context`` tokens, for D = 0..max_d. The sizes take
    turns within each repetition, so a drift of the machine's speed (clock, other load) spreads over all of them
    instead of tilting the curve."""
    from eval.decoding.decoder import crop

    V = model.config.vocab_size
    g = torch.Generator().manual_seed(0)
    from eval.decoding.kvcache import new_cache

    cache = new_cache()
    model(input_ids=torch.randint(0, V, (1, context), generator=g).to(device), cache=cache, use_cache=True)
    blocks = [torch.randint(0, V, (1, 1 + d), generator=g).to(device) for d in range(max_d + 1)]
    samples: list[list[float]] = [[] for _ in blocks]
    for r in range(reps + 2):
        for d, block in enumerate(blocks):
            sync(device)
            t = time.perf_counter()
            model(input_ids=block, cache=cache, use_cache=True)
            sync(device)
            if r >= 2:  # two warm-up rounds
                samples[d].append(time.perf_counter() - t)
            crop(cache, context)
    return [statistics.median(x) for x in samples]
