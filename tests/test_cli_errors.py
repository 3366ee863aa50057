"""Bad input on the command line: one clear `error:` line naming the file/field, exit code 2, no traceback."""
from __future__ import annotations

import subprocess
import sys

import pytest

from conftest import ROOT


def run(*args, cwd=ROOT):
    return subprocess.run([sys.executable, "-m", *args], cwd=cwd, capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("args,expect", [
    (["data.prepare", "target.name_or_path=/nonexistent/model"], "/nonexistent/model"),
    (["data.prepare", "data.truncation=middle"], "truncation"),
    (["data.regenerate", "temperature=-1"], "temperature"),
    (["data.regenerate", "first_conversation=-1"], "first_conversation"),
    (["data.regenerate", "device=gpu0"], "device='gpu0'"),
    (["eval.agreement", "scales=[1.0,0]"], "scales"),
    (["eval.agreement", "scales=[a]"], "scales"),
    (["eval.agreement", "temperature=-1"], "temperature"),
    (["eval.agreement", "temperature=1", "k=0"], "k=0"),
    (["train.embedded_target", "ckpt_path=/nonexistent.ckpt", "experiment_target=micro", "run_dir=/tmp/ds-cli-test"], "ckpt_path"),
])
def test_one_line_errors(args, expect):
    r = run(*args)
    assert r.returncode == 2, r.stderr[-2000:]
    err = [l for l in r.stderr.splitlines() if l.startswith("error: ")]
    assert len(err) == 1 and "Traceback" not in r.stderr
    if expect:
        assert expect in err[0]


def test_bad_source_file(tmp_path):
    bad = tmp_path / "convs.json"
    bad.write_text("")
    # the embedded target's tokenizer loads; the empty conversation file is named
    r = run("data.regenerate", f"data.source={bad}", "target.name_or_path=embedded")
    if "embedded target missing" in r.stderr:
        pytest.skip("embedded target not built")
    assert r.returncode == 2 and str(bad) in r.stderr


@pytest.mark.parametrize("env", [{"HOME": "/sys/draftsmith-nohome"}, {"DRAFTSMITH_CACHE": "/sys/draftsmith-cache"}])
def test_unwritable_home_or_cache_is_one_line(tiny_target_dir, tiny_chats, tmp_path, env):
    """The conversation cache under an unwritable home (or $DRAFTSMITH_CACHE): one line naming the folder and
    the way out, not a traceback."""
    import os

    full = {k: v for k, v in os.environ.items() if k != "DRAFTSMITH_CACHE"} | env
    r = subprocess.run([sys.executable, "-m", "data.prepare", f"target.name_or_path={tiny_target_dir}",
                        f"data.source={tiny_chats}", f"hydra.run.dir={tmp_path}"], cwd=ROOT, env=full,
                       capture_output=True, text=True, timeout=300)
    err = [line for line in r.stderr.splitlines() if line.startswith("error: ")]
    assert r.returncode == 2 and len(err) == 1 and "Traceback" not in r.stderr, r.stderr[-2000:]
    assert "cache folder" in err[0] and "DRAFTSMITH_CACHE" in err[0]
