#!/bin/bash
# The H200 runs (device tool), from the repository root, carrying .gpu-vllm, .whl (the peer) and
# .whl-sync (xxhash, prometheus-client). Each argument is a stream of steps joined by "+", run in
# order; the streams run in parallel on the one GPU (engines use a fixed 1 GiB KV cache each):
#   bash bench/h200.sh vllm updates+numerics sync+bench_sync   engine tests, numerics study, sync (~8 min)
#   bash bench/h200.sh kernels+bench_kernels+bench_e2e   kernel tests alone, then the benchmarks (~10 min)
#   bash bench/h200.sh bench_sync+bench_e2e_1.7b
# Benchmarks belong in a stream of their own with nothing beside it (ratios are side by side, but
# a loaded GPU moves them). Every step logs to $OUT/STEP.log as it runs, has its own timeout and
# appends "STEP rc=N" to $OUT/steps.txt, so a run cut short keeps what finished. Device: $OUT/device.txt.
# The install takes ~10 s: a step's limit (at most 575 s) plus it stays under a device call's 600 s, so the
# step's own timeout fires and writes its line before the call is cut.
set -u
: "${OUT:?set OUT to the results folder}"
[ $# -gt 0 ] || { sed -n 2,13p "$0" >&2; exit 2; }
# vLLM from the harness. Its last step copies the top-level folders that an old pyproject listed; with
# the nvfp4_sampler mapping it cannot, so it runs from a root holding only the harness and a stub
# pyproject, and pip installs this checkout as the package it is (its entry points included).
mkdir -p /tmp/gpu-root && ln -sfn "$PWD/.gpu-vllm" /tmp/gpu-root/.gpu-vllm
printf '[project]\nname = "gpu-vllm-harness"\nversion = "0"\n' > /tmp/gpu-root/pyproject.toml
{ bash /tmp/gpu-root/.gpu-vllm/install.sh &&
  python3 -m pip install -q --no-deps --no-build-isolation --no-index --upgrade --target /tmp/site .
} > "$OUT/install.log" 2>&1 || { tail "$OUT/install.log"; exit 1; }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site \
    .whl/*.whl .whl-sync/*.whl >> "$OUT/install.log" 2>&1
# pytest puts the repository root on sys.path itself (tests/ is a package); nvfp4_sampler resolves there
# to this checkout's folders, and vLLM finds the plugin through /tmp/site's dist-info.
export PYTHONPATH=/tmp/site VLLM_USE_FLASHINFER_SAMPLER=0 VLLM_NO_USAGE_STATS=1 HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  python3 -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__)"
} > "$OUT/device.txt" 2>&1

step() {   # step NAME: its timeout (s) and command
    local limit cmd IFS=$' \t\n'
    case $1 in
    kernels)   limit=260; cmd="python3 -m pytest -q -rA --durations=15 -m gpu tests/test_gpu_kernels.py tests/test_ops.py
                              tests/test_reference.py tests/test_converters.py tests/test_push.py tests/test_diagnostics_operators.py" ;;
    # the layer core's load-time warm-up: after it, forwards at other token counts compile no Triton kernel
    warm_up)   limit=300; cmd="python3 -m pytest -q -rA -m gpu tests/test_warm_up.py" ;;
    # the Triton split-K launches (GEMV, MoE) alone, with and without the device's tickets
    split_k)   limit=200; cmd="python3 -m pytest -q -rA -m gpu tests/test_gpu_kernels.py::test_split_k_launches_count_in_the_device_tickets
                              tests/test_gpu_kernels.py::test_gemv_matches_reference tests/test_gpu_kernels.py::test_moe_matches_reference
                              tests/test_gpu_kernels.py::test_moe_is_bitwise_deterministic" ;;
    # 300 s: on a fresh machine NVRTC compiles every variant first (H200, fourteenth session: 142 tests passed,
    # then the 150 s limit cut the summary)
    mma)       limit=300; cmd="python3 -m pytest -q -rA -m gpu tests/test_gpu_mma.py" ;;
    mma_wgmma) limit=300; cmd="env NVFP4_SAMPLER_MMA=wgmma python3 -m pytest -q -rA -m gpu tests/test_gpu_mma.py" ;;
    # every launch with the split-K through clusters pulled by its owners (the default pushes where it fits), in a
    # step of its own: a fault there (a sticky CUDA error) leaves the others' results whole
    mma_cluster) limit=300; cmd="env NVFP4_SAMPLER_SPLIT_K=cluster python3 -m pytest -q -rA -m gpu
                              tests/test_gpu_mma_cluster.py tests/test_gpu_mma.py" ;;
    # the dense linears on the activation's exact FP16 rows (the default stages its codes and block scales)
    mma_rows) limit=420; cmd="env NVFP4_SAMPLER_X_CODES=0 python3 -m pytest -q -rA -m gpu tests/test_gpu_mma.py
                              tests/test_gpu_kernels.py" ;;
    mma_persist) limit=420; cmd="env NVFP4_SAMPLER_PERSIST=1 NVFP4_SAMPLER_PREFETCH=1 python3 -m pytest -q -rA -m gpu
                              tests/test_gpu_mma_persist.py tests/test_gpu_mma.py" ;;
    bench_linear) limit=540; cmd="python3 bench/bench_kernels.py --quick --no-sweep --only linear --json $OUT/bench_linear.json" ;;
    bench_sync_vllm) limit=480; cmd="python3 bench/bench_sync_vllm.py --layers 8 --out $OUT/bench_sync_vllm.json" ;;
    bench_sync_vllm_24) limit=575; cmd="python3 bench/bench_sync_vllm.py --layers 24 --repeats 2
                              --out $OUT/bench_sync_vllm_24.json" ;;   # fits an 80 GB GPU
    # the whole model: the BF16 engine's process holds it twice (~123 GB): an H200 only (needs_h200)
    # a multi-GPU kind: the weight group over NCCL (tests), then trainer on GPU 0 and one tensor-parallel
    # engine's ranks on GPUs 1..: broadcast vs per-rank
    broadcast_nccl) limit=300; cmd="python3 -m pytest -q -rA -m gpu tests/test_broadcast.py" ;;
    sync_nccl) limit=575; cmd="python3 bench/bench_sync_nccl.py --tp 1 --layers 48 --out $OUT/sync_nccl_tp1.json" ;;
    sync_nccl_tp2) limit=575; cmd="python3 bench/bench_sync_nccl.py --tp 2 --layers 48 --out $OUT/sync_nccl_tp2.json" ;;
    # the same on an 80 GB GPU: the trainer's 48 BF16 layers alias 12 layers' storage (each update reads all 48)
    bench_sync_vllm_48) limit=575; cmd="python3 bench/bench_sync_vllm.py --layers 48 --repeats 2 --distinct-layers 12
                              --out $OUT/bench_sync_vllm_48.json" ;;
    bench_sync_vllm_whole) limit=575; cmd="python3 bench/bench_sync_vllm.py --layers 48 --repeats 2
                              --out $OUT/bench_sync_vllm_whole.json" ;;
    diagnose)  limit=480; cmd="python3 bench/diagnose_h200.py --out $OUT/diagnose" ;;
    # the learner on the CPU did not finish the default run in 300 s (H100 sixteenth) nor in ~500 s with half the
    # tokens (seventeenth, 590 s + the install cut the 600 s call); it runs on the GPU now. 540 s: the call's 600 s
    diagnose_8b) limit=540; cmd="python3 bench/diagnose_h200.py --shapes qwen3-8b:4 --out $OUT/diagnose" ;;
    compiled_gap) limit=420; cmd="python3 bench/compiled_gap.py --out $OUT/compiled_gap.json" ;;
    bench_e2e_8b_full) limit=560; cmd="python3 bench/bench_vllm_e2e.py --shapes qwen3-8b:36 --out $OUT/bench_vllm_e2e_8b_full.json" ;;
    bench_linear_8b) limit=540; cmd="python3 bench/bench_kernels.py --quick --no-sweep --only linear --json
                              $OUT/bench_linear_8b.json --shapes 8B_qkv,8B_o,8B_gate_up,8B_down" ;;
    bench_decode_8b) limit=540; cmd="python3 bench/bench_kernels.py --quick --no-sweep --only linear --ms 1,16,32,64
                              --json $OUT/bench_decode_8b.json --shapes 8B_qkv,8B_o,8B_gate_up,8B_down" ;;   # decode sizes
    bench_prefill_8b) limit=300; cmd="python3 bench/bench_kernels.py --quick --no-sweep --only linear --ms 4096
                              --json $OUT/bench_prefill_8b.json --shapes 8B_qkv,8B_o,8B_gate_up,8B_down" ;;   # bf16 blocks
    bench_decode_1.7b) limit=420; cmd="python3 bench/bench_kernels.py --quick --no-sweep --only linear --ms 1,16,64
                              --json $OUT/bench_decode_1.7b.json --shapes 1.7B_qkv,1.7B_o,1.7B_gate_up,1.7B_down" ;;
    bench_linear_small) limit=330; cmd="python3 bench/bench_kernels.py --quick --no-sweep --only linear --json
                              $OUT/bench_linear_small.json --shapes 1.7B_qkv,1.7B_o,1.7B_gate_up,1.7B_down,8B_gate_up" ;;
    vllm)      limit=480; cmd="python3 -m pytest -q -s -m gpu tests/test_gpu_vllm.py" ;;
    updates)   limit=300; cmd="python3 -m pytest -q -s -m gpu tests/test_gpu_vllm_updates.py" ;;
    strict)    limit=300; cmd="python3 -m pytest -q -s -rA -m gpu tests/test_gpu_vllm_strict.py" ;;
    strict_wgmma) limit=300; cmd="env NVFP4_SAMPLER_MMA=wgmma python3 -m pytest -q -s -rA -m gpu
                              tests/test_gpu_vllm_strict.py" ;;
    sync)      limit=120; cmd="python3 -m pytest -q -s -m gpu tests/test_gpu_sync.py" ;;
    numerics)  limit=150; cmd="python3 bench/engine_numerics.py all --out /tmp/engine --seqs 4 --len 128" ;;
    bench_quant) limit=200; cmd="python3 bench/bench_kernels.py --quick --no-sweep --only act,weight --json $OUT/bench_quant.json" ;;
    bench_moe) limit=420; cmd="python3 bench/bench_kernels.py --quick --no-sweep --only moe --json $OUT/bench_moe.json" ;;
    bench_kernels) limit=250; cmd="python3 bench/bench_kernels.py --quick --no-sweep --json $OUT/bench_kernels.json" ;;
    bench_e2e) limit=575; cmd="python3 bench/bench_vllm_e2e.py --shapes qwen3-30b-a3b:4,qwen3-8b:12
                              --out $OUT/bench_vllm_e2e.json" ;;   # 330 s cut it inside the MoE shape (start-ups ~80 s)
    bench_e2e_moe) limit=420; cmd="python3 bench/bench_vllm_e2e.py --shapes qwen3-30b-a3b:4
                              --out $OUT/bench_vllm_e2e_moe.json" ;;
    bench_e2e_moe_16) limit=560; cmd="python3 bench/bench_vllm_e2e.py --shapes qwen3-30b-a3b:16 --profiled 1,16,64
                              --out $OUT/bench_vllm_e2e_moe_16.json" ;;   # GPU-bound (4 layers are host-bound), 20 GB on disk
    # the same, batch 1 profiled only (a short call: the tokens/s table, the JIT count, the warm-up seconds)
    bench_e2e_moe_16_b1) limit=420; cmd="python3 bench/bench_vllm_e2e.py --shapes qwen3-30b-a3b:16 --profiled 1
                              --out $OUT/bench_vllm_e2e_moe_16.json" ;;
    # the MoE's tensor-core grouped launches from 1 token (NVFP4_SAMPLER_PAIRED_MAX_PAIRS=0) beside the per-pair GEMVs
    bench_e2e_moe_mma) limit=575; cmd="python3 bench/bench_vllm_e2e.py --shapes qwen3-30b-a3b:16 --moe-mma --profiled 1
                              --out $OUT/bench_vllm_e2e_moe_mma.json" ;;
    bench_e2e_8b) limit=420; cmd="python3 bench/bench_vllm_e2e.py --shapes qwen3-8b:12 --out $OUT/bench_vllm_e2e_8b.json" ;;
    bench_e2e_wgmma) limit=575; cmd="python3 bench/bench_vllm_e2e.py --shapes qwen3-8b:12 --wgmma
                              --out $OUT/bench_vllm_e2e_wgmma.json" ;;
    bench_e2e_exact) limit=575; cmd="python3 bench/bench_vllm_e2e.py --shapes qwen3-8b:36 --exact
                              --out $OUT/bench_vllm_e2e_exact.json" ;;   # full depth, three engines (~420 s)
    bench_e2e_persist) limit=575; cmd="python3 bench/bench_vllm_e2e.py --shapes qwen3-8b:36 --one-tile
                              --out $OUT/bench_vllm_e2e_persist.json" ;;   # full depth, three engines (~420 s)
    bench_graph_launch) limit=300; cmd="python3 bench/bench_graph_launch.py --json $OUT/bench_graph_launch.json" ;;
    bench_e2e_pdl) limit=575; cmd="python3 bench/bench_vllm_e2e.py --shapes qwen3-8b:36 --pdl
                              --out $OUT/bench_vllm_e2e_pdl.json" ;;   # full depth, three engines (~430 s)
    bench_e2e_dynamo) limit=560; cmd="python3 bench/bench_vllm_e2e.py --shapes qwen3-8b:12 --dynamo
                              --out $OUT/bench_vllm_e2e_dynamo.json" ;;
    bench_strict_moe) limit=560; cmd="python3 bench/bench_vllm_e2e.py --shapes qwen3-30b-a3b:4 --strict
                              --out $OUT/bench_vllm_e2e_strict_moe.json" ;;
    bench_strict_full) limit=575; cmd="python3 bench/bench_vllm_e2e.py --shapes qwen3-8b:36 --strict
                              --out $OUT/bench_vllm_e2e_strict_full.json" ;;   # GPU-bound: strict's real cost
    bench_strict) limit=560; cmd="python3 bench/bench_vllm_e2e.py --shapes qwen3-8b:12 --strict
                              --out $OUT/bench_vllm_e2e_strict.json" ;;
    bench_e2e_1.7b) limit=420; cmd="python3 bench/bench_vllm_e2e.py --shapes qwen3-1.7b:28 --profiled 1,16,64
                              --out $OUT/bench_vllm_e2e_1.7b.json" ;;
    bench_sync) limit=220; cmd="python3 bench/bench_sync.py --layers 4 --out $OUT/bench_sync.json" ;;
    # with the stall reasons (cycles a warp waits per issued instruction, by reason)
    ncu_mma)   limit=150; cmd="$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu | head -1) --clock-control none
                              -k w4a16_mma --section SpeedOfLight --section Occupancy --section LaunchStats
                              --section WarpStateStats --section SchedulerStats --section MemoryWorkloadAnalysis
                              --metrics regex:smsp__average_warps_issue_stalled_.*_per_issue_active.ratio
                              python3 bench/profile_mma.py --m 1,16,64" ;;
    ncu_mma_source) limit=200; cmd="bash bench/ncu_source.sh" ;;    # stall samples by SASS instruction, M = 16, 64
    ncu_mma_forms) limit=240; cmd="$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu | head -1) --clock-control none
                              -k w4a16_mma --section SpeedOfLight --section Occupancy --section WarpStateStats
                              --section MemoryWorkloadAnalysis python3 bench/profile_mma.py --m 1,16,64 --launches 1
                              --forms one-tile,persist,prefetch,persist+prefetch" ;;
    bench_sync_planned_12) limit=400; cmd="python3 bench/bench_sync.py --paths planned --layers 12 --profile
                              --bucket-mib 512,2048 --out $OUT/bench_sync_planned_12.json" ;;
    bench_sync_planned_24) limit=575; cmd="python3 bench/bench_sync.py --paths planned --layers 24 --profile
                              --out $OUT/bench_sync_planned_24.json" ;;
    # the whole model; the trainer's 48 BF16 layers alias 12 layers' storage (~15 GB), so that it fits an H100 too
    bench_sync_planned) limit=575; cmd="python3 bench/bench_sync.py --paths planned --layers 48 --profile
                              --distinct-layers 12 --bucket-mib 2048 --out $OUT/bench_sync_planned.json" ;;
    # the whole model with every trainer layer's BF16 storage its own (~61 GB beside the sampler's ~17 GB and the
    # buckets: more than an H100's 80 GB, so an H200 only: needs_h200)
    bench_sync_whole) limit=575; cmd="python3 bench/bench_sync.py --paths planned --layers 48 --profile
                              --bucket-mib 2048 --out $OUT/bench_sync_whole.json" ;;
    # the same with every commit of the sidecar under the torch profiler: where the commit's time goes
    bench_sync_commit_profile) limit=575; cmd="python3 bench/bench_sync.py --paths planned --layers 48 --repeats 1
                              --distinct-layers 12 --bucket-mib 2048 --profile-commits $OUT/commits
                              --out $OUT/bench_sync_commit_profile.json" ;;
    *) echo "unknown step $1" >> "$OUT/steps.txt"; return ;;
    esac
    timeout "$limit" $cmd > "$OUT/$1.log" 2>&1
    echo "$1 rc=$? $(date +%T)" >> "$OUT/steps.txt"
}

for stream in "$@"; do
    ( IFS=+; for s in $stream; do step "$s"; done ) &
done
wait
cp /tmp/engine/*.json "$OUT/" 2>/dev/null || true     # the study's results (its work folder holds a model)
