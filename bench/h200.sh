#!/bin/bash
# The H200 runs (device tool), from the repository root, carrying .gpu-vllm, .whl (the peer) and
# .whl-sync (xxhash, prometheus-client):
#   bash bench/h200.sh tests        every gpu-marked test and the engine numerics study, three parallel streams (~9 min)
#   bash bench/h200.sh bench        the kernel tests alone, kernel benchmarks, then the end-to-end vLLM decode benchmark (~9 min)
#   bash bench/h200.sh bench-sync   the sync benchmark and the 1.7B end-to-end shape
# Every step logs to $OUT/STEP.log as it runs, has its own timeout and appends "STEP rc=N" to
# $OUT/steps.txt, so a run cut short keeps what finished. Device line: $OUT/device.txt.
set -u
: "${OUT:?set OUT to the results folder}"
bash .gpu-vllm/install.sh > "$OUT/install.log" 2>&1 || { tail "$OUT/install.log"; exit 1; }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site \
    .whl/*.whl .whl-sync/*.whl >> "$OUT/install.log" 2>&1
export PYTHONPATH=/tmp/site:$PWD VLLM_USE_FLASHINFER_SAMPLER=0 VLLM_NO_USAGE_STATS=1 HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  python3 -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__)"
} > "$OUT/device.txt" 2>&1

KERNEL_TESTS="tests/test_gpu_kernels.py tests/test_ops.py tests/test_reference.py tests/test_converters.py tests/test_push.py"
step() {   # step NAME SECONDS COMMAND...
    local name=$1 limit=$2; shift 2
    timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
    echo "$name rc=$? $(date +%T)" >> "$OUT/steps.txt"
}

case ${1:-} in
tests)
    step vllm 560 python3 -m pytest -q -s -m gpu tests/test_gpu_vllm.py &
    { step sync 200 python3 -m pytest -q -s -m gpu tests/test_gpu_sync.py
      step kernels 340 python3 -m pytest -q -rA --durations=15 -m gpu $KERNEL_TESTS; } &
    { step updates 360 python3 -m pytest -q -s -m gpu tests/test_gpu_vllm_updates.py
      step numerics 200 python3 bench/engine_numerics.py all --out "$OUT/engine" --seqs 4 --len 128; } &
    wait ;;
bench)
    step kernels 150 python3 -m pytest -q -rA --durations=15 -m gpu $KERNEL_TESTS
    step bench_kernels 250 python3 bench/bench_kernels.py --quick --no-sweep --json "$OUT/bench_kernels.json"
    step bench_e2e 320 python3 bench/bench_vllm_e2e.py --shapes qwen3-8b:12,qwen3-30b-a3b:4 \
        --out "$OUT/bench_vllm_e2e.json" ;;
bench-sync)
    step bench_sync 200 python3 bench/bench_sync.py --layers 4 --out "$OUT/bench_sync.json"
    step bench_e2e 330 python3 bench/bench_vllm_e2e.py --shapes qwen3-1.7b:28 --out "$OUT/bench_vllm_e2e_1.7b.json" ;;
*)
    echo "usage: bash bench/h200.sh tests|bench|bench-sync" >&2; exit 2 ;;
esac
