"""MTP specifics: label alignment, frozen shared parts, the per-module inference caches, reuse_last_module; both
layouts (DeepSeek-V3: conf/draft/mtp.yaml; speculators/vLLM: conf/draft/mtp_speculators.yaml)."""
from __future__ import annotations

import copy
import json

import pytest
import torch

from conftest import ROOT
from data.errors import UserError
from eval.decoding.decoder import Sampler, SpeculativeDecoder
from models.heads.mtp import MTPHead
from models.layers import shift_left
from models.target import TargetOutput
from test_decoder import plain_greedy
from test_heads import batch, make_head

CFG = ROOT / "conf" / "draft" / "mtp.yaml"
SPEC = ROOT / "conf" / "draft" / "mtp_speculators.yaml"
LAYOUTS = pytest.mark.parametrize("cfg", [CFG, SPEC], ids=lambda p: p.stem)


@LAYOUTS
def test_shapes_gradients_and_label_alignment(cfg):
    target, head = make_head(cfg, num_modules=3)
    assert head.num_steps == 3 and head.loss_weights == pytest.approx([1.0, 0.8, 0.64])
    b = batch(B=1, T=12)
    b["loss_mask"].zero_()
    b["loss_mask"][0, 9] = 1  # only token 9 counts
    feats = target(b["input_ids"], return_logits=True)
    out = head.training_loss(b, feats)
    assert out.loss.ndim == 0 and out.correct.shape == out.total.shape == (3,)
    assert out.total.tolist() == [1, 1, 1]  # module k (1-based) predicts token t+k+1: positions 7, 6, 5
    out.loss.backward()
    for m in head.layers:  # every module learns (module k feeds every deeper one; a shared one learns from all)
        assert m.eh_proj.weight.grad.abs().sum() > 0 and m.block.mlp.down_proj.weight.grad.abs().sum() > 0
    # position 5 feeds only module 3's scored position; 7 only module 1's (causal: later positions see it too)
    feats.last_state[0, 8] += 100.0
    assert torch.equal(head.training_loss(b, feats).loss, out.loss)  # position 8 is after every scored position
    feats.last_state[0, 5] += 100.0
    assert head.training_loss(b, feats).loss != out.loss


def test_loss_weights_and_bad_arguments():
    target, head = make_head(CFG, num_modules=2, loss_weights=[1.0, 1.0])
    assert head.loss_weights == [1.0, 1.0]
    with pytest.raises(UserError, match="loss_weights"):
        MTPHead(target, num_modules=3, loss_weights=[1.0, 0.5])
    with pytest.raises(UserError, match="loss_weights"):
        MTPHead(target, num_modules=2, loss_weights=[1.0, -0.5])
    with pytest.raises(UserError, match="num_modules"):
        MTPHead(target, num_modules=0)


@LAYOUTS
def test_feature_regression_pulls_each_depth_onto_the_next_depth0_input(cfg):
    """``feature_weight``: depth j+1's output at t is regressed onto the target's final-norm feature at t+1+j (depth 0's
    input at the position that predicts the same token); a perfect output costs nothing, the loss reaches the modules,
    weight 0 (the published recipes) adds nothing, and only scored positions count."""
    target, head = make_head(cfg, num_modules=2, feature_weight=0.1)
    b = batch(B=2, T=12)
    feats = target(b["input_ids"], attention_mask=b["attention_mask"], return_logits=True)
    for j in range(2):
        perfect = shift_left(feats.last_state, 1 + j)
        assert head.depth_regression(j, perfect, feats, b["loss_mask"], b["attention_mask"]) == 0
        assert head.depth_regression(j, shift_left(feats.last_state, j), feats, b["loss_mask"], b["attention_mask"]) > 0
    # a position whose token t+2+j is not scored does not count
    mask = torch.zeros_like(b["loss_mask"])
    mask[0, 9] = 1  # token 9: depth 1 scores position 7
    off = shift_left(feats.last_state, 1).clone()
    off[0, 3] += 5.0
    assert head.depth_regression(0, off, feats, mask, b["attention_mask"]) == 0
    off[0, 7] += 5.0
    assert head.depth_regression(0, off, feats, mask, b["attention_mask"]) > 0
    # in training it adds to the loss (not to the accuracies) and trains every module
    with_feat = head.training_loss(b, feats)
    head.zero_grad()
    with_feat.loss.backward()
    assert all(m.eh_proj.weight.grad.abs().sum() > 0 for m in head.layers)
    head.feature_weight = 0.0
    without = head.training_loss(b, feats)
    assert with_feat.loss > without.loss and torch.equal(with_feat.correct, without.correct)
    _, plain = make_head(cfg, num_modules=2)
    assert plain.feature_weight == 0
    with pytest.raises(UserError, match="draft.feature_weight=-1"):
        MTPHead(target, feature_weight=-1)


