"""Serving formats (models/formats/, python -m train.export): layer-id conventions, export → import round trips,
bad input, and the real client — the speculators library (its own venv) loads our exports and gives our logits.

DFlash and DSpark exports need q/k-normed DFlash layers (every published DFlash layer has them; conf/draft/dflash.yaml
and dspark.yaml build them). The speculators cases are built by eval/check_export.py, the same functions that
``python -m eval.check_export`` runs on real drafts on their real targets. MTP is exported in the
speculators layout (conf/draft/mtp_speculators.yaml: one shared Qwen3 module, normed chain); the default DeepSeek-V3
layout is refused with the option to use.
"""
from __future__ import annotations

import inspect
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import hydra
import pytest
import torch
from omegaconf import OmegaConf

from conftest import ROOT, tiny_model, write_tiny_target
from data.errors import UserError
from eval import check_export
from models import formats
from models.formats import engine_layer_ids, export_draft, our_layer_ids
from models.formats import load_draft
from models.heads.dflash import DFlashHead
from models.target import FrozenTarget, default_tap_layers

LOGIT_ATOL = 1e-4  # speculators vs ours, fp32 on CPU (different attention kernels and RoPE code; measured ~2e-7)
QK_NORM = "qk_norm" in inspect.signature(DFlashHead.__init__).parameters  # can the DFlash head hold a DFlash layer?
SMALL = {"eagle3": {"ttt_steps": 3, "draft_vocab_size": 200}, "dflash": {"block_size": 4, "num_layers": 2},
         "dflash_anchor": {"block_size": 4, "num_layers": 2},
         "dspark": {"block_size": 4, "num_layers": 2, "markov_rank": 16},
         "dspark_vocab": {"block_size": 4, "num_layers": 2, "markov_rank": 16, "draft_vocab_size": 200}, "mtp": {"num_modules": 3, "loss_weights": [1.0, 0.6, 0.36], "draft_vocab_size": 200}}
CONFIG = {"mtp": "mtp_speculators", "dspark_vocab": "dspark"}  # the draft config each family is exported from (default: conf/draft/<family>.yaml)
CASES = [("eagle3", "speculators"), ("eagle3", "sglang"), ("dflash", "speculators"), ("dflash", "dflash"),
         ("dflash_anchor", "speculators"), ("dspark", "speculators"), ("dspark_vocab", "speculators"), ("mtp", "speculators")]
FAMILY = {"dflash_anchor": "dflash", "dspark_vocab": "dspark"}  # a variant's family (default: the config's name)


def exportable(family: str) -> bool:
    return FAMILY.get(family, family) in ("eagle3", "mtp") or QK_NORM


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory) -> Path:
    return write_tiny_target(tmp_path_factory.mktemp("target6"), layers=6)


def make_head(family: str, target_dir: Path, seed: int = 0, **over):
    """A head of ``family`` on the tiny target with every trainable weight random (zero-initialised parts too)."""
    cfg = OmegaConf.merge(OmegaConf.load(ROOT / "conf" / "draft" / f"{CONFIG.get(family, family)}.yaml"), SMALL[family], over)
    cls = hydra.utils.get_class(cfg._target_)
    target = FrozenTarget(str(target_dir))
    target.set_tap_layers(default_tap_layers(target.num_layers, cls.tap_method))
    torch.manual_seed(seed)
    head = hydra.utils.instantiate(cfg, target=target, _convert_="all")
    head.prepare_from_data(torch.rand(target.vocab_size, generator=torch.Generator().manual_seed(seed)))
    with torch.no_grad():
        for p in head.parameters():
            if p.requires_grad:
                p.normal_(0.0, 0.3 if p.ndim > 1 else 1.0)
    return target, head.eval()


def batch(V: int, T: int = 24, seed: int = 3) -> dict:
    ids = torch.randint(0, V, (1, T), generator=torch.Generator().manual_seed(seed))
    return {"input_ids": ids, "loss_mask": torch.ones_like(ids), "attention_mask": torch.ones_like(ids)}


ANCHORS = torch.tensor([2, 9, 15])


def our_logits(head, target, b: dict) -> dict[str, torch.Tensor]:
    return check_export.our_logits(head, target, b, ANCHORS)


