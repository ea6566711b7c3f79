# The two commands of the README. Each sets up .venv (Python 3.12) on a fresh machine.
# The first Python 3.12 that actually runs (a pyenv shim can exist without a selected 3.12).
PYTHON ?= $(shell for p in python3.12 $(HOME)/.pyenv/versions/3.12*/bin/python3.12 /usr/local/bin/python3.12 /usr/bin/python3.12; do \
	$$p -c 'import sys; assert sys.version_info[:2] == (3, 12)' >/dev/null 2>&1 && { command -v $$p || echo $$p; } && break; done)
VENV := .venv
PY := $(VENV)/bin/python
export TORCHDYNAMO_DISABLE := 1

.PHONY: demo demo-glm52 demo-qwen36 demo-deepseekv3 demo-rl demo-agent test test-under-load bench gradient-bias \
	refresh-pins clean

# Every package comes at the version in constraints.txt (tested together), so a fresh machine gets
# what the last green run had. `make refresh-pins` moves the pins forward.
CONSTRAINTS := constraints.txt
EXTRAS := test,bench

$(VENV)/.installed: setup.py $(CONSTRAINTS)
	@test -n "$(PYTHON)" || { echo "python3.12 not found: install Python 3.12 (megatron-core 0.19 requires it)"; exit 1; }
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q -c $(CONSTRAINTS) --upgrade pip
	$(PY) -m pip install -q -c $(CONSTRAINTS) -e '.[$(EXTRAS)]'
	touch $@

# make demo [MODEL=glm52|qwen36|deepseekv3] [NPROC=4] [PROMPT_LEN=32768] [RESPONSE_LEN=16384 [RESPONSE_BLOCK=4096]]
MODEL ?= glm52
NPROC ?= 4
PROMPT_LEN ?= 32768
# Long responses: every member's synthetic response up to RESPONSE_LEN tokens (the longest
# accepted raised to it), scored and replayed in blocks of RESPONSE_BLOCK (step/replay.py).
# Unset (the default), the demo runs exactly as before: the tiny configs' responses.
RESPONSE_LEN ?=
RESPONSE_BLOCK ?= 4096
ifneq ($(RESPONSE_LEN),)
RESPONSE_ARGS := --longstraw-synthetic-response-len $(RESPONSE_LEN) \
	--longstraw-max-response-len $(RESPONSE_LEN) --longstraw-response-block $(RESPONSE_BLOCK)
endif
MODELS := glm52 qwen36 deepseekv3
ifeq ($(filter $(MODEL),$(MODELS)),)
$(error MODEL=$(MODEL): choose one of $(MODELS))
endif

# One LongStraw GRPO step (G = 4) through the Megatron-style launcher, NPROC processes, CP = NPROC.
LAUNCH = OMP_NUM_THREADS=1 PYTHONWARNINGS=ignore $(VENV)/bin/torchrun --standalone \
	--nproc-per-node $(NPROC) examples/pretrain_gpt.py --longstraw --context-parallel-size $(NPROC) \
	--train-iters 1 --lr 1e-4 --clip-grad 1.0 --seed 1234 --longstraw-group-size 4 $(RESPONSE_ARGS)

demo: demo-$(MODEL)

# Tiny GLM-5.2 (MLA + DSA + MoE), CP = EP = NPROC (experts folded on the CP ranks).
demo-glm52: $(VENV)/.installed
	$(LAUNCH) --longstraw-config examples/glm52/tiny.yaml --expert-model-parallel-size $(NPROC) \
		--longstraw-synthetic-prompt-len $(PROMPT_LEN) --longstraw-run-name demo

# Tiny DeepSeek-V3 (MLA with dense attention over the latents + group-limited MoE, YaRN), CP = EP = NPROC.
demo-deepseekv3: $(VENV)/.installed
	$(LAUNCH) --longstraw-family deepseekv3 --longstraw-config examples/deepseekv3/tiny.yaml \
		--expert-model-parallel-size $(NPROC) --longstraw-synthetic-prompt-len $(PROMPT_LEN) \
		--longstraw-run-name demo-deepseekv3

# Tiny Qwen3.6 (Gated DeltaNet + gated attention, dense FFN), CP = NPROC, EP = 1: one step at
# PROMPT_LEN / 2 and one at PROMPT_LEN, then their receipts side by side: the GDN state and conv
# tail keep their bytes as P doubles, the K/V pages double (the command fails if the state grew).
demo-qwen36: $(VENV)/.installed
	$(LAUNCH) --longstraw-family qwen36 --longstraw-config examples/qwen36/tiny.yaml \
		--longstraw-synthetic-prompt-len $(shell expr $(PROMPT_LEN) / 2) \
		--longstraw-run-name demo-qwen36-half
	$(LAUNCH) --longstraw-family qwen36 --longstraw-config examples/qwen36/tiny.yaml \
		--longstraw-synthetic-prompt-len $(PROMPT_LEN) --longstraw-run-name demo-qwen36
	$(PY) tools/compare_receipts.py runs/demo-qwen36-half runs/demo-qwen36 \
		--expect-constant gdn_state conv_tail

