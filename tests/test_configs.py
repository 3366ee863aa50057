"""Every primary config in conf/ composes, and every file of every group composes inside its primary config."""
from __future__ import annotations


import pytest
from hydra import compose, initialize_config_dir

from conftest import ROOT

CONF = ROOT / "conf"
PRIMARY = sorted(p.stem for p in CONF.glob("*.yaml"))

# group folder -> primary config that uses it
GROUP_HOME = {"target": "train", "data": "train", "draft": "train", "features": "train", "trainer": "train", "logger": "train",
              "callbacks": "train", "experiment": "train", "experiment_target": "embedded_target", "eval_set": "eval",
              "peer_family": "peer"}
GROUP_FILES = [(g, p.stem) for g in sorted(GROUP_HOME) for p in sorted((CONF / g).glob("*.yaml"))]


@pytest.mark.parametrize("name", PRIMARY)
def test_primary_config_composes(name):
    with initialize_config_dir(str(CONF), version_base="1.3"):
        cfg = compose(name)
    assert cfg


@pytest.mark.parametrize("group,option", GROUP_FILES)
def test_group_option_composes(group, option):
    with initialize_config_dir(str(CONF), version_base="1.3"):
        value = f"[{option}]" if group == "eval_set" else option  # eval_set is a list of sets
        cfg = compose(GROUP_HOME[group], overrides=[f"{group}={value}"])
    assert cfg


@pytest.mark.parametrize("option", sorted(p.stem for p in (CONF / "experiment").glob("*.yaml")))
def test_experiments_only_override(option):
    """An experiment file changes a few keys of the default run, not the whole config."""
    with initialize_config_dir(str(CONF), version_base="1.3"):
        base = compose("train")
        exp = compose("train", overrides=[f"experiment={option}"])
    assert exp.name != base.name and exp.draft._target_ and exp.trainer._target_


def test_every_group_is_known():
    groups = {p.name for p in CONF.iterdir() if p.is_dir()}
    assert groups <= set(GROUP_HOME), f"add new config groups to GROUP_HOME: {groups - set(GROUP_HOME)}"
