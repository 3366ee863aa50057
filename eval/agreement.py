"""``python -m eval.agreement``: does a head decode what its training forward predicts, on the target's own text?

    python -m eval.agreement target=smollm2 path=assets/smollm2-eagle3

For each MT-Bench first turn: the target answers greedily (plain decoding); on that text the head's
teacher-forced training forward (:meth:`DraftHead.teacher_forced_logits`, one step) is scored against the target's
own next token at every answer position: its top-1 agreement, split by whether the token is in the head's draft
vocabulary (validation's ``acc_0`` leaves the others out; decoding counts them as misses). Then the same prompt
is decoded speculatively with k=1, whose acceptance is the same event measured by the decoder. If the two agree,
decoding equals training and a gap to validation is the data's (domain, draft vocabulary), not the decoder's.
Writes ``agreement.json``.
"""
from __future__ import annotations

from pathlib import Path

import hydra
import torch
from omegaconf import DictConfig

from data.errors import cli, instantiate, run_main, write_json


@torch.no_grad()
def agreement(target, head, prompts: list[torch.Tensor], max_new_tokens: int, eos: list[int]) -> dict:
    from eval.decoder import NoDrafter, SpeculativeDecoder

    dec = SpeculativeDecoder(target, eos)
    hit = total = hit_in = total_in = acc = reached = 0
    for ids in prompts:
        out, _ = dec.generate(ids, NoDrafter(), k=0, max_new_tokens=max_new_tokens)
        _, st = dec.generate(ids, head, k=1, max_new_tokens=max_new_tokens)
        acc, reached = acc + st.accepted_at[0], reached + st.proposed_at[0]
        seq = torch.cat([ids.view(-1), torch.tensor(out)])[None]  # [1, T]
        feats = target(seq)
        P = ids.numel()
        for at in range(P - 1, seq.shape[1] - 2):  # pending token at+1 is an answer token (or the last prompt token)
            logits = head.teacher_forced_logits(seq, feats, at, 1)[0]  # [V], −inf outside the draft vocabulary
            want = int(seq[0, at + 2])  # greedy: the target's own next token
            ok = int(logits.argmax()) == want
            hit, total = hit + ok, total + 1
            if torch.isfinite(logits[want]):
                hit_in, total_in = hit_in + ok, total_in + 1
    return {"positions": total, "teacher_forced_top1": round(hit / max(total, 1), 4),
            "teacher_forced_top1_in_draft_vocab": round(hit_in / max(total_in, 1), 4),
            "in_draft_vocab_share": round(total_in / max(total, 1), 4),
            "decode_rounds": reached, "decode_acceptance_at_1": round(acc / max(reached, 1), 4)}


@hydra.main(config_path="../conf", config_name="agreement", version_base="1.3")
@cli
def main(cfg: DictConfig) -> None:
    from data.benchmarks import mt_bench
    from eval.run import _eos_ids, encode_prompt, load_head
    from models.target import load_tokenizer

    target = instantiate(cfg.target)
    tok = load_tokenizer(cfg.target.name_or_path)
    head = load_head(cfg.path, target)
    target.set_tap_layers(head.tap_layers)
    prompts = [encode_prompt(tok, q["messages"][:1]) for q in mt_bench(limit=cfg.prompts)]
    res = {"target": str(cfg.target.name_or_path), "head": str(cfg.path), "prompts": len(prompts),
           "max_new_tokens": cfg.max_new_tokens, **agreement(target, head, prompts, cfg.max_new_tokens, _eos_ids(target, tok))}
    write_json(Path(cfg.out_dir) / "agreement.json", res, echo=True)


if __name__ == "__main__":
    run_main(main)
