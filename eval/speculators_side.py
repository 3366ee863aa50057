"""Side script of ``python -m eval.check_export``, run by ``.venv-speculators/bin/python`` (torch + speculators 0.9.0,
none of our code: it imports nothing of this project).

    .venv-speculators/bin/python eval/speculators_side.py job.json

For every case of the job: load the export with speculators' own ``from_pretrained`` (external layouts
first through speculators' converters: ``Eagle3Converter`` for SGLang EAGLE-3, the DFlash auto-conversion
for z-lab DFlash), run the model's forward on the inputs given in a safetensors file (input ids, target
features, anchors) and write its logits to another safetensors file, plus what it read from the config
(layer ids, block size, ...) to ``<out>.json``. Attention runs in speculators' "eager" mode (dense masks;
flex attention needs a compiler on CPU).

Logits come from forward hooks and patched loss functions, so speculators' own forward code computes them:
EAGLE-3 — every training-time-test step's ``lm_head`` output (``ttt_steps`` from the inputs, teacher-forced
tokens, positions as given); DFlash/DSpark — the block logits at the given anchors (``select_anchors`` is
patched to return them), DSpark with the Markov bias and the confidence logits; MTP — the logits of every depth
that ``MTPDraftModel.forward`` returns (teacher-forced, over its valid positions 0..T-K-2), from the verifier's
last hidden state.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file


def load(case: dict):
    from speculators import SpeculatorModel, SpeculatorModelConfig

    path = case["dir"]
    if case.get("convert") == "eagle3":  # SGLang EAGLE-3 layout → speculators, by speculators' converter
        from speculators.convert.entrypoints import convert_model

        converted = case["out"] + ".converted"
        convert_model(model=path, verifier=case["verifier"], algorithm="eagle3", output_path=converted,
                      eagle_aux_hidden_state_layer_ids=case["layer_ids"])
        path = converted
    elif case.get("convert") == "dflash":  # z-lab DFlash → speculators, the auto-conversion of from_pretrained
        from speculators.convert.entrypoints import maybe_convert_external_checkpoint

        path = maybe_convert_external_checkpoint(path, verifier=case["verifier"], output_path=case["out"] + ".converted")
    config = SpeculatorModelConfig.from_pretrained(path)
    config.transformer_layer_config._attn_implementation = "eager"
    model = SpeculatorModel.from_pretrained(path, config=config).eval()
    if case["kind"] == "eagle3" and "embed_tokens.weight" not in load_file(str(Path(path) / "model.safetensors")):
        # a checkpoint without the embedding (SGLang's layout) is served with the target's; speculators 0.9.0 would
        # keep a freshly initialised table here (it only refills NaN), so load the verifier's as the engines do
        model._load_verifier_weights(overwrite_embed_tokens=True)
    nan = [n for n, p in model.named_parameters() if torch.isnan(p).any() and not n.startswith("verifier_")]
    if nan:
        raise SystemExit(f"{case['name']}: parameters left unloaded (NaN): {nan[:5]}")
    return model


@torch.no_grad()
def run_eagle3(model, x: dict) -> dict:
    steps = []
    hook = model.lm_head.register_forward_hook(lambda m, i, o: steps.append(o.detach().float()))
    ids = x["input_ids"]
    model(hidden_states=x["hidden_states"], input_ids=ids, document_ids=torch.zeros_like(ids),
          position_ids=x["position_ids"], ttt_steps=int(x["ttt_steps"]))
    hook.remove()
    return {"logits": torch.stack(steps)}  # [K, 1, T, Vd]


@torch.no_grad()
def run_block(model, x: dict, kind: str) -> dict:
    import speculators.models.dflash.core as dflash_core

    anchors = x["anchors"].long()
    n = anchors.numel()
    dflash_core.select_anchors = lambda loss_mask, num, block: (anchors, torch.ones(n, dtype=torch.bool))
    got = {}

    def capture(logits, targets, *rest, **kw):
        got["logits"] = logits.detach().float()
        if kind == "dspark":
            got["confidence"] = rest[0].detach().float()
        return torch.zeros(()), {}

    if kind == "dspark":
        import speculators.models.dspark.core as dspark_core

        dspark_core.compute_metrics = capture
    else:
        dflash_core.compute_metrics = capture
    ids = x["input_ids"]
    model(hidden_states=x["hidden_states"], input_ids=ids, loss_mask=torch.ones_like(ids),
          verifier_last_hidden_states=x["last_hidden_states"], document_ids=torch.zeros_like(ids), max_anchors=n)
    return got


@torch.no_grad()
def run_mtp(model, x: dict) -> dict:
    ids = x["input_ids"]
    logits, _, _ = model(input_ids=ids, hidden_states=x["last_hidden_states"], position_ids=torch.arange(ids.shape[1])[None])
    return {"logits": torch.stack([t.detach().float() for t in logits])}  # [K, 1, T-K-1, V]


def main(job_path: str) -> None:
    job = json.loads(Path(job_path).read_text())
    for case in job["cases"]:
        model = load(case)
        x = load_file(case["inputs"])
        kind = case["kind"]
        out = run_eagle3(model, x) if kind == "eagle3" else run_mtp(model, x) if kind == "mtp" else run_block(model, x, kind)
        save_file({k: v.contiguous() for k, v in out.items()}, case["out"])
        c = model.config
        meta = {"class": type(model).__name__, "speculators_model_type": c.speculators_model_type,
                "layer_ids": getattr(c, "eagle_aux_hidden_state_layer_ids", None) or getattr(c, "aux_hidden_state_layer_ids", None)
                or list(model.target_layer_ids),  # MTP: the hidden_states index it reads
                "speculative_tokens": c.speculators_config.proposal_methods[0].speculative_tokens,
                "verifier": c.speculators_config.verifier.name_or_path}
        for k in ("draft_vocab_size", "block_size", "mask_token_id", "markov_rank", "sample_from_anchor", "num_nextn_predict_layers"):
            if hasattr(c, k):
                meta[k] = getattr(c, k)
        Path(case["out"] + ".json").write_text(json.dumps(meta))
        print(f"{case['name']}: {meta['class']} ok", flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
