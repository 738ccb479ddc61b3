# Quickstart targets. Each sets up .venv on first use.
# A torch already in .venv is kept; otherwise TORCH_SPEC is installed from pip's configured index, which is the CPU
# build only where that index serves it. README (Setup) says what to run on plain PyPI or a GPU machine.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH_SPEC ?= torch==2.13.0

.PHONY: setup test test-slow demo clean

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e ".[test]"
	touch $@

# The tests also cover the integrations (ONNX, onnxruntime, Triton, Ray Serve, LitServe, LoRA via PEFT, the Redis
# state store), which are package extras.
$(VENV)/.extras: $(VENV)/.installed
	$(PY) -m pip install -q -e ".[test,onnx,triton,ray,litserve,lora,video,redis,quant,canny]"
	touch $@

setup: $(VENV)/.installed

test: $(VENV)/.extras
	$(PY) -m pytest

# The long end-to-end runs the default suite skips (tests marked slow, e.g. the 2,500-request HTTP fuzz); CI runs them.
test-slow: $(VENV)/.extras
	$(PY) -m pytest -m slow

demo: $(VENV)/.installed
	$(VENV)/bin/stepserve demo

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache
