"""GGUF targets (models/gguf.py): a tiny Llama written as a GGUF the way llama.cpp's converter writes one,
converted once into a cached HF folder, gives the same logits and tokens; damaged files are one-line errors."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.conftest import make_tokenizer, tiny_model

gguf = pytest.importorskip("gguf")
pytest.importorskip("accelerate")

TEXT = "Hello! Write a poem about the sea, Paris.\n  def add(a, b): return a + b"


def llama_cpp_permute(w: np.ndarray, n_head: int, n_head_kv: int | None = None) -> np.ndarray:
    """llama.cpp's ``LlamaModel.permute`` for Q/K rows (transformers undoes it when it loads a llama GGUF)."""
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_tiny_gguf(path: Path, layers: int = 2):
    """Write a random tiny Llama + the tiny byte-level BPE (with its chat template) as an F32 llama GGUF.

    Returns ``(path, model, tokenizer)``: the HF originals the GGUF was written from."""
    tok = make_tokenizer("embedded")
    model = tiny_model("llama", vocab_size=len(tok), layers=layers)
    c = model.config
    head_dim = c.hidden_size // c.num_attention_heads

    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name("tiny-llama")
    w.add_block_count(c.num_hidden_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_rope_freq_base(float(c.rope_parameters["rope_theta"]) if getattr(c, "rope_parameters", None) else c.rope_theta)
    w.add_rope_dimension_count(head_dim)
    w.add_vocab_size(c.vocab_size)
    w.add_file_type(gguf.LlamaFileType.ALL_F32)

    # tokenizer, as llama.cpp's _set_vocab_gpt2: tokens by id, CONTROL for added special tokens, merges "a b"
    vocab = tok.get_vocab()
    by_id = {i: t for t, i in vocab.items()}
    assert sorted(by_id) == list(range(len(tok)))
    special = {a.content for a in tok.added_tokens_decoder.values() if a.special}
    merges = json.loads(tok.backend_tokenizer.to_str())["model"]["merges"]
    merges = [m if isinstance(m, str) else " ".join(m) for m in merges]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt-2")
    w.add_token_list([by_id[i] for i in range(len(tok))])
    w.add_token_types([gguf.TokenType.CONTROL if by_id[i] in special else gguf.TokenType.NORMAL for i in range(len(tok))])
    w.add_token_merges(merges)
    w.add_bos_token_id(vocab["<|endoftext|>"])  # as Qwen-style GGUFs: a BOS id, never added
    w.add_eos_token_id(tok.eos_token_id)
    w.add_pad_token_id(tok.pad_token_id)
    w.add_add_bos_token(False)
    w.add_chat_template(tok.chat_template)

    names = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
             "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
             "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm"}
    sd = {k: v.detach().float().numpy() for k, v in model.state_dict().items()}
    w.add_tensor("token_embd.weight", sd["model.embed_tokens.weight"])
    for i in range(c.num_hidden_layers):
        for hf, g in names.items():
            t = sd[f"model.layers.{i}.{hf}.weight"]
            if g == "attn_q":
                t = llama_cpp_permute(t, c.num_attention_heads, c.num_attention_heads)
            elif g == "attn_k":
                t = llama_cpp_permute(t, c.num_attention_heads, c.num_key_value_heads)
            w.add_tensor(f"blk.{i}.{g}.weight", np.ascontiguousarray(t))
    w.add_tensor("output_norm.weight", sd["model.norm.weight"])
    w.add_tensor("output.weight", sd["lm_head.weight"])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path, model, tok


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    return write_tiny_gguf(tmp_path_factory.mktemp("gguf") / "tiny-llama.F32.gguf")


