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
    q = torch.softmax(draft_logits.float()[None] / torch.tensor(scales)[:, None], -1)  # [S, V]
    return torch.minimum(p[None], q).sum(-1)


@torch.no_grad()
def agreement(target, head, prompts: list[torch.Tensor], max_new_tokens: int, eos: list[int],
              scales: tuple[float, ...] = (0.8, 0.9, 1.0, 1.1, 1.25)) -> dict:
    from eval.decoder import NoDrafter, SpeculativeDecoder

    dec = SpeculativeDecoder(target, eos)
    hit = total = hit_in = total_in = acc = reached = 0
    sampled = torch.zeros(len(scales))
    for ids in prompts:
        out, _ = dec.generate(ids, NoDrafter(), k=0, max_new_tokens=max_new_tokens)
        _, st = dec.generate(ids, head, k=1, max_new_tokens=max_new_tokens)
        acc, reached = acc + st.accepted_at[0], reached + st.proposed_at[0]
        seq = torch.cat([ids.view(-1), torch.tensor(out)])[None]  # [1, T]
        feats = target(seq, return_logits=True)
        P = ids.numel()
        for at in range(P - 1, seq.shape[1] - 2):  # pending token at+1 is an answer token (or the last prompt token)
            logits = head.teacher_forced_logits(seq, feats, at, 1)[0]  # [V], −inf outside the draft vocabulary
            want = int(seq[0, at + 2])  # greedy: the target's own next token
            sampled += expected_acceptance(feats.logits[0, at + 1], logits, list(scales))
            ok = int(logits.argmax()) == want
            hit, total = hit + ok, total + 1
            if torch.isfinite(logits[want]):
                hit_in, total_in = hit_in + ok, total_in + 1
    return {"positions": total, "teacher_forced_top1": round(hit / max(total, 1), 4),
            "teacher_forced_top1_in_draft_vocab": round(hit_in / max(total_in, 1), 4),
            "in_draft_vocab_share": round(total_in / max(total, 1), 4),
            "decode_rounds": reached, "decode_acceptance_at_1": round(acc / max(reached, 1), 4),
            "sampled_acceptance_at_1_by_draft_scale": {str(s): round(float(v) / max(total, 1), 4) for s, v in zip(scales, sampled)}}


@hydra.main(config_path="../conf", config_name="agreement", version_base="1.3")
@cli
def main(cfg: DictConfig) -> None:
    from data.benchmarks import mt_bench
    from eval.run import _eos_ids, encode_prompt, load_head
    from models.target import load_tokenizer

    try:
        scales = tuple(float(x) for x in cfg.scales)
    except (TypeError, ValueError):
        scales = ()
    if not scales or min(scales) <= 0:
        raise UserError(f"scales={cfg.scales}: give a list of one or more numbers > 0 (the draft's logits are divided by each)")
    target = instantiate(cfg.target)
    tok = load_tokenizer(cfg.target.name_or_path)
    head = load_head(cfg.path, target)
    target.set_tap_layers(head.tap_layers)
    prompts = [encode_prompt(tok, q["messages"][:1]) for q in mt_bench(limit=cfg.prompts)]
    res = {"target": str(cfg.target.name_or_path), "head": str(cfg.path), "prompts": len(prompts),
           "max_new_tokens": cfg.max_new_tokens, **agreement(target, head, prompts, cfg.max_new_tokens, _eos_ids(target, tok), scales)}
    write_json(Path(cfg.out_dir) / "agreement.json", res, echo=True)


if __name__ == "__main__":
    run_main(main)