@LAYOUTS
def test_frozen_embedding_and_head_stay_frozen(cfg):
    target, head = make_head(cfg)
    assert torch.equal(head.embed_tokens.weight, target.embed_tokens().weight)
    assert torch.equal(head.lm_head.weight, target.lm_head().weight)
    frozen = {"embed_tokens.weight", "lm_head.weight"}
    assert {n for n, p in head.named_parameters() if not p.requires_grad} == frozen
    before = {n: p.detach().clone() for n, p in head.named_parameters()}
    b = batch()
    feats = target(b["input_ids"], attention_mask=b["attention_mask"], return_logits=True)
    opt = torch.optim.AdamW([p for p in head.parameters() if p.requires_grad], lr=1e-2)
    for _ in range(3):
        opt.zero_grad()
        head.training_loss(b, feats).loss.backward()
        assert head.embed_tokens.weight.grad is None and head.lm_head.weight.grad is None
        opt.step()
    for n, p in head.named_parameters():
        assert torch.equal(before[n], p) == (n in frozen), n


def teacher_forced_tokens(head, target, ids: torch.Tensor, at: int) -> list[int]:
    """Greedy token of every depth at position ``at`` from the training-time (whole-sequence) forward."""
    T = ids.numel()
    h = target(ids[None]).last_state
    cos, sin = head.rotary(torch.arange(T)[None])
    out = []
    with torch.no_grad():
        for j in range(head.num_steps):
            h, _, _ = head.module(j + 1)(h, head.embed_tokens(shift_left(ids[None], 1 + j)), cos, sin)
            out.append(int(head.logits(j + 1, h[0, at]).argmax()))
    return out


@LAYOUTS
def test_inference_chain_equals_the_training_forward(cfg):
    """Decoding's chain is the teacher-forced forward with the drafts as the following tokens."""
    target, head = make_head(cfg, num_modules=3)
    prompt = torch.randint(0, 128, (9,), generator=torch.Generator().manual_seed(3))
    head.start(prompt, target(prompt[None]))
    drafts = head.propose(17, 3, Sampler()).tokens.tolist()
    seq = torch.cat([prompt, torch.tensor([17] + drafts)])
    assert teacher_forced_tokens(head, target, seq, at=prompt.numel() - 1) == drafts


@LAYOUTS
@pytest.mark.parametrize("reuse,k", [(False, 3), (False, 5), (True, 5)])
def test_inference_cache_equals_full_recompute(reuse, k, cfg):
    """After any sequence of rounds, propose gives what a fresh start over the whole sequence gives, and every
    depth's cache holds exactly the fresh start's keys/values (accepted positions only)."""
    target, head = make_head(cfg, num_modules=3, reuse_last_module=reuse)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 128, (2,), generator=g)  # shorter than D: early depths have no known position yet
    head.start(ids, target(ids[None]))
    for round_ in range(9):
        kr = 1 if round_ in (3, 6) else k  # short rounds leave the deeper caches behind for a while
        pending = int(torch.randint(0, 128, (), generator=g))
        drafts = head.propose(pending, kr, Sampler()).tokens
        assert drafts.numel() == (kr if reuse else min(kr, 3))
        fresh = copy.deepcopy(head)
        fresh.start(ids, target(ids[None]))
        assert torch.equal(fresh.propose(pending, kr, Sampler()).tokens, drafts)
        assert len(fresh._kv) == drafts.numel()
        for (k1, v1), (k2, v2) in zip([c.kept() for c in head._kv], [c.kept() for c in fresh._kv]):  # depths run
            assert k1.shape == k2.shape and torch.allclose(k1, k2, atol=1e-5) and torch.allclose(v1, v2, atol=1e-5)
        n_acc = round_ % (drafts.numel() + 1)  # accept 0, 1, 2, ... drafts
        block = torch.cat([torch.tensor([pending]), drafts[:n_acc]])
        ids = torch.cat([ids, block])
        head.commit(block, _tail(target, ids, block.numel()))
    assert ids.numel() > 10


def _tail(target, ids, n):
    """Target features of the last n tokens of ``ids`` (what the decoder commits after a round)."""
    out = target(ids[None])
    return TargetOutput(tap_states=out.tap_states[:, -n:], last_state=out.last_state[:, -n:])


@LAYOUTS
def test_reuse_last_module_decodes_losslessly_and_longer(cfg):
    target, head = make_head(cfg, num_modules=2)
    prompt = torch.randint(0, 128, (7,), generator=torch.Generator().manual_seed(5))
    head.start(prompt, target(prompt[None]))
    assert head.propose(4, 5, Sampler()).tokens.numel() == 2  # off by default: at most D tokens
    head.reuse_last_module = True
    head.start(prompt, target(prompt[None]))
    assert head.propose(4, 5, Sampler()).tokens.numel() == 5
    assert head.module(5) is head.layers[-1]
    dec = SpeculativeDecoder(target, eos_token_ids=[])
    ref = plain_greedy(target.model, prompt, 16)
    out, st = dec.generate(prompt, head, k=5, max_new_tokens=16)
    assert out == ref and st.passes >= 1
    out, _ = dec.generate(prompt, head, k=5, max_new_tokens=16,
                          sampler=Sampler(1.0, generator=torch.Generator().manual_seed(0)))
    assert len(out) == 16


def test_the_two_layouts():
    """DeepSeek-V3 (default): D Llama-style modules, pre-norm chain. speculators: one Qwen3-style module at every
    depth, each depth fed the previous one's final-norm output (what the head reads)."""
    _, ds = make_head(CFG, num_modules=3)
    target, sp = make_head(SPEC, num_modules=3)
    assert len(ds.layers) == 3 and len(sp.layers) == 1 and ds.num_steps == sp.num_steps == 3
    assert all(sp.module(j) is sp.layers[0] for j in (1, 2, 3, 7))
    assert not hasattr(ds.layers[0].block.self_attn, "q_norm") and sp.layers[0].block.self_attn.q_norm.weight.shape == (8,)
    assert {n.split(".", 2)[2] for n in sp.state_dict() if n.startswith("layers.0.")} - \
        {n.split(".", 2)[2] for n in ds.state_dict() if n.startswith("layers.0.")} == \
        {"block.self_attn.q_norm.weight", "block.self_attn.k_norm.weight"}
    b = batch(B=1, T=12)
    h0 = target(b["input_ids"]).last_state
    cos, sin = sp.rotary(torch.arange(12)[None])
    emb = sp.embed_tokens(b["input_ids"])
    with torch.no_grad():
        m = sp.layers[0]
        out, _, _ = m(h0, emb, cos, sin)
        m.norm_output = False  # the same block without the final norm: the pre-norm state
        pre, _, _ = m(h0, emb, cos, sin)
        m.norm_output = True
        assert torch.allclose(out, m.norm(pre)) and torch.equal(m.head_input(out), out)
        assert torch.equal(sp.logits(2, out), sp.lm_head(out))
        pre_ds, _, _ = ds.layers[0](h0, emb, cos, sin)
        assert torch.equal(ds.logits(1, pre_ds), ds.lm_head(ds.layers[0].norm(pre_ds)))