# -- layer ids ------------------------------------------------------------------------------------
def test_layer_id_conversion_is_the_one_engines_use(target_dir):
    assert engine_layer_ids([1, 2, 3], "speculators") == [2, 3, 4]
    assert engine_layer_ids([1, 2, 3], "sglang") == engine_layer_ids([1, 2, 3], "dflash") == [1, 2, 3]
    for fmt in formats.LAYER_IDS:
        assert our_layer_ids(engine_layer_ids([0, 3, 5], fmt), fmt) == [0, 3, 5]
    # vLLM's speculators reader turns DFlash aux ids into z-lab target_layer_ids by subtracting one
    assert engine_layer_ids([1, 3], "dflash") == [i - 1 for i in engine_layer_ids([1, 3], "speculators")]
    with pytest.raises(UserError, match="embedding output"):
        our_layer_ids([0, 2], "speculators", "aux_hidden_state_layer_ids")
    # against the definitions: speculators/vLLM index Hugging Face hidden_states; SGLang and z-lab name the output
    # of decoder layer i (a hook on layers[i]); our tap states must be exactly those tensors
    target = FrozenTarget(str(target_dir))
    taps = [1, 3, 4]
    target.set_tap_layers(taps)
    ids = batch(target.vocab_size)["input_ids"]
    outs = {}
    hooks = [target.model.model.layers[i].register_forward_hook(lambda m, a, o, i=i: outs.__setitem__(i, o[0] if isinstance(o, tuple) else o))
             for i in range(target.num_layers)]
    with torch.no_grad():
        hs = target.model(ids, output_hidden_states=True).hidden_states
        mine = target(ids).tap_states
    for h in hooks:
        h.remove()
    for n, (s, o) in enumerate(zip(engine_layer_ids(taps, "speculators"), engine_layer_ids(taps, "sglang"))):
        assert torch.equal(mine[:, :, n], hs[s]) and torch.equal(mine[:, :, n], outs[o])
    # speculators' MTP reads hidden_states[num_hidden_layers]: the final-norm output, our last_state
    L = target.num_layers
    assert engine_layer_ids([L - 1], "speculators") == [L] and torch.equal(target(ids).last_state, hs[L])


def engine_collects(model, layer_ids: list[int], ids: torch.Tensor) -> torch.Tensor:
    """What vLLM and SGLang hand an EAGLE-3 head: for each layer id (vLLM numbering, speculators'
    ``eagle_aux_hidden_state_layer_ids``), the residual stream entering decoder layer id (``hidden_states + residual``
    before it; in a Hugging Face Llama the hidden state passed into the layer) → [B, T, n, d]."""
    got = {}

    def grab(i):
        def hook(module, args, kwargs):
            got[i] = args[0] if args else kwargs["hidden_states"]
        return hook

    hooks = [model.model.layers[i].register_forward_pre_hook(grab(i), with_kwargs=True) for i in layer_ids]
    try:
        with torch.no_grad():
            model(ids)
    finally:
        for h in hooks:
            h.remove()
    return torch.stack([got[i] for i in layer_ids], dim=2)


def test_an_exported_head_receives_the_features_it_was_trained_on(target_dir, tmp_path):
    """vLLM's collection reproduced on the tiny Llama target: the layers an export lists are hooked the way an engine
    reads them, and the features equal the tap states the head trained on, bit for bit; so do the head's inputs."""
    target, head = make_head("eagle3", target_dir)
    for taps in ([1, 3, 4], [0, 2, 4]):  # the recipes' taps; tap 4 is the input of the last layer
        target.set_tap_layers(taps)
        head.tap_layers = list(taps)
        head.export(tmp_path / f"draft{taps}")
        spec = export_draft(tmp_path / f"draft{taps}", "speculators", tmp_path / f"spec{taps}")
        sgl = export_draft(tmp_path / f"draft{taps}", "sglang", tmp_path / f"sgl{taps}")
        vllm_ids = json.loads((spec / "config.json").read_text())["eagle_aux_hidden_state_layer_ids"]
        sglang_ids = [i + 1 for i in json.loads((sgl / "config.json").read_text())["eagle_config"]["eagle_aux_hidden_state_layer_ids"]]
        assert vllm_ids == sglang_ids and max(vllm_ids) < target.num_layers  # every listed layer exists to be hooked
        ids = batch(target.vocab_size)["input_ids"]
        served = engine_collects(target.model, vllm_ids, ids)
        trained = target(ids)
        assert torch.equal(served, trained.tap_states)
        from models.target import TargetOutput

        loaded = load_draft(spec, FrozenTarget(str(target_dir), fast_linear=False))  # what the engine's copy computes
        as_served = loaded.fuse(TargetOutput(tap_states=served, last_state=trained.last_state))  # [B, T, d]
        assert torch.allclose(as_served, head.fuse(trained), atol=1e-6)


def test_heads_trained_on_a_tap_no_engine_collects_are_refused(target_dir, tmp_path):
    """An EAGLE-3 head that read the last layer's output (an old recipe's tap 5 of 6) is refused in one line by the
    export and by loading; an EAGLE-1-style head, which reads the final-norm state, records tap 5 and loads."""
    from eval.decoding.drafters import load_head

    target, head = make_head("eagle3", target_dir)
    target.set_tap_layers([1, 3, 5])
    old = type(head)(target=target, **head.init_args)
    old.export(tmp_path / "old")
    for fmt in ("speculators", "sglang"):
        with pytest.raises(UserError, match=r"tap_layers=\[1, 3, 5\]: tap 5 is the output of the last decoder layer, which no "
                                            r"serving engine collects.*retrain"):
            export_draft(tmp_path / "old", fmt, tmp_path / f"out-{fmt}")
        assert not (tmp_path / f"out-{fmt}").exists()
    with pytest.raises(UserError, match="no serving engine collects"):
        load_head(str(tmp_path / "old"), target)
    eagle = load_head("assets/embedded-eagle", FrozenTarget("embedded", fast_linear=False))
    assert eagle.tap_layers == [5] and not eagle.reads_taps


# -- round trips ----------------------------------------------------------------------------------
@pytest.mark.parametrize("family,fmt", CASES, ids=lambda x: x)
def test_export_import_round_trip(family, fmt, target_dir, tmp_path):
    target, head = make_head(family, target_dir)
    head.export(tmp_path / "draft")
    if not exportable(family):
        with pytest.raises(UserError, match="q/k RMSNorm"):
            export_draft(tmp_path / "draft", fmt, tmp_path / "out")
        assert sorted(p.name for p in tmp_path.iterdir()) == ["draft"]
        return
    out = export_draft(tmp_path / "draft", fmt, tmp_path / "out")
    cfg = json.loads((out / "config.json").read_text())
    assert formats.detect_format(out) == fmt and cfg["draftsmith"]["family"] == FAMILY.get(family, family)
    # the check python -m eval.check_export runs on real drafts: import → same class, taps, weights, logits; export again
    # → same tensors
    ids = batch(target.vocab_size)["input_ids"]
    rt = check_export.round_trip(head, target, out, fmt, str(target_dir), ids, ANCHORS, tmp_path / "again")
    assert rt == {"same_class": True, "same_taps": True, "weights_identical": True, "logits_identical": True,
                  "reexport_identical": True, "identical": True}


def test_exports_name_what_each_engine_reads(target_dir, tmp_path):
    target, head = make_head("eagle3", target_dir)
    head.export(tmp_path / "draft")
    spec = export_draft(tmp_path / "draft", "speculators", tmp_path / "spec", dtype="bfloat16")
    c = json.loads((spec / "config.json").read_text())
    assert c["speculators_model_type"] == "eagle3" and c["architectures"] == ["Eagle3Speculator"]
    assert c["speculators_config"]["proposal_methods"][0] == {"proposal_type": "greedy", "speculative_tokens": 3,
                                                             "verifier_accept_k": 1, "accept_tolerance": 0.0}
    assert c["speculators_config"]["verifier"] == {"name_or_path": str(target_dir.resolve()), "architectures": ["LlamaForCausalLM"]}
    assert c["eagle_aux_hidden_state_layer_ids"] == [h + 1 for h in head.tap_layers] and c["norm_before_residual"] is False
    assert c["draft_vocab_size"] == 200 and c["transformer_layer_config"]["num_hidden_layers"] == 1
    from safetensors.torch import load_file

    w = load_file(str(spec / "model.safetensors"))
    assert {"fc.weight", "layers.0.hidden_norm.weight", "layers.0.self_attn.q_proj.weight", "norm.weight", "lm_head.weight",
            "d2t", "t2d", "embed_tokens.weight"} <= set(w) and not any(k.startswith("midlayer.") for k in w)
    assert w["fc.weight"].dtype == torch.bfloat16 and w["d2t"].dtype == torch.int64 and w["t2d"].dtype == torch.bool
    sg = export_draft(tmp_path / "draft", "sglang", tmp_path / "sg")
    c = json.loads((sg / "config.json").read_text())
    assert c["architectures"] == ["LlamaForCausalLMEagle3"] and c["num_hidden_layers"] == 1 and c["draft_vocab_size"] == 200
    assert c["eagle_config"] == {"eagle_aux_hidden_state_layer_ids": head.tap_layers, "use_aux_hidden_state": True}
    w = load_file(str(sg / "model.safetensors"))
    assert "embed_tokens.weight" not in w and {"fc.weight", "midlayer.hidden_norm.weight", "d2t", "t2d"} <= set(w)


# -- bad input ------------------------------------------------------------------------------------
def test_formats_that_cannot_hold_a_family_say_so():
    with pytest.raises(UserError, match=r"format=sglang cannot hold a dspark draft; formats that can: speculators"):
        formats.check_exportable("dspark", "sglang")
    with pytest.raises(UserError, match=r"cannot hold a medusa draft; no serving format holds it \(speculators: eagle3"):
        formats.check_exportable("medusa", "speculators")
    formats.check_exportable("mtp", "speculators")  # the layout is checked on the head (test below)
    with pytest.raises(UserError, match="use one of speculators, sglang, dflash"):
        formats.check_exportable("eagle3", "onnx")


def test_drafts_no_format_holds_are_refused_whole(target_dir, tmp_path):
    cfg = OmegaConf.load(ROOT / "conf" / "draft" / "medusa.yaml")
    target = FrozenTarget(str(target_dir))
    hydra.utils.instantiate(cfg, target=target, _convert_="all").export(tmp_path / "draft")
    for fmt in formats.FORMATS:
        with pytest.raises(UserError, match=f"format={fmt} cannot hold a medusa draft; no serving format holds it"):
            export_draft(tmp_path / "draft", fmt, tmp_path / "out")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["draft"]


@pytest.mark.parametrize("over,differs", [({}, "3 modules (shared_module), no q/k norms (qk_norm), pre-norm states handed on"),
                                          ({"shared_module": True, "qk_norm": True}, "pre-norm states handed on (chain_normed)"),
                                          ({"num_modules": 1, "chain_normed": True}, "no q/k norms (qk_norm);")])
def test_mtp_layouts_speculators_cannot_hold_are_refused_with_the_option(over, differs, target_dir, tmp_path):
    """The DeepSeek-V3 layout (conf/draft/mtp.yaml), or any mix: one line naming what differs and the config to use."""
    cfg = OmegaConf.merge(OmegaConf.load(ROOT / "conf" / "draft" / "mtp.yaml"), over)
    hydra.utils.instantiate(cfg, target=FrozenTarget(str(target_dir)), _convert_="all").export(tmp_path / "draft")
    with pytest.raises(UserError) as e:
        export_draft(tmp_path / "draft", "speculators", tmp_path / "out")
    msg = str(e.value)
    assert msg.startswith("format=speculators cannot hold this mtp draft: speculators' MTP is one Qwen3 layer reused")
    assert differs in msg and msg.endswith("train it with draft=mtp_speculators") and "\n" not in msg
    for fmt in ("sglang", "dflash"):
        with pytest.raises(UserError, match=f"format={fmt} cannot hold a mtp draft; formats that can: speculators"):
            export_draft(tmp_path / "draft", fmt, tmp_path / "out")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["draft"]


def test_zlab_format_refuses_the_anchor_slot_layout(target_dir, tmp_path):
    """z-lab's DFlash drafts from a MASK slot after the anchor; a head trained to draft from the anchor's slot would be
    served one token off, so format=dflash refuses it in one line and format=speculators holds it (sample_from_anchor)."""
    _, head = make_head("dflash_anchor", target_dir)
    head.export(tmp_path / "draft")
    with pytest.raises(UserError, match=r"^format=dflash cannot hold this draft: .*export it with format=speculators$"):
        export_draft(tmp_path / "draft", "dflash", tmp_path / "out")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["draft"]
    out = export_draft(tmp_path / "draft", "speculators", tmp_path / "spec")
    assert json.loads((out / "config.json").read_text())["sample_from_anchor"] is True


def test_zlab_format_refuses_a_draft_vocabulary(target_dir, tmp_path):
    """z-lab's DFlash drafts from the target's full head; a head trained on fewer rows is refused in one line, no output
    (format=speculators holds it: its d2t/t2d and the rows as lm_head)."""
    _, head = make_head("dflash", target_dir, draft_vocab_size=64)
    head.export(tmp_path / "draft")
    with pytest.raises(UserError, match=r"^format=dflash here writes dflash drafts over the target's full "
                                        r"vocabulary, .* 64 draft tokens .*draft.draft_vocab_size=null to export it$"):
        export_draft(tmp_path / "draft", "dflash", tmp_path / "out")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["draft"]
    out = export_draft(tmp_path / "draft", "speculators", tmp_path / "spec")
    assert json.loads((out / "config.json").read_text())["draft_vocab_size"] == 64


def test_unknown_target_asks_for_the_verifier(target_dir, tmp_path):
    target = FrozenTarget(model=tiny_model("llama", layers=6))
    target.name_or_path = "random-llama"
    torch.manual_seed(0)
    from models.heads.eagle3 import Eagle3Head

    Eagle3Head(target, ttt_steps=2, draft_vocab_size=64).export(tmp_path / "draft")
    with pytest.raises(UserError, match=r"records its target as 'random-llama', which cannot be loaded here .*pass verifier="):
        export_draft(tmp_path / "draft", "speculators", tmp_path / "out")
    with pytest.raises(UserError, match=r"verifier='/nowhere': could not load it"):
        export_draft(tmp_path / "draft", "speculators", tmp_path / "out", verifier="/nowhere")
    with pytest.raises(UserError, match="vocab_size"):  # a verifier that is not this draft's target
        export_draft(tmp_path / "draft", "speculators", tmp_path / "out", verifier=str(target_dir))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["draft"]  # nothing half-written


def test_import_that_does_not_match_names_the_field(target_dir, tmp_path):
    _, head = make_head("eagle3", target_dir)
    head.export(tmp_path / "draft")
    out = export_draft(tmp_path / "draft", "speculators", tmp_path / "spec")
    cfg_path = out / "config.json"
    good = cfg_path.read_text()

    def edited(fn):
        c = json.loads(good)
        fn(c)
        cfg_path.write_text(json.dumps(c))
        return out

    t = FrozenTarget(str(target_dir))
    with pytest.raises(UserError, match=r"transformer_layer_config.head_dim=16, but the eagle3 head built on this target has 8"):
        load_draft(edited(lambda c: c["transformer_layer_config"].update(head_dim=16)), t)
    with pytest.raises(UserError, match=r"layers.0.self_attn.o_proj.weight has shape \[32, 32\], the config implies \[32, 16\]"):
        load_draft(edited(lambda c: c["transformer_layer_config"].update(num_attention_heads=2, num_key_value_heads=2)), t)
    with pytest.raises(UserError, match=r"model.safetensors: fc.weight has shape \[32, 96\], the config implies \[32, 64\]"):
        load_draft(edited(lambda c: c.update(eagle_aux_hidden_state_layer_ids=[2, 3])), t)
    with pytest.raises(UserError, match=r"t2d marks 200 tokens, draft_vocab_size is 150"):
        load_draft(edited(lambda c: c.update(draft_vocab_size=150)), t)
    with pytest.raises(UserError, match=r"config.fc_norm=true"):
        load_draft(edited(lambda c: c.update(fc_norm=True)), t)
    with pytest.raises(UserError, match=r"rope_type 'yarn' is not supported"):
        load_draft(edited(lambda c: c["transformer_layer_config"].update(rope_parameters={"rope_type": "yarn", "factor": 4.0})), t)
    with pytest.raises(UserError, match=r"speculators_model_type='peagle' cannot be imported"):
        load_draft(edited(lambda c: c.update(speculators_model_type="peagle")), t)
    with pytest.raises(UserError, match="id 0 is the embedding output"):
        load_draft(edited(lambda c: c.update(eagle_aux_hidden_state_layer_ids=[0, 2, 3])), t)