# A run that learns, with a control (tools/demo_rl.py, docs/benchmarks.md "A run that learns"): online GRPO on
# the majority marker task at P = 1024, G = 16, tiny Qwen3.6 with a 64-token vocabulary, the recipe
# the sweep chose (docs/demo_rl_sweep.md); 3 seeds, each a run and its control (prompt state
# zeroed), two processes at a time. Receipt and PNG in runs/demo-rl/; exit 1 unless every run
# learns and no control does.
demo-rl: $(VENV)/.installed
	$(PY) tools/demo_rl.py --out runs/demo-rl

# An agent that learns to use a tool, with a control that cannot (tools/demo_rl.py --task tool,
# docs/benchmarks.md "An agent that learns to use a tool"): two turns through the launcher with
# example_env's lookup tool, which alone holds each prompt's answer; the control is
# --longstraw-control blind (the tool is called, its observation never fed). 3 seeds x (run,
# control), 60 steps, two processes at a time; runs/demo-agent/; exit 1 unless every run learns.
demo-agent: $(VENV)/.installed
	$(PY) tools/demo_rl.py --task tool --steps 60 --out runs/demo-agent

# One pytest process: two pytest-xdist workers were slower, not faster (CI 3,828 s against about
# 2,550 s serial for the same tests): many tests run two to four processes of their own.
test: $(VENV)/.installed
	$(PY) -m pytest -q -p no:warnings --durations=25 tests

# For developers, before a change to the multi-process tests lands: those tests (torchrun,
# signals, the parent watch) REPEAT times in a row with every core busy with other work
# (tools/under_load.py; docs/usage.md "Testing under load"). LOAD_TESTS=tests runs the suite.
LOAD_TESTS ?= tests/test_online.py::test_online_under_cp2_ep2_equals_one_process \
	tests/test_operations.py::test_sigterm_saves_exits_0_and_the_resume_matches_an_uninterrupted_run \
	tests/test_operations_preemption.py tests/test_parent_watch.py
REPEAT ?= 5
test-under-load: $(VENV)/.installed
	$(PY) tools/under_load.py --repeat $(REPEAT) -- $(PY) -m pytest -q -p no:warnings $(LOAD_TESTS)

# The measured largest-P table (docs/benchmarks.md): LongStraw at P = 4K..128K and conventional GRPO
# until it passes a 2.5 GiB RSS cap, one process each, bench-size GLM-5.2 (examples/glm52/bench.yaml),
# plus capture against a no-grad forward at 4K and 32K (3 pairs each, median); runs/bench/bench-sweep.{md,json}.
# About an hour, one point at a time (LongStraw at 128K and conventional at 32K and 64K take most).
# Then the measured largest-R table (docs/benchmarks.md): P = 4096, G = 2, LongStraw blockwise
# (response_block 2048) and conventional at R = 2K..16K, each until its first point over a 1.25 GiB
# RSS cap, LongStraw's live bytes per phase from a second run with the meter; and blockwise
# (R / 4 per block) against whole-branch replay seconds at R = 4K and 8K (3 pairs each, median);
# runs/bench/bench-response.{md,json}. About 20 minutes (measured under load from other work on
# the 2 cores); --response-points ...,32768,65536 adds LongStraw at 32K and 64K (its step time
# about doubles per doubling of R, twice per point with the metered run): about 25 minutes more.
# The quick comparison (tiny GLM-5.2, largest P predicted, not measured): tools/bench.py --quick.
bench: $(VENV)/.installed
	$(PY) tools/bench.py --sweep --cap-gib 2.5 --timing-repeats 3
	$(PY) tools/bench.py --response-sweep --cap-gib 1.25 --timing-repeats 3
	$(PY) tools/bench.py --reuse-sweep
	OMP_NUM_THREADS=2 $(PY) tools/bench_prefill.py --out-dir runs/bench

# Detached vs exact prompt gradient (tiny GLM-5.2, one process): JSON, table, TensorBoard and a
# PNG in runs/gradient-bias/.
gradient-bias: $(VENV)/.installed
	OMP_NUM_THREADS=2 $(PY) tools/gradient_bias.py --family $(MODEL) --lora --out runs/gradient-bias

# A new .venv with the newest versions the registry serves (setup.py's ranges), constraints.txt
# rewritten from it, then the suite. Commit constraints.txt only if the suite passes.
refresh-pins:
	@test -n "$(PYTHON)" || { echo "python3.12 not found: install Python 3.12 (megatron-core 0.19 requires it)"; exit 1; }
	rm -rf $(VENV)
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[$(EXTRAS)]'
	{ echo "# Versions tested together (make test), written by 'make refresh-pins' on $$(date -u +%Y-%m-%d)."; \
	  echo "# Python $$($(PY) -c 'import platform; print(platform.python_version())'), torch CPU capability $$($(PY) -c 'import torch; print(torch.backends.cpu.get_cpu_capability())')."; \
	  $(PY) -m pip freeze --all --exclude-editable; } > $(CONSTRAINTS)
	touch $(VENV)/.installed
	$(PY) -m pytest -q -p no:warnings tests

clean:
	rm -rf $(VENV) runs .pytest_cache
