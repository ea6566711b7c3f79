# The two commands of the README. Each sets up .venv (Python 3.12) on a fresh machine.
# The first Python 3.12 that actually runs (a pyenv shim can exist without a selected 3.12).
PYTHON ?= $(shell for p in python3.12 $(HOME)/.pyenv/versions/3.12*/bin/python3.12 /usr/local/bin/python3.12 /usr/bin/python3.12; do \
	$$p -c 'import sys; assert sys.version_info[:2] == (3, 12)' >/dev/null 2>&1 && { command -v $$p || echo $$p; } && break; done)
VENV := .venv
PY := $(VENV)/bin/python
export TORCHDYNAMO_DISABLE := 1

.PHONY: demo test bench clean

$(VENV)/.installed: setup.py
	@test -n "$(PYTHON)" || { echo "python3.12 not found: install Python 3.12 (megatron-core 0.19 requires it)"; exit 1; }
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[test]'
	touch $@

NPROC ?= 4
PROMPT_LEN ?= 32768

# One LongStraw GRPO step of the tiny GLM-5.2, CP = EP = NPROC, through the Megatron-style launcher.
demo: $(VENV)/.installed
	OMP_NUM_THREADS=1 PYTHONWARNINGS=ignore $(VENV)/bin/torchrun --standalone --nproc-per-node $(NPROC) \
		examples/pretrain_gpt.py --longstraw --longstraw-config examples/glm52/tiny.yaml \
		--context-parallel-size $(NPROC) --expert-model-parallel-size $(NPROC) \
		--train-iters 1 --lr 1e-4 --clip-grad 1.0 --seed 1234 \
		--longstraw-synthetic-prompt-len $(PROMPT_LEN) --longstraw-group-size 4 \
		--longstraw-run-name demo

test: $(VENV)/.installed
	$(PY) -m pytest -q -p no:warnings tests

# LongStraw against conventional GRPO on CPU (tiny GLM-5.2): table, JSON and plot in runs/bench/.
bench: $(VENV)/.installed
	$(PY) tools/bench.py --quick

clean:
	rm -rf $(VENV) runs .pytest_cache
