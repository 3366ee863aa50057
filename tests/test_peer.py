"""eval.peer and speculators' EAGLE-3 variants: the head's options, their import, and a head trained by speculators'
own trainer (through eval/peer_side.py's CPU launcher) whose logits through our import equal speculators' forward."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from data.errors import UserError
from test_decode_equals_train import check_decode_equals_train, check_tree_equals_train, perturbed
from test_heads import DRAFT_CONFIGS

EAGLE3 = next(p for p in DRAFT_CONFIGS if p.stem == "eagle3")
VARIANTS = {"norm_before_fc": True, "norm_before_residual": True, "norm_output": True}


def test_variants_decode_as_they_train():
    """With every speculators variant on and a window that binds (4 keys on sequences of ~30), decoding's chain and
    tree still draft what the teacher-forced training forward gives."""
    target, head = perturbed(EAGLE3, **VARIANTS, sliding_window=4)
    check_decode_equals_train(target, head)
    target, head = perturbed(EAGLE3, **VARIANTS, sliding_window=4)
    check_tree_equals_train(target, head)


def test_each_variant_changes_the_forward_and_a_wide_window_does_not():
    torch.manual_seed(0)
    target, plain = perturbed(EAGLE3)
    ids = torch.randint(0, 128, (1, 24))
    feats = target(ids)

    def logits(head):
        return torch.stack([head.logits_of(h) for h in head.unroll(ids, torch.ones_like(ids), feats, 2)])

    base = logits(plain)
    for over in [{"norm_before_fc": True}, {"norm_before_residual": True}, {"norm_output": True}, {"sliding_window": 3}]:
        _, head = perturbed(EAGLE3, **over)
        assert not torch.allclose(logits(head), base, atol=1e-4), over
    _, wide = perturbed(EAGLE3, sliding_window=24)
    torch.testing.assert_close(logits(wide), base)


def variant_head(target_dir: Path, **over):
    """An EAGLE-3 head on the tiny target (a folder, so that it exports) with random weights and ``over`` options."""
    import hydra
    from omegaconf import OmegaConf

    from models.target import FrozenTarget, default_tap_layers

    target = FrozenTarget(str(target_dir))
    target.set_tap_layers(default_tap_layers(target.num_layers, "eagle3"))
    torch.manual_seed(0)
    head = hydra.utils.instantiate(OmegaConf.merge(OmegaConf.load(EAGLE3), {"draft_vocab_size": 96, "ttt_steps": 2}, over),
                                   target=target, _convert_="all")
    head.prepare_from_data(torch.rand(target.vocab_size, generator=torch.Generator().manual_seed(0)))
    with torch.no_grad():
        for p in head.parameters():
            if p.requires_grad:
                p.normal_(0.0, 0.3 if p.ndim > 1 else 1.0)
    return target, head.eval()


def test_variants_round_trip_through_the_speculators_format(tiny_target_dir, tmp_path):
    """Export to speculators' layout (its flags and sliding-window layer config) and import back with the config as
    speculators writes it (no record of ours): same options, same weights, same logits."""
    from models.formats import export_draft, load_draft

    target, head = variant_head(tiny_target_dir, **VARIANTS, sliding_window=5)
    out = export_draft(head.export(tmp_path / "draft"), "speculators", tmp_path / "spec")
    raw = json.loads((out / "config.json").read_text())
    assert raw["norm_before_fc"] and raw["norm_before_residual"] and raw["norm_output"] and not raw["fc_norm"]
    assert raw["transformer_layer_config"]["layer_types"] == ["sliding_attention"]
    assert raw["transformer_layer_config"]["sliding_window"] == 5
    raw.pop("draftsmith")
    (out / "config.json").write_text(json.dumps(raw))
    back = load_draft(out, target).eval()
    for k, v in {**VARIANTS, "sliding_window": 5}.items():
        assert back.init_args[k] == v
    ids = torch.randint(0, 128, (1, 20), generator=torch.Generator().manual_seed(1))
    feats = target(ids)
    a = [head.logits_of(h) for h in head.unroll(ids, torch.ones_like(ids), feats, 2)]
    b = [back.logits_of(h) for h in back.unroll(ids, torch.ones_like(ids), feats, 2)]
    torch.testing.assert_close(torch.stack(b), torch.stack(a))


def test_sglang_export_refuses_the_variants_its_layer_lacks(tiny_target_dir, tmp_path):
    """SGLang's EAGLE-3 layer has none of speculators' variants: exporting one there would serve another function."""
    from models.formats import export_draft

    for over, fix in [({"norm_before_fc": True}, "false"), ({"norm_before_residual": True}, "false"),
                      ({"norm_output": True}, "false"), ({"sliding_window": 5}, "null")]:
        key = next(iter(over))
        _, head = variant_head(tiny_target_dir, **over)
        draft = head.export(tmp_path / f"draft-{key}")
        with pytest.raises(UserError, match=rf"^format=sglang cannot hold this eagle3 draft: .*{key}.*format=speculators "
                                            rf"\(vLLM\), or train it with draft\.{key}={fix} for SGLang$"):
            export_draft(draft, "sglang", tmp_path / "sgl")
        assert not (tmp_path / "sgl").exists()
    _, plain = variant_head(tiny_target_dir)
    assert (export_draft(plain.export(tmp_path / "plain"), "sglang", tmp_path / "sgl") / "config.json").is_file()


def test_per_tap_norms_are_refused_with_one_line(tiny_target_dir, tmp_path):
    from models.formats import export_draft, load_draft

    target, head = variant_head(tiny_target_dir)
    out = export_draft(head.export(tmp_path / "draft"), "speculators", tmp_path / "spec")
    raw = json.loads((out / "config.json").read_text())
    assert not raw["norm_before_fc"] and not raw["norm_output"] and "layer_types" not in raw["transformer_layer_config"]
    raw["fc_norm"] = True
    (out / "config.json").write_text(json.dumps(raw))
    with pytest.raises(UserError, match="fc_norm"):
        load_draft(out, target)


def test_prenorm_state_through_the_final_norm_is_the_cached_state(tiny_target_dir):
    from eval.peer import prenorm_last
    from models.target import FrozenTarget

    target = FrozenTarget(str(tiny_target_dir), tap_layers=[0, 1, 2])
    ids = torch.randint(0, 128, (17,))
    pre = prenorm_last(target, ids)
    last = target(ids[None]).last_state[0]
    torch.testing.assert_close(target.model.model.norm(pre), last)
    assert not torch.allclose(pre, last, atol=1e-3)  # it is not the normed state itself
    batch = torch.stack([ids, torch.cat([ids[:11], torch.zeros(6, dtype=torch.long)])])  # the second right-padded
    mask = torch.ones_like(batch)
    mask[1, 11:] = 0
    both = prenorm_last(target, batch, mask)  # [2, 17, d]
    torch.testing.assert_close(both[0], pre, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(both[1, :11], pre[:11], atol=1e-5, rtol=1e-5)


def side_or_skip():
    from eval.check_export import side_python

    try:
        return side_python()
    except UserError as e:
        pytest.skip(str(e))


def train_with_speculators(tmp_path: Path, tiny_target_dir: Path, tiny_chats, family: str,
                           matched: dict | None = None) -> tuple[Path, dict]:
    """A tiny feature cache in speculators' layout and 3 steps of speculators' own trainer (``family``'s settings of
    conf/peer_family, ``matched`` values replaced, its other defaults) on the CPU through eval/peer_side.py → (the
    checkpoint, its config)."""
    from conftest import compose_train, train_overrides

    from data.errors import instantiate
    from data.features import write_features
    from eval.peer import convert_cache, run_side as peer_side, speculators_argv
    from models.target import FrozenTarget

    cfg = compose_train(train_overrides(tiny_target_dir, tiny_chats, tmp_path / "run"))
    target = FrozenTarget(str(tiny_target_dir), tap_layers=[0, 1, 2], dtype="float32")
    dm = instantiate(cfg.data, tokenizer=str(tiny_target_dir))
    for split in ("train", "heldout"):
        write_features(target, dm.split(split), tmp_path / "features" / split, dtype="float32")
    info = convert_cache(tmp_path / "features", target, 64, tmp_path / "data")
    assert info["prenorm_check_max_abs"] < 1e-4
    pc = peer_cfg(family, tap_layers="[0,1,2]", draft_vocab_size=64, steps=3, batch_size=2, max_length=64)
    for key, value in (matched or {}).items():
        pc.peer_family.matched[key][1] = value
    save = tmp_path / "spec"
    save.mkdir()
    argv = speculators_argv(pc, tmp_path / "data", save, str(tiny_target_dir), info["rows"], info["train_rows"])
    peer_side({"kind": "train", "save_path": str(save), "argv": argv}, save)
    stats = json.loads((save / "peer_train.json").read_text())
    assert stats["steps"] == 3 and stats["tokens"] > 0
    shutil.rmtree(tmp_path / "data", ignore_errors=True)
    ckpt = Path(stats["checkpoint"])
    return ckpt, json.loads((ckpt / "config.json").read_text())


def fp32_copy(ckpt: Path, raw: dict, out: Path) -> Path:
    """The checkpoint in fp32 (bf16 → fp32 is exact) with config ``raw``."""
    from safetensors.torch import load_file, save_file

    out.mkdir()
    save_file({k: v.float() if v.is_floating_point() else v for k, v in load_file(str(ckpt / "model.safetensors")).items()},
              str(out / "model.safetensors"))
    raw["dtype"] = raw["transformer_layer_config"]["dtype"] = "float32"
    (out / "config.json").write_text(json.dumps(raw))
    return out


def same_logits_as_speculators(head, target, draft: Path, tmp_path: Path, tiny_target_dir: Path, anchors=None) -> None:
    from eval.check_export import compare, make_case, run_side

    ids = torch.randint(3, 128, (1, 40), generator=torch.Generator().manual_seed(0))
    work = tmp_path / "side"
    work.mkdir()
    case, ours, _ = make_case("trained", head, target, draft, "speculators", ids, anchors, work, str(tiny_target_dir))
    got = compare(ours, run_side([case], work)["trained"][0])
    assert got["max_abs_diff"] < 1e-4 and got["top1_agreement"] == 1.0, got


@pytest.mark.slow
def test_speculators_trained_head_imports_faithfully(tmp_path, tiny_target_dir, tiny_chats):
    """A head of speculators' own EAGLE-3 trainer with its defaults (norm before fc, before the residual, normed
    outputs, a sliding-window layer) through models.formats.load_draft: its TTT logits equal speculators' forward
    (window shrunk to 8 so that it binds on the 40-token text)."""
    side_or_skip()
    from models.formats import load_draft
    from models.target import FrozenTarget

    ckpt, raw = train_with_speculators(tmp_path, tiny_target_dir, tiny_chats, "eagle3")
    assert raw["norm_before_fc"] and raw["norm_output"] and raw["transformer_layer_config"]["layer_types"] == ["sliding_attention"]
    raw["transformer_layer_config"]["sliding_window"] = 8
    draft = fp32_copy(ckpt, raw, tmp_path / "draft")
    target = FrozenTarget(str(tiny_target_dir), tap_layers=[0, 1, 2], dtype="float32")
    head = load_draft(draft, FrozenTarget(str(tiny_target_dir), dtype="float32")).eval()
    assert head.init_args["sliding_window"] == 8 and head.tap_layers == [0, 1, 2]
    same_logits_as_speculators(head, target, draft, tmp_path, tiny_target_dir)


BLOCK_PEERS = {"dspark": {"draft.block_size": 4, "draft.markov_rank": 32}, "dflash": {"draft.block_size": 4}}


@pytest.mark.slow
@pytest.mark.parametrize("family", sorted(BLOCK_PEERS))
def test_speculators_trained_block_head_imports_faithfully(family, tmp_path, tiny_target_dir, tiny_chats):
    """A block head of speculators' own trainer (eval.peer's settings of the family; block 4, and for DSpark Markov rank
    32, on the tiny target) through models.formats.load_draft: its block logits (and DSpark's confidence logits) equal
    speculators' forward."""
    side_or_skip()
    from eval.check_export import default_anchors
    from models.formats import load_draft
    from models.target import FrozenTarget

    ckpt, raw = train_with_speculators(tmp_path, tiny_target_dir, tiny_chats, family, BLOCK_PEERS[family])
    assert raw["block_size"] == 4 and raw["sample_from_anchor"]
    assert raw["transformer_layer_config"]["layer_types"] == ["full_attention"] * 2  # matched: full attention
    target = FrozenTarget(str(tiny_target_dir), tap_layers=[0, 1, 2], dtype="float32")
    draft = fp32_copy(ckpt, raw, tmp_path / "draft")
    # its frozen lm_head is saved as the target's draft-vocabulary rows rounded to bf16; ours reads the target's own rows:
    # the copy gets them exact, so both sides compute with the same weights
    from safetensors.torch import load_file, save_file

    state = load_file(str(draft / "model.safetensors"))
    rows = torch.arange(state["d2t"].numel()) + state["d2t"].long()
    assert (state["lm_head.weight"] - target.lm_head().weight[rows]).abs().max() < 1e-2
    state["lm_head.weight"] = target.lm_head().weight[rows].detach().clone()
    save_file(state, str(draft / "model.safetensors"))
    head = load_draft(draft, FrozenTarget(str(tiny_target_dir), dtype="float32")).eval()
    assert head.family == family and head.block_size == 4 and head.tap_layers == [0, 1, 2] and head.first_slot == 0
    same_logits_as_speculators(head, target, draft, tmp_path, tiny_target_dir, default_anchors(40, 4, 8))


def peer_cfg(family: str = "eagle3", **over):
    """conf/peer.yaml composed with a family and overrides."""
    from hydra import compose, initialize_config_dir

    from conftest import ROOT

    with initialize_config_dir(str(ROOT / "conf"), version_base="1.3"):
        return compose("peer", overrides=[f"peer_family={family}", *(f"{k}={v}" for k, v in over.items())])


def flags(argv: list[str]) -> dict[str, str]:
    return {k: argv[i + 1] for i, k in enumerate(argv) if k.startswith("--") and i + 1 < len(argv)}


def test_speculators_arguments_match_the_recipe(tmp_path):
    """Taps as hidden_states indices, the split at exactly the training rows, the packed row of batch × length tokens."""
    from eval.peer import speculators_argv

    cfg = peer_cfg(steps=100)
    for rows, train in [(860, 835), (35, 28), (7, 6)]:
        argv = speculators_argv(cfg, tmp_path, tmp_path / "s", "verifier", rows, train)
        arg = flags(argv)
        assert int(rows * float(arg["--train-data-ratio"])) == train
    i = argv.index("--target-layer-ids")
    assert argv[i + 1: i + 4] == ["2", "4", "5"]
    assert arg["--total-seq-len"] == "3072" and arg["--max-steps"] == "100" and arg["--ttt-steps"] == "2"
    assert arg["--hidden-states-dtype"] == "float32" and arg["--draft-vocab-size"] == "2048"
    assert arg["--speculator-type"] == "eagle3" and arg["--num-layers"] == "1" and arg["--ttt-step-loss-decay"] == "0.8"


@pytest.mark.parametrize("family", sorted(p.stem for p in (Path(__file__).resolve().parent.parent / "conf" / "peer_family").glob("*.yaml")))
def test_each_family_trains_the_same_settings_on_both_sides(family, tmp_path):
    """Every matched value reaches draftsmith's trainer as its key and speculators' as its flag, once each; the
    draftsmith overrides compose into a training config of that family."""
    from conftest import ROOT
    from hydra import compose, initialize_config_dir

    from eval.peer import recipe, speculators_argv

    cfg = peer_cfg(family)
    ours = recipe(cfg) + list(cfg.peer_family.draftsmith)
    argv = speculators_argv(cfg, tmp_path, tmp_path / "s", "verifier", 10, 9)
    arg = flags(argv)
    assert arg["--speculator-type"] == family
    for key, (flag, value) in cfg.peer_family.matched.items():
        assert f"{key}={value}" in ours, key
        if isinstance(value, bool):  # a switch: --x or --no-x, no value
            on, off = flag, "--no-" + flag.removeprefix("--")
            assert (on if value else off) in argv and (off if value else on) not in argv, key
        else:
            assert arg[flag] == str(value), key
    with initialize_config_dir(str(ROOT / "conf"), version_base="1.3"):
        train = compose("train", overrides=ours)
    assert family in train.draft._target_.lower()
    for key, (_, value) in cfg.peer_family.matched.items():
        node = train
        for part in key.split("."):
            node = node[part]
        assert node == value, key


def test_a_rerun_with_other_settings_is_refused(tmp_path):
    """Stages are reused from out/: once a stage has written there, a rerun with other training settings, or other
    evaluation settings, is refused naming the keys and what to remove."""
    from eval.peer import check_settings

    check_settings(peer_cfg("dspark"), tmp_path)
    check_settings(peer_cfg(), tmp_path)  # no stage has written anything yet: the new settings replace the old
    (tmp_path / "features").mkdir()  # the first stage's output
    check_settings(peer_cfg(), tmp_path)  # the same settings: fine
    with pytest.raises(UserError, match=r"other limit; remove .*eval to redo"):
        check_settings(peer_cfg(limit=3), tmp_path)
    with pytest.raises(UserError, match=r"other k, peer_family; remove .* or give another name="):
        check_settings(peer_cfg("dspark"), tmp_path)


def test_bad_settings_give_one_line(tmp_path):
    import subprocess
    import sys

    root = Path(__file__).resolve().parent.parent
    for over, field in [("precision=16", "precision=16"), ("steps=0", "steps=0")]:
        r = subprocess.run([sys.executable, "-m", "eval.peer", over, f"out={tmp_path / 'peer'}"], cwd=root, capture_output=True,
                           text=True, timeout=300)
        assert r.returncode == 2 and r.stderr.strip().startswith(f"error: {field}"), r.stderr[-500:]
        assert len(r.stderr.strip().splitlines()) == 1


def test_the_report_becomes_a_results_page_measurement(tmp_path):
    """peer-page.json holds every field the results page requires and renders τ of both sides and their ratio."""
    from eval.peer import page
    from eval.results import load, section

    cfg = {"peer_family": {"label": "DSpark"}, "target": "embedded", "out": "runs/peer/dspark", "limit": 10, "k": 8,
           "max_new_tokens": 128}
    trainer = {"steps": 200, "train_tokens": 1000, "tokens_per_s": 300.0, "peak_memory_bytes": 2**30, "memory_kind": "cpu"}
    report = {"date": "2026-12-07", "machine": "a CPU", "command": "python -m eval.peer peer_family=dspark", "config": cfg,
              "convert": {"train_rows": 9, "draft_vocab_size": 64, "argmax_outside_draft_vocab": 0.05},
              "trainers": {"draftsmith": {**trainer, "batch_fill": 0.8},
                           "speculators": {**trainer, "tokens_per_s": 150.0, "batch_fill": 0.95}},
              "eval": {"results": {"mtbench": {"T=0": {"draftsmith": {"tau": 2.2}, "speculators": {"tau": 2.0}}}}}}
    m = page(report, "alone")
    (tmp_path / "m.json").write_text(json.dumps(m))
    (m,) = load(tmp_path)
    text = "\n".join(section(m))
    assert m["title"].startswith("DSpark: ") and "| MT-Bench | 0 | 2.20 | 2.00 | 1.10× |" in text and "(2.00×)" in text
    assert "80.0% of the positions of draftsmith's padded batches and 95.0% of speculators' packed rows" in text