def test_mtp_import_that_does_not_match_names_the_field(target_dir, tmp_path):
    _, head = make_head("mtp", target_dir)
    head.export(tmp_path / "draft")
    out = export_draft(tmp_path / "draft", "speculators", tmp_path / "spec")
    c = json.loads((out / "config.json").read_text())
    assert c["speculators_model_type"] == "mtp" and c["architectures"] == ["MTPDraftModel"]
    assert c["num_nextn_predict_layers"] == 1 and c["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 3
    assert c["transformer_layer_config"]["model_type"] == "qwen3" and c["transformer_layer_config"]["num_hidden_layers"] == 6
    from safetensors.torch import load_file

    names = set(load_file(str(out / "model.safetensors")))
    assert {"mtp_layers.0.input_proj.weight", "mtp_layers.0.token_layernorm.weight", "mtp_layers.0.hidden_layernorm.weight",
            "mtp_layers.0.final_layernorm.weight", "mtp_layers.0.self_attn.q_norm.weight", "mtp_layers.0.input_layernorm.weight",
            "mtp_layers.0.mlp.down_proj.weight"} <= names
    assert all(n.startswith("mtp_layers.0.") for n in names)  # embedding and head: speculators loads the verifier's
    good = json.dumps(c)

    def edited(fn):
        x = json.loads(good)
        fn(x)
        (out / "config.json").write_text(json.dumps(x))
        return out

    t = FrozenTarget(str(target_dir))
    with pytest.raises(UserError, match=r"num_hidden_layers=4: speculators' MTP reads hidden_states\[4\], .*hidden_states\[6\]"):
        load_draft(edited(lambda x: x["transformer_layer_config"].update(num_hidden_layers=4)), t)
    with pytest.raises(UserError, match=r"model_type='qwen3_next': the MTP head here has a Qwen3 layer"):
        load_draft(edited(lambda x: x["transformer_layer_config"].update(model_type="qwen3_next")), t)
    with pytest.raises(UserError, match=r"transformer_layer_config.intermediate_size=48, but the mtp head built on this target has 64"):
        load_draft(edited(lambda x: x["transformer_layer_config"].update(intermediate_size=48)), t)
    # a serving setting that changes the depth count: the recorded per-depth loss weights are dropped, not misapplied
    back = load_draft(edited(lambda x: x["speculators_config"]["proposal_methods"][0].update(speculative_tokens=5)), t)
    assert back.num_steps == 5 and len(back.layers) == 1 and len(back.loss_weights) == 5


def test_cli_exports_a_run_dir_and_refuses_in_one_line(target_dir, tmp_path):
    _, head = make_head("eagle3", target_dir)
    head.export(tmp_path / "run" / "draft")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    ok = subprocess.run([sys.executable, "-m", "train.export", f"src={tmp_path / 'run'}", "format=sglang"],
                        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert ok.returncode == 0, ok.stderr[-2000:]
    assert json.loads(ok.stdout[ok.stdout.index("{"):])["out"] == f"{tmp_path / 'run'}-sglang"
    assert formats.detect_format(tmp_path / "run-sglang") == "sglang"
    bad = subprocess.run([sys.executable, "-m", "train.export", f"src={tmp_path / 'run'}", "format=dflash",
                          f"out={tmp_path / 'zlab'}"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert bad.returncode == 2 and bad.stderr.strip().splitlines() == [
        "error: format=dflash cannot hold a eagle3 draft; formats that can: speculators, sglang"]
    assert not (tmp_path / "zlab").exists() and not list(tmp_path.glob(".zlab*"))


def test_eval_loads_a_speculators_export(target_dir, tmp_path):
    from eval.decoding.drafters import load_head

    target, head = make_head("eagle3", target_dir)
    head.export(tmp_path / "draft")
    out = export_draft(tmp_path / "draft", "speculators", tmp_path / "spec")
    loaded = load_head(str(out), FrozenTarget(str(target_dir)))
    assert not loaded.training and torch.equal(loaded.fc.weight, head.fc.weight)


def test_load_head_sets_decoding_settings_and_refuses_others(target_dir, tmp_path):
    from eval.decoding.drafters import load_head

    target = FrozenTarget(str(target_dir))
    _, mtp = make_head("mtp", target_dir)
    mtp.export(tmp_path / "mtp")
    assert load_head(str(tmp_path / "mtp"), target).max_draft == mtp.num_steps
    past = load_head(str(tmp_path / "mtp"), target, decode={"reuse_last_module": True})
    assert past.max_draft is None and past.init_args["reuse_last_module"] is True
    with pytest.raises(UserError, match=r"decode.num_modules: not a decoding setting of MTPHead \(it has: reuse_last_module\)"):
        load_head(str(tmp_path / "mtp"), target, decode={"num_modules": 4})
    with pytest.raises(UserError, match="decode.reuse_last_module='yes': expected a bool"):
        load_head(str(tmp_path / "mtp"), target, decode={"reuse_last_module": "yes"})
    _, dspark = make_head("dspark", target_dir)
    dspark.export(tmp_path / "dspark")
    with pytest.raises(UserError, match=r"decode.block_size: not a decoding setting of DSparkHead \(it has: none\)"):
        load_head(str(tmp_path / "dspark"), target, decode={"block_size": 4})
    with pytest.raises(UserError, match="decode.reuse_last_module='false': expected a bool"):
        load_head(str(tmp_path / "mtp"), target, decode={"reuse_last_module": "false"})


def test_load_head_packs_the_heads_linears_where_the_target_does(target_dir, tmp_path):
    from eval.decoding.drafters import load_head
    import torch.nn.functional as F

    from models.cpu_linear import PackedLinear, fused

    target, head = make_head("eagle3", target_dir)
    head.export(tmp_path / "draft")
    fast_target = FrozenTarget(str(target_dir), fast_linear=True)
    if not fast_target.packed_linears:
        pytest.skip("this PyTorch build has no oneDNN packed linear")
    fast = load_head(str(tmp_path / "draft"), fast_target, linear_dtype="float32")
    plain = load_head(str(tmp_path / "draft"), FrozenTarget(str(target_dir), fast_linear=False))
    assert isinstance(fast.lm_head, PackedLinear) and not any(isinstance(m, PackedLinear) for m in plain.modules())
    with pytest.raises(UserError, match="linear_dtype=int8"):
        load_head(str(tmp_path / "draft"), fast_target, linear_dtype="int8")
    auto = load_head(str(tmp_path / "draft"), fast_target)  # auto, the default: each layer's fastest kernel, timed
    assert all(type(m) in (torch.nn.Linear, PackedLinear) for m in auto.modules() if isinstance(m, torch.nn.Linear))
    x = torch.randn(3, 4, fast.lm_head.in_features)
    with torch.no_grad():
        torch.testing.assert_close(fast.lm_head(x), plain.lm_head(x), rtol=1e-4, atol=1e-4)
    # q/k/v and gate/up are one product each in the packed head, with the same outputs as the separate layers
    attn, mlp = fast.midlayer.self_attn, fast.midlayer.mlp
    h = torch.randn(1, 5, attn.q_proj.in_features)
    cos, sin = fast.rotary(torch.arange(5)[None])
    with torch.no_grad():
        assert fused(attn, h) is not None and fused(mlp, h[..., :mlp.gate_proj.in_features]) is not None
        for a, b in zip(attn.qkv(h, cos, sin), plain.midlayer.self_attn.qkv(h, cos, sin)):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
        y = h[..., :mlp.gate_proj.in_features]
        torch.testing.assert_close(mlp(y), plain.midlayer.mlp(y), rtol=1e-4, atol=1e-4)
        mlp.up_proj.weight.mul_(2)  # a weight changed in place: the packed copies follow it
        torch.testing.assert_close(mlp(y), F.linear(F.silu(F.linear(y, mlp.gate_proj.weight)) * F.linear(y, mlp.up_proj.weight),
                                                    mlp.down_proj.weight), rtol=1e-4, atol=1e-4)
    assert fused(attn, h) is None  # autograd: the separate layers


# -- the real client: the speculators library in its own environment ---------------------------------
@pytest.fixture(scope="module")
def speculators_results(target_dir, tmp_path_factory):
    """Export every exportable (family, format), run speculators on each; → {case: (ours, theirs, meta, expected)}.

    Built by eval/check_export.py, the functions ``python -m eval.check_export`` runs on real drafts."""
    try:
        check_export.side_python()
    except UserError as e:
        pytest.skip(str(e))
    work = tmp_path_factory.mktemp("speculators")
    cases, expected = [], {}
    for family, fmt in CASES:
        if not exportable(family):
            continue
        name = f"{family}-{fmt}"
        target, head = make_head(family, target_dir)
        head.export(work / f"{family}-draft")
        out = export_draft(work / f"{family}-draft", fmt, work / name)
        ids = batch(target.vocab_size)["input_ids"]
        case, ours, meta = check_export.make_case(name, head, target, out, fmt, ids, ANCHORS, work, str(target_dir))
        cases.append(case)
        expected[name] = (ours, meta)
    t0 = time.time()
    side = check_export.run_side(cases, work, timeout=600)
    results = {name: (expected[name][0], theirs, meta, expected[name][1]) for name, (theirs, meta) in side.items()}
    print(f"\nspeculators 0.9.0 side run: {time.time() - t0:.1f}s; max |logit difference| (tolerance {LOGIT_ATOL}):")
    for name, (ours, theirs, _, _) in results.items():
        c = check_export.compare(ours, theirs)
        print(f"  {name:22s} " + "  ".join(f"{k} {v:.2e}" for k, v in c.items() if k.startswith("max_abs_diff"))
              + f"  top-1 {c['top1_agreement']:.1%}")
    for family in SMALL:
        if not exportable(family):
            print(f"  {family:22s} not exported: the {family} head has no q/k-normed DFlash layers")
    return results


@pytest.mark.parametrize("case", [f"{f}-{m}" for f, m in CASES], ids=str)
def test_speculators_library_gives_our_logits(case, speculators_results):
    family = case.split("-")[0]
    if not exportable(family):
        assert case not in speculators_results  # refused at export (test_export_import_round_trip checks the message)
        return
    ours, theirs, meta, expected = speculators_results[case]
    assert {k: meta[k] for k in expected} == expected
    for k in ours:
        assert theirs[k].shape == ours[k].shape, k
        assert (theirs[k] - ours[k]).abs().max().item() <= LOGIT_ATOL, k


def test_speculators_library_cli_checks_drafts_and_refuses_in_one_line(target_dir, tmp_path):
    """python -m eval.check_export on trained-draft directories: every exportable draft checked against speculators and
    round-tripped, the DeepSeek-layout MTP refused with one error line, the others still checked; exit 2 (refused)."""
    try:
        check_export.side_python()
    except UserError as e:
        pytest.skip(str(e))
    for family in ("eagle3", "dspark"):
        make_head(family, target_dir)[1].export(tmp_path / family / "draft")
    cfg = OmegaConf.load(ROOT / "conf" / "draft" / "mtp.yaml")  # DeepSeek-V3 layout: speculators cannot hold it
    hydra.utils.instantiate(cfg, target=FrozenTarget(str(target_dir)), _convert_="all").export(tmp_path / "mtp" / "draft")
    text = "The quick brown fox jumps over the lazy dog while the cat sleeps in the warm afternoon sun. " * 4
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    r = subprocess.run([sys.executable, "-m", "eval.check_export", f"drafts=[{tmp_path / 'eagle3'},{tmp_path / 'mtp'},"
                        f"{tmp_path / 'dspark' / 'draft'}]", f"out={tmp_path / 'check'}", f"text='{text}'", "tokens=40",
                        "anchors=4"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert r.returncode == 2, r.stdout[-3000:] + r.stderr[-3000:]
    errors = [line for line in r.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and errors[0].startswith(f"error: {tmp_path / 'mtp'}: format=speculators cannot hold this mtp draft")
    assert errors[0].endswith("train it with draft=mtp_speculators")
    res = json.loads((tmp_path / "check" / "result.json").read_text())
    got = {rec["family"]: rec for rec in res["drafts"]}
    assert [rec["family"] for rec in res["drafts"]] == ["eagle3", "mtp", "dspark"] and "error" in got["mtp"]
    for family in ("eagle3", "dspark"):
        rec = got[family]
        assert rec["ok"] and rec["round_trip"]["identical"] and rec["speculators"]["config_ok"], rec
        assert rec["speculators"]["max_abs_diff"] <= LOGIT_ATOL and rec["speculators"]["top1_agreement"] == 1.0
        assert rec["tokens"] == 40 and rec["text"] == "text="
    assert len(got["dspark"]["anchors"]) == 4 and "max_abs_diff_confidence" in got["dspark"]["speculators"]
    assert not list((tmp_path / "check").glob("exports"))  # exports went to a temporary directory, removed
