"""vLLM's own weight-update paths on the H200: the `ipc` transfer backend and reload_weights, in CUDA-graph mode.

Skipped without CUDA or vllm. One engine per process (`tests/gpu_scripts/updates_ipc.py`, JSON results),
up to four at once on the one GPU. Random Qwen3-shaped BF16 checkpoints built on the device
(`testing/checkpoints.py`): "dense-small" (4 layers) and "moe-small" (2 layers), seeds 0, 1;
online quantization. Per kind: an engine on seed 0 that a trainer process on the same GPU updates
through vLLM's `ipc` backend (BF16, then NVFP4 triplets: 0.28x the bytes), that reloads through
collective_rpc("reload_weights") and that `server.colocated.ColocatedRefit` refits from BF16 tensors on
the same GPU, and that a trainer thread updates through a weight group (`server.broadcast`, gloo, NVFP4
triplets), all after CUDA-graph capture; and a fresh engine on seed 1. Asserted:
  - after each full update: prompt log-probs, greedy tokens and decode log-probs (replayed in the
    captured graphs) equal the fresh seed-1 engine bitwise; restoring gives the start results bitwise
  - one shard of the fused qkv (q_proj only) and one expert: equal to the same update through the
    worker extension bitwise, different from the start, and restored bitwise
  - NVFP4 codes stay uint8 at their start addresses; the quantized layers' NVFP4 payload is under
    0.30x their BF16 one; the colocated refit writes every NVFP4 entry whole (no per-tensor fallback)
Run (H200, after `bash .gpu-vllm/install.sh`): python3 -m pytest -q -s -m gpu tests/test_gpu_vllm_updates.py
"""
from __future__ import annotations

import concurrent.futures

import pytest
import torch

pytestmark = pytest.mark.gpu
vllm = pytest.importorskip("vllm")

KINDS = {"dense": ("dense-small", 4), "moe": ("moe-small", 2)}
MODE = "graphs"            # CUDA graphs without torch.compile (FULL_DECODE_ONLY): decode replays graphs
FULL = ("ipc_bf16", "ipc_nvfp4", "rpc_bf16", "colocated", "group")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """(kind, "updated" | "fresh") -> the engine's JSON results."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from nvfp4_sampler.testing.checkpoints import build

    d = tmp_path_factory.mktemp("gpu_updates")
    jobs = {}
    for kind, (shape, layers) in KINDS.items():
        old, new = (str(build(d / f"{kind}_{seed}", shape, seed=seed, layers=layers)) for seed in (0, 1))
        jobs[kind, "updated"] = ["--model", old, "--mode", MODE, "--new", new, "--old", old]
        jobs[kind, "fresh"] = ["--model", new, "--mode", MODE]

    def run(key, args):
        from tests.gpu_scripts import run_script
        return run_script("tests.gpu_scripts.updates_ipc", args, d / f"{'_'.join(key)}.json",
                          d / f"{'_'.join(key)}.log", timeout=500)

    with concurrent.futures.ThreadPoolExecutor(len(jobs)) as pool:
        futures = {key: pool.submit(run, key, args) for key, args in jobs.items()}
        results = {key: f.result() for key, f in futures.items()}
    for key, r in results.items():
        print(key, "start", r.get("start_seconds"), "s; steps", r.get("seconds"), "; bytes", r.get("bytes"))
    return results


@pytest.mark.parametrize("kind", list(KINDS))
def test_ipc_and_reload_full_updates_equal_fresh_engine_and_restore(runs, kind):
    updated, fresh = runs[kind, "updated"], runs[kind, "fresh"]
    assert not updated["errors"] and not fresh["errors"], {**updated["errors"], **fresh["errors"]}
    assert updated["start"] != fresh["start"]                    # the two checkpoints differ
    for step in FULL:
        assert updated[step] == fresh["start"], step             # log-probs and tokens, bitwise
        restored = "rpc_restored" if step.startswith("rpc") else f"{step}_restored"
        assert updated[restored] == updated["start"], restored
    assert updated["codes_4bit_in_place"]
    assert updated["per_tensor_entries"] == []          # the colocated refit wrote every NVFP4 entry whole
    assert updated["group_sent"] == [True, True]         # the weight group's trainer saw both updates applied
    ratio = updated["bytes"]["ipc_nvfp4"] / updated["bytes"]["ipc_bf16"]
    print(f"{kind}: NVFP4 payload of the quantized layers {ratio:.3f}x their BF16 one")
    assert ratio < 0.30


@pytest.mark.parametrize("kind, part", [("dense", "shard"), ("moe", "shard"), ("moe", "expert")])
def test_ipc_partial_updates_equal_the_extension_and_keep_the_rest(runs, kind, part):
    updated = runs[kind, "updated"]
    assert not updated["errors"], updated["errors"]
    assert updated[f"ipc_{part}"] == updated[f"ext_{part}"]
    assert updated[f"ipc_{part}"]["prompt_lp"] != updated["start"]["prompt_lp"]
    assert updated[f"ipc_{part}_restored"] == updated["start"]
    assert updated[f"ext_{part}_restored"] == updated["start"]
