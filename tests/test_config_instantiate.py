"""Config files are instantiated, not only composed: loggers (offline), the ``hf`` target on a tiny local model,
the prompt sets on tiny files, every draft and experiment on a tiny target, data, features and callbacks."""
from __future__ import annotations

import json

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from conftest import ROOT, write_tiny_chats, write_tiny_target
from data.errors import instantiate
from models.target import FrozenTarget, default_tap_layers

CONF = ROOT / "conf"


def composed(name: str, overrides: list[str], run_dir) -> OmegaConf:
    from hydra.core.global_hydra import GlobalHydra

    GlobalHydra.instance().clear()  # a failed in-process Hydra run elsewhere may leave it initialised
    with initialize_config_dir(str(CONF), version_base="1.3"):
        cfg = compose(name, overrides=overrides)
    OmegaConf.set_struct(cfg, False)
    cfg.run_dir = str(run_dir)  # ${hydra:runtime.output_dir} only resolves inside a Hydra run
    return cfg


@pytest.fixture(scope="module")
def tiny_target(tmp_path_factory):
    return write_tiny_target(tmp_path_factory.mktemp("cfg-target"), layers=6)


@pytest.mark.parametrize("option", sorted(p.stem for p in (CONF / "logger").glob("*.yaml")))
def test_loggers_instantiate_offline(option, tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("WANDB_SILENT", "true")
    logger = instantiate(composed("train", [f"logger={option}"], tmp_path).logger)
    logger.log_metrics({"x": 1.0}, step=0)
    logger.finalize("success")
    if option == "wandb":
        import wandb

        wandb.finish()


def test_hf_target_on_a_tiny_local_model(tiny_target, tmp_path):
    cfg = composed("train", ["target=hf", f"target.name_or_path={tiny_target}"], tmp_path)
    target = instantiate(cfg.target)
    assert target.num_layers == 6


@pytest.mark.parametrize("option", sorted(p.stem for p in (CONF / "eval_set").glob("*.yaml")))
def test_prompt_sets_instantiate(option, tmp_path):
    chats = write_tiny_chats(tmp_path / "chats.jsonl")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("\n".join(json.dumps({"prompt": f"Say {i}."}) for i in range(3)) + "\n")
    over = {"jsonl": [f"eval_set.jsonl.path={prompts}"], "sharegpt": [f"eval_set.sharegpt.source={chats}",
                                                                      "eval_set.sharegpt.heldout_fraction=0.5"]}
    cfg = composed("eval", [f"eval_set=[{option}]", *over.get(option, [])], tmp_path)
    pset = instantiate(cfg.eval_set[option])
    pset.limit = 2
    assert len(pset.conversations()) >= 1


@pytest.mark.parametrize("option", sorted(p.stem for p in (CONF / "draft").glob("*.yaml")))
def test_drafts_instantiate(option, tiny_target, tmp_path):
    cfg = composed("train", [f"draft={option}", f"target.name_or_path={tiny_target}"], tmp_path)
    check_draft(cfg, tiny_target)


@pytest.mark.parametrize("option", sorted(p.stem for p in (CONF / "experiment").glob("*.yaml")))
def test_experiments_instantiate(option, tiny_target, tmp_path):
    cfg = composed("train", [f"experiment={option}", f"target.name_or_path={tiny_target}"], tmp_path)
    check_draft(cfg, tiny_target)
    instantiate(cfg.data, tokenizer=str(tiny_target))
    for c in cfg.callbacks.values():
        instantiate(c)


def check_draft(cfg, target_dir) -> None:
    import hydra

    cls = hydra.utils.get_class(cfg.draft._target_)
    target = FrozenTarget(str(target_dir))
    target.set_tap_layers(default_tap_layers(target.num_layers, cls.tap_method))
    over = {"mask_token_id": 1} if "mask_token_id" in cfg.draft else {}
    head = instantiate(cfg.draft, target=target, **over)
    assert head.num_steps >= 1


@pytest.mark.parametrize("option", sorted(p.stem for p in (CONF / "features").glob("*.yaml")))
def test_data_and_features_instantiate(option, tiny_target, tmp_path):
    cfg = composed("train", [f"features={option}", f"target.name_or_path={tiny_target}"], tmp_path)
    dm = instantiate(cfg.data, tokenizer=str(tiny_target))
    assert dm.features == option


@pytest.mark.parametrize("option", ["gpu", "ddp", "fsdp"])
def test_gpu_trainer_configs_instantiate_on_cpu(option, tmp_path):
    """The GPU trainers' keys are all Trainer arguments: built here with the accelerator (and the FSDP strategy,
    which needs GPUs) swapped for the CPU, everything else as configured."""
    overrides = [f"trainer={option}", "trainer.accelerator=cpu", "trainer.devices=1", "trainer.precision=32"]
    cfg = composed("train", overrides + (["~trainer.strategy"] if option != "gpu" else []), tmp_path).trainer
    trainer = instantiate(cfg, logger=False, enable_checkpointing=False, default_root_dir=str(tmp_path))
    assert trainer.max_steps == cfg.max_steps and trainer.limit_val_batches == cfg.limit_val_batches


def test_llama1b_random_target_instantiates_at_a_tiny_size(tmp_path):
    cfg = composed("planner", ["target=llama1b_random", "target.hidden_size=32", "target.intermediate_size=64",
                               "target.num_hidden_layers=4", "target.num_attention_heads=4", "target.num_key_value_heads=2",
                               "target.vocab_size=128"], tmp_path).target
    target = instantiate(cfg)
    assert target.num_layers == 4 and target.identity()["name_or_path"] == "llama1b-random"


@pytest.mark.parametrize("option", ["draft_model", "micro"])
def test_experiment_target_configs_build_their_model(option, tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = composed("embedded_target", [f"experiment_target={option}"], tmp_path)
    model = LlamaForCausalLM(LlamaConfig(**OmegaConf.to_container(cfg.model, resolve=True), vocab_size=64))
    assert model.config.num_hidden_layers == cfg.model.num_hidden_layers