def test_gguf_converts_once_and_matches_the_original(tiny_gguf, tmp_path, monkeypatch):
    from models import gguf as mg
    from models.target import FrozenTarget, load_tokenizer, resolve_path

    path, model, tok = tiny_gguf
    monkeypatch.setenv("DRAFTSMITH_CACHE", str(tmp_path))
    out = mg.converted_dir(path)
    assert out.parent == tmp_path / "gguf" and out.name.startswith("tiny-llama.F32-")
    assert (out / "config.json").exists() and (out / "draftsmith_gguf.json").exists()
    assert json.loads((out / "draftsmith_gguf.json").read_text())["sha256"] == mg.sha256(path)
    assert not [p for p in out.parent.iterdir() if p.name.startswith(".")], "temporary folders left behind"

    # a second call (and resolve_path, FrozenTarget, load_tokenizer) reuse the folder: convert is never called again
    mtime = (out / "config.json").stat().st_mtime_ns
    monkeypatch.setattr(mg, "convert", lambda *a, **k: pytest.fail("converted twice"))
    assert mg.converted_dir(path) == out
    assert resolve_path(str(path)) == str(out)

    target = FrozenTarget(str(path), dtype="float32")
    cfg = target.config
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.vocab_size) == (
        model.config.num_hidden_layers, model.config.hidden_size, model.config.num_attention_heads,
        model.config.num_key_value_heads, model.config.vocab_size)
    assert not getattr(cfg, "quantization_config", None)
    ids = torch.tensor([tok(TEXT)["input_ids"][:24], list(range(3, 27))])
    with torch.no_grad():
        want = model(input_ids=ids).logits
    got = target(ids, return_logits=True).logits
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)

    loaded = load_tokenizer(str(path))
    assert loaded(TEXT)["input_ids"] == tok(TEXT)["input_ids"]
    assert loaded.eos_token == tok.eos_token and loaded.pad_token == tok.pad_token
    msgs = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}]
    assert loaded.chat_template
    assert loaded.apply_chat_template(msgs, tokenize=False) == tok.apply_chat_template(msgs, tokenize=False)
    assert loaded.decode(tok(TEXT)["input_ids"]) == TEXT
    assert (out / "config.json").stat().st_mtime_ns == mtime


@pytest.mark.parametrize("kind", ["truncated", "random", "missing"])
def test_bad_gguf_is_a_user_error(kind, tiny_gguf, tmp_path, monkeypatch):
    from data.errors import UserError
    from models.gguf import converted_dir
    from models.target import FrozenTarget

    cache = tmp_path / "cache"
    monkeypatch.setenv("DRAFTSMITH_CACHE", str(cache))
    bad = tmp_path / f"{kind}.gguf"
    if kind == "truncated":
        data = tiny_gguf[0].read_bytes()
        bad.write_bytes(data[: len(data) // 2])
    elif kind == "random":
        bad.write_bytes(np.random.default_rng(0).bytes(4096))
    for call in (converted_dir, FrozenTarget):
        with pytest.raises(UserError) as e:
            call(str(bad))
        msg = str(e.value)
        assert str(bad) in msg and "\n" not in msg, msg
    assert not cache.exists() or not any(cache.rglob("*")), list(cache.rglob("*"))


def test_gguf_and_smollm2_target_configs_instantiate(tiny_gguf, tmp_path, monkeypatch):
    """conf/target/gguf.yaml on a GGUF path, and conf/target/smollm2.yaml with the package's file stood in for by the
    tiny GGUF (the real one is 98 MB and converts in ~40 s: the quickstart's job, not the tests')."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    from conftest import ROOT
    from data.errors import instantiate
    from models import gguf as mg

    path, model, _ = tiny_gguf
    monkeypatch.setenv("DRAFTSMITH_CACHE", str(tmp_path))
    monkeypatch.setattr(mg, "smollm2_gguf", lambda: path)
    GlobalHydra.instance().clear()
    with initialize_config_dir(str(ROOT / "conf"), version_base="1.3"):
        cfgs = [compose("eval", overrides=["target=gguf", f"target.name_or_path={path}"]).target,
                compose("eval", overrides=["target=smollm2"]).target]
    for cfg in cfgs:
        target = instantiate(cfg)
        assert target.num_layers == model.config.num_hidden_layers
        assert next(target.parameters()).dtype == torch.float32  # dtype: auto on a CPU
        assert target.identity()["name_or_path"] == str(cfg.name_or_path)
