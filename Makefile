# The two commands of the README. Each sets up .venv (Python 3.12) on a fresh machine.
PYTHON ?= $(shell command -v python3.12 2>/dev/null || ls /root/.pyenv/versions/3.12*/bin/python3.12 2>/dev/null | head -n 1)
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

demo: $(VENV)/.installed
	OMP_NUM_THREADS=1 PYTHONWARNINGS=ignore $(VENV)/bin/torchrun --standalone --nproc-per-node $(NPROC) -m megatron_longstraw.demo

test: $(VENV)/.installed
	$(PY) -m pytest -q -p no:warnings tests

clean:
	rm -rf $(VENV) runs .pytest_cache
