"""``python -m eval.agreement``: does a head decode what its training forward predicts, on the target's own text?

    python -m eval.agreement target=smollm2 path=assets/smollm2-eagle3

For each MT-Bench first turn: the target answers greedily (plain decoding); on that text the head's
teacher-forced training forward (:meth:`DraftHead.teacher_forced_logits`, one step) is scored against the target's
own next token at every answer position: its top-1 agreement, split by whether the token is in the head's draft
vocabulary (validation's ``acc_0`` leaves the others out; decoding counts them as misses). Then the same prompt
is decoded speculatively with k=1, whose acceptance is the same event measured by the decoder. If the two agree,
decoding equals training and a gap to validation is the data's (domain, draft vocabulary), not the decoder's.

At the same positions it also gives the acceptance a first drafted token would have at T=1 (the expectation
Σ min(p, q) of rejection sampling, p the target's distribution, q the draft's) with the draft's logits divided by
each of ``scales``: where a scale other than 1 scores higher, the draft is over- or under-confident and sampling it
at another temperature would be accepted more often (any q is lossless; acceptance is what changes).
With ``temperature`` > 0 (``python -m eval.agreement path=... temperature=1``) the question is asked of sampling
instead (:func:`sampled_agreement`): the head decodes by exact rejection sampling, and on that text (a sample of the
target) the teacher-forced acceptance of a first drafted token, Σ min(p, q), is split by how each position's pending
token was chosen (after the prompt, a bonus token, a residual draw after a rejection, a kept draft), beside decoding's
realised acceptance at position 1 and the target's mass on the draft vocabulary (the most that position can accept).
Writes ``agreement.json``.
"""
from __future__ import annotations

from pathlib import Path

import hydra
import torch
from omegaconf import DictConfig

from data.errors import UserError, cli, instantiate, run_main, write_json


def expected_acceptance(target_logits: torch.Tensor, draft_logits: torch.Tensor, scales: list[float]) -> torch.Tensor:
    """Σ_v min(p, q_s) [len(scales)]: a sampled draft's acceptance probability at T=1 (p = softmax(target_logits) [V],
    q_s = softmax(draft_logits / s) [V], −inf where the draft cannot propose)."""
    p = torch.softmax(target_logits.float(), -1)  # [V]
    q = torch.softmax(draft_logits.float()[None] / draft_logits.new_tensor(scales, dtype=torch.float32)[:, None], -1)  # [S, V]
    return torch.minimum(p[None], q).sum(-1)


@torch.no_grad()
def agreement(target, head, prompts: list[torch.Tensor], max_new_tokens: int, eos: list[int],
              scales: tuple[float, ...] = (0.8, 0.9, 1.0, 1.1, 1.25)) -> dict:
    from eval.decoding.decoder import NoDrafter, SpeculativeDecoder

    dec = SpeculativeDecoder(target, eos)
    hit = total = hit_in = total_in = acc = reached = 0
    sampled = torch.zeros(len(scales))
    for ids in prompts:
        out, _ = dec.generate(ids, NoDrafter(), k=0, max_new_tokens=max_new_tokens)
        _, st = dec.generate(ids, head, k=1, max_new_tokens=max_new_tokens)
        acc, reached = acc + st.accepted_at[0], reached + st.proposed_at[0]
        seq = torch.cat([ids.view(-1).cpu(), torch.tensor(out)])[None].to(target.device)  # [1, T]
        feats = target(seq, return_logits=True)
        P = ids.numel()
        for at in range(P - 1, seq.shape[1] - 2):  # pending token at+1 is an answer token (or the last prompt token)
            logits = head.teacher_forced_logits(seq, feats, at, 1)[0]  # [V], −inf outside the draft vocabulary
            want = int(seq[0, at + 2])  # greedy: the target's own next token
            sampled += expected_acceptance(feats.logits[0, at + 1], logits, list(scales)).cpu()
            ok = int(logits.argmax()) == want
            hit, total = hit + ok, total + 1
            if torch.isfinite(logits[want]):
                hit_in, total_in = hit_in + ok, total_in + 1
    return {"positions": total, "teacher_forced_top1": round(hit / max(total, 1), 4),
            "teacher_forced_top1_in_draft_vocab": round(hit_in / max(total_in, 1), 4),
            "in_draft_vocab_share": round(total_in / max(total, 1), 4),
            "decode_rounds": reached, "decode_acceptance_at_1": round(acc / max(reached, 1), 4),
            "sampled_acceptance_at_1_by_draft_scale": {str(s): round(float(v) / max(total, 1), 4) for s, v in zip(scales, sampled)}}


class _Rounds:
    """A drafter passed through, recording each round: the index in the sequence of its pending token, how many
    tokens it drafted and how many of them the target kept (None until the round is committed)."""

    def __init__(self, head):
        self.head, self.rounds, self.n = head, [], 0
        self.max_draft = getattr(head, "max_draft", None)

    def start(self, prompt_ids, feats) -> None:
        self.n, self.rounds = prompt_ids.numel(), []
        self.head.start(prompt_ids, feats)

    def propose(self, pending, k, sampler):
        prop = self.head.propose(pending, k, sampler)
        self.rounds.append([self.n, prop.tokens.numel(), None])
        return prop

    def commit(self, tokens, feats) -> None:
        if self.rounds and self.rounds[-1][2] is None:
            self.rounds[-1][2] = tokens.numel() - 1
        self.n += tokens.numel()
        self.head.commit(tokens, feats)

    def roles(self) -> dict[int, str]:
        """Pending-token index → how that token was chosen: ``first`` (after the prompt), ``bonus`` (sampled from p
        after every draft of the round before was kept) or ``residual`` (drawn from norm(max(0, p − q)) after a
        rejection). The tokens the target kept from a draft are never pending: they are ``accepted draft``."""
        out = {}
        for i, (at, _, _) in enumerate(self.rounds):
            if i == 0:
                out[at] = "first"
            else:
                _, drafted, kept = self.rounds[i - 1]
                out[at] = "bonus" if kept == drafted else "residual"
        return out