def test_exports_from_before_the_layout_options_load_unchanged(tmp_path):
    """A default MTP draft exported before shared_module/qk_norm/chain_normed existed (init_args without them) loads
    as the same DeepSeek-V3 head: same parameter names, same loss."""
    from models.formats import load_draft

    target, head = make_head(CFG, num_modules=2)
    names = [n for n in head.state_dict() if n.startswith("layers.0.")]
    assert names == ["layers.0.enorm.weight", "layers.0.hnorm.weight", "layers.0.eh_proj.weight",
                     "layers.0.block.input_layernorm.weight", "layers.0.block.self_attn.q_proj.weight",
                     "layers.0.block.self_attn.k_proj.weight", "layers.0.block.self_attn.v_proj.weight",
                     "layers.0.block.self_attn.o_proj.weight", "layers.0.block.post_attention_layernorm.weight",
                     "layers.0.block.mlp.gate_proj.weight", "layers.0.block.mlp.up_proj.weight",
                     "layers.0.block.mlp.down_proj.weight", "layers.0.norm.weight"]
    head.export(tmp_path / "draft")
    p = tmp_path / "draft" / "config.json"
    cfg = json.loads(p.read_text())
    for k in ("shared_module", "qk_norm", "chain_normed"):
        assert cfg["init_args"].pop(k) is False
    p.write_text(json.dumps(cfg))
    back = load_draft(tmp_path / "draft", target)
    assert len(back.layers) == 2 and not back.layers[0].norm_output
    b = batch()
    feats = target(b["input_ids"], attention_mask=b["attention_mask"], return_logits=True)
    assert torch.equal(head.training_loss(b, feats).loss, back.training_loss(b, feats).loss)


@LAYOUTS
def test_draft_vocabulary_restricts_decoding_only(cfg, tmp_path):
    """``draft_vocab_size``: the same training loss as the full head, drafts only from the most frequent tokens (the
    rows of the frozen head, exactly), and our export keeps the vocabulary. Decoding equals training with it:
    tests/test_decode_equals_train.py runs every config with a reduced vocabulary."""
    from models.formats import load_draft

    target, head = make_head(cfg, draft_vocab_size=40)
    counts = torch.arange(128.0).flip(0)  # token i is the i-th most frequent: the vocabulary is ids 0..39
    head.prepare_from_data(counts)
    _, full = make_head(cfg)
    full.load_state_dict({k: v for k, v in head.state_dict().items() if k not in head.decode_only_state})
    b = batch()
    feats = target(b["input_ids"], attention_mask=b["attention_mask"], return_logits=True)
    assert torch.equal(head.training_loss(b, feats).loss, full.training_loss(b, feats).loss)
    assert torch.equal(head.draft_head.weight, head.lm_head.weight[:40])
    h = torch.randn(3, head.lm_head.in_features)
    restricted, whole = head.draft_logits(1, h), full.draft_logits(1, h)
    assert torch.equal(restricted[:, :40], whole[:, :40]) and torch.isinf(restricted[:, 40:]).all()
    prompt = torch.randint(0, 128, (9,), generator=torch.Generator().manual_seed(2))
    head.start(prompt, target(prompt[None]))
    assert max(head.propose(5, 3, Sampler()).tokens.tolist()) < 40
    head.export(tmp_path / "draft")
    back = load_draft(tmp_path / "draft", target)
    assert torch.equal(back.d2t, head.d2t) and torch.equal(back.draft_head.weight, head.draft_head.weight)
    with pytest.raises(UserError, match="draft_vocab_size=0"):
        MTPHead(target, draft_vocab_size=0)