ROLES = ("first", "bonus", "residual", "accepted draft")


@torch.no_grad()
def sampled_agreement(target, head, prompts: list[torch.Tensor], max_new_tokens: int, eos: list[int],
                      temperature: float = 1.0, k: int = 1, seed: int = 0) -> dict:
    """At temperature > 0: each prompt is decoded speculatively (``k`` drafted tokens a round, exact rejection
    sampling), which makes a sample of the target's own distribution; on that text the head's teacher-forced training
    forward gives, at every answer position, the acceptance Σ min(p, q) a first drafted token would have there (what
    validation's ``accept_t1_0`` averages over the target's sampled answers). Those positions are split by how their
    pending token was chosen (:meth:`_Rounds.roles`): decoding drafts its first token only after a ``first``, ``bonus``
    or ``residual`` one, so its acceptance at position 1 is the mean over those, and the gap to the mean over every
    position is the share of the draft's rounds that start from a token it predicted poorly. The decoder's realised
    acceptance at position 1 beside the teacher-forced expectation at the same positions checks decode = train."""
    from eval.decoding.decoder import Sampler, SpeculativeDecoder

    if temperature <= 0 or k < 1:
        raise UserError(f"sampled agreement: temperature={temperature} must be > 0 and k={k} >= 1")
    dec = SpeculativeDecoder(target, eos)
    rec = _Rounds(head)
    sums = {r: [0.0, 0] for r in ROLES}
    acc = reached = 0
    mass = 0.0  # Σ over positions of p's mass on the draft vocabulary: the most the first position can accept
    for i, ids in enumerate(prompts):
        sampler = Sampler(temperature, generator=torch.Generator().manual_seed(seed + i))
        out, st = dec.generate(ids, rec, k=k, max_new_tokens=max_new_tokens, sampler=sampler)
        acc, reached = acc + (st.accepted_at[:1] or [0])[0], reached + (st.proposed_at[:1] or [0])[0]
        roles = rec.roles()
        seq = torch.cat([ids.view(-1).cpu(), torch.tensor(out)])[None].to(target.device)  # [1, T]
        feats = target(seq, return_logits=True)
        for at in range(ids.numel() - 1, seq.shape[1] - 2):  # the pending token at+1 is an answer token
            draft = head.teacher_forced_logits(seq, feats, at, 1)[0].float() / temperature  # [V], −inf outside the draft vocabulary
            t = feats.logits[0, at + 1].float() / temperature  # [V]
            s = sums[roles.get(at + 1, "accepted draft")]
            s[0], s[1] = s[0] + float(expected_acceptance(t, draft, [1.0])[0]), s[1] + 1
            mass += float((t[torch.isfinite(draft)].logsumexp(-1) - t.logsumexp(-1)).exp())
    starts = [sums[r] for r in ROLES[:3]]
    n_all, n_starts = sum(v[1] for v in sums.values()), sum(v[1] for v in starts)
    return {"temperature": temperature, "k": k, "positions": n_all,
            "teacher_forced_acceptance_at_1": round(sum(v[0] for v in sums.values()) / max(n_all, 1), 4),
            "by_pending_token": {r: {"positions": n, "acceptance_at_1": round(e / n, 4) if n else None}
                                 for r, (e, n) in sums.items()},
            "teacher_forced_acceptance_at_round_starts": round(sum(v[0] for v in starts) / max(n_starts, 1), 4),
            "target_mass_in_draft_vocab": round(mass / max(n_all, 1), 4),
            "decode_rounds": reached, "decode_acceptance_at_1": round(acc / max(reached, 1), 4)}


@hydra.main(config_path="../conf", config_name="agreement", version_base="1.3")
@cli
def main(cfg: DictConfig) -> None:
    from data.benchmarks import mt_bench
    from eval.decoding.drafters import load_head
    from eval.run import _eos_ids, encode_prompt
    from models.target import load_tokenizer

    try:
        scales = tuple(float(x) for x in cfg.scales)
    except (TypeError, ValueError):
        scales = ()
    if not scales or min(scales) <= 0:
        raise UserError(f"scales={cfg.scales}: give a list of one or more numbers > 0 (the draft's logits are divided by each)")
    try:
        temperature = float(cfg.temperature)
    except (TypeError, ValueError):
        temperature = -1.0
    if temperature < 0 or not isinstance(cfg.k, int) or cfg.k < 1:
        raise UserError(f"temperature={cfg.temperature}, k={cfg.k}: give a temperature >= 0 (0: the greedy comparison) and an integer k >= 1")
    target = instantiate(cfg.target, device=cfg.get("device", "auto"))  # auto: a GPU when one is visible
    tok = load_tokenizer(cfg.target.name_or_path)
    head = load_head(cfg.path, target)
    target.set_tap_layers(head.tap_layers)
    prompts = [encode_prompt(tok, q["messages"][:1]) for q in mt_bench(limit=cfg.prompts)]
    eos = _eos_ids(target, tok)
    res = {"target": str(cfg.target.name_or_path), "head": str(cfg.path), "prompts": len(prompts),
           "max_new_tokens": cfg.max_new_tokens,
           **(sampled_agreement(target, head, prompts, cfg.max_new_tokens, eos, temperature, int(cfg.k), int(cfg.seed))
              if temperature > 0 else agreement(target, head, prompts, cfg.max_new_tokens, eos, scales))}
    write_json(Path(cfg.out_dir) / "agreement.json", res, echo=True)


if __name__ == "__main__":
    run_main(main)
