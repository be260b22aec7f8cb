"""Real CUDA vLLM engines with nvfp4_sampler on the H200: modes, in-place updates, determinism.

Skipped without CUDA or without vllm. Each engine runs in its own process
(`tests/gpu_scripts/vllm_engine.py`, JSON results; up to PARALLEL at once on the one GPU, each with a
fixed 1 GiB KV cache). Random Qwen3-shaped BF16 checkpoints are built on the device
(`testing/checkpoints.py`): "dense-small" (Qwen3, hidden 1024, 4 layers) and "moe-small"
(Qwen3-MoE, 16 experts top-4, 2 layers), seeds 0 and 1; online quantization at load.

Engines: for each kind and each mode (eager | graphs = CUDA graphs without torch.compile |
compiled = vLLM's default mode, torch.compile + CUDA graphs), one on seed 0 that is then updated to
seed 1 and back through three paths (our worker extension, vLLM's `reload_weights`, `model.load_weights`),
and one fresh engine on seed 1 (two in the compiled mode); BF16 engines (eager, compiled) on seed 0
as the anchor of the modes comparison. Compiled engines are not always reproducible from one process
to the next: vLLM's inductor configuration benchmarks candidate kernels on the device while it
compiles (combo kernels; TORCHINDUCTOR_DETERMINISTIC=1, which would forbid it, makes the compile fail
with "In the deterministic mode of Inductor, we will avoid those benchmarkings", measured), so two
engines on the same weights can run different BF16 kernels around ours. Asserted:
  - every engine starts, uses the GPU backends (hopper_mma linears, triton_hopper experts), generates; NVFP4 codes stay uint8 at their addresses
  - determinism: the same requests twice give bitwise identical log-probs and tokens
  - after each update (made after graph capture): prompt log-probs, greedy tokens and decode log-probs
    equal the fresh seed-1 engine of the same mode bitwise (decode runs in captured graphs in the
    graphs and compiled modes, so the graphs see the new values); restoring gives the first results.
    Compiled mode: the three paths agree bitwise and restore bitwise (same process); equal bitwise to
    one of the two fresh compiled engines, else (the updated engine autotuned other kernels) within
    MODE_MEAN_BOUND of it
  - across modes: eager vs graphs bitwise (prompt log-probs and greedy tokens); the default compiled
    mode (with and without custom_ops=["all"]) vs eager: mean |dlogp| < MODE_MEAN_BOUND, not bitwise
    (see test_modes_agree)
Run (H200, after `bash .gpu-vllm/install.sh`): python3 -m pytest -q -s -m gpu tests/test_gpu_vllm.py
"""
from __future__ import annotations

import concurrent.futures
import json
import os
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.gpu
vllm = pytest.importorskip("vllm")

KINDS = {"dense": ("dense-small", 4), "moe": ("moe-small", 2)}
MODES = ("eager", "graphs", "compiled")
PATHS = ("ext", "rpc", "lw")
PARALLEL = 8
ANCHOR_MODES = ("eager", "compiled")   # BF16 engines: what compilation alone changes
MODE_MEAN_BOUND = 0.25  # mean |dlogp| compiled vs eager, prompt log-probs (measured 0.110 / 0.055, see test_modes_agree)


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from nvfp4_sampler.testing.checkpoints import build

    d = tmp_path_factory.mktemp("gpu_vllm")
    return {(kind, seed): build(d / f"{kind}_{seed}", shape, seed=seed, layers=layers)
            for kind, (shape, layers) in KINDS.items() for seed in (0, 1)}


def _run(args: list[str], out: Path, log: Path) -> dict:
    from tests.gpu_scripts import run_script
    return run_script("tests.gpu_scripts.vllm_engine", args, out, log, timeout=400)


@pytest.fixture(scope="module")
def runs(ckpts, tmp_path_factory):
    """(kind, mode, "updated" | "fresh") -> the engine's JSON results."""
    d = tmp_path_factory.mktemp("runs")
    jobs = {}
    for kind in KINDS:
        old, new = str(ckpts[kind, 0]), str(ckpts[kind, 1])
        for mode in MODES:
            jobs[kind, mode, "updated"] = ["--model", old, "--mode", mode, "--new", new, "--old", old]
            jobs[kind, mode, "fresh"] = ["--model", new, "--mode", mode]
        jobs[kind, "compiled", "fresh2"] = ["--model", new, "--mode", "compiled"]
        jobs[kind, "compiled_custom_ops", "fresh"] = ["--model", old, "--mode", "compiled_custom_ops"]
        for mode in ANCHOR_MODES:
            jobs[kind, mode, "bf16"] = ["--model", old, "--mode", mode, "--quant", "bf16"]
    with concurrent.futures.ThreadPoolExecutor(PARALLEL) as pool:
        futures = {key: pool.submit(_run, args, d / f"{'_'.join(key)}.json", d / f"{'_'.join(key)}.log")
                   for key, args in jobs.items()}
        results = {key: f.result() for key, f in futures.items()}
    out_dir = os.environ.get("OUT")
    if out_dir:
        (Path(out_dir) / "gpu_vllm_runs.json").write_text(json.dumps({"|".join(k): v for k, v in results.items()}))
    for key, r in results.items():
        print(f"{key}: start {r.get('start_seconds')} s, total {r.get('total_seconds')} s, "
              f"backends {r.get('backends')}, compilation {r.get('compilation')}, errors {sorted(r['errors'])}")
    return results


def _flat(obs: dict, what: str) -> torch.Tensor:
    return torch.tensor([v for row in obs[what] for v in row], dtype=torch.float64)


def _assert_same(a: dict, b: dict, label: str) -> None:
    assert a["tokens"] == b["tokens"], f"{label}: greedy tokens differ"
    for what in ("prompt_lp", "decode_lp"):
        x, y = _flat(a, what), _flat(b, what)
        assert torch.equal(x, y), f"{label}: {what} differ, max |d| {(x - y).abs().max():.3e}"


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("mode", MODES)
def test_engine_starts_generates_and_is_deterministic(runs, kind, mode):
    for which in ("updated", "fresh", "fresh2") if mode == "compiled" else ("updated", "fresh"):
        r = runs[kind, mode, which]
        assert "start" in r and not {"start", "repeat", "process"} & set(r["errors"]), r["errors"]
        # dense linears store the tiled layout of `hopper_mma`; MoE experts run `triton_hopper`
        assert r["backends"] == (["hopper_mma", "triton_hopper"] if kind == "moe" else ["hopper_mma"]), r["backends"]
        assert all(len(t) == 16 for t in r["start"]["tokens"])
        _assert_same(r["start"], r["repeat"], f"{kind}/{mode}/{which} same request twice")


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("path", PATHS)
def test_update_after_capture_equals_fresh_engine_and_restores(runs, kind, mode, path):
    r, fresh = runs[kind, mode, "updated"], runs[kind, mode, "fresh"]
    assert not {f"{path}_new", f"{path}_restored"} & set(r["errors"]), r["errors"]
    _assert_same(r[f"{path}_restored"], r["start"], f"{kind}/{mode}: {path} restore vs start")
    _assert_same(r[f"{path}_new"], r["ext_new"], f"{kind}/{mode}: {path} update vs our extension's")
    fresh_runs = (fresh["start"], runs[kind, mode, "fresh2"]["start"]) if mode == "compiled" else (fresh["start"],)
    if mode == "compiled" and r[f"{path}_new"] not in fresh_runs:
        # every compiled engine autotunes its own inductor kernels (docstring): the updated engine may
        # have picked other BF16 kernels than both fresh ones (H200, 2026-12-03: the MoE fresh engines
        # agreed, the updated one was 3.8e-3 off; in the run before, the fresh ones differed instead)
        diff = (_flat(r[f"{path}_new"], "prompt_lp") - _flat(fresh["start"], "prompt_lp")).abs()
        print(f"{kind}/compiled: {path} update matches no fresh engine bitwise; mean |dlogp| {diff.mean():.3e}")
        assert diff.mean() < MODE_MEAN_BOUND
    else:
        _assert_same(r[f"{path}_new"], fresh["start"], f"{kind}/{mode}: {path} update vs fresh engine")
    assert r["code_dtypes"] == ["torch.uint8"] and r["code_ptrs_unchanged"]


@pytest.mark.parametrize("kind", KINDS)
def test_modes_agree(runs, kind):
    """graphs and eager run the same kernels: bitwise. The compiled mode runs inductor's kernels for
    the BF16 ops around ours (RMSNorm, SiLU-and-mul, rotary, residual adds; with custom_ops=["all"]
    vLLM's CUDA ones, but still fused differently), so it is bounded, not bitwise: measured on the
    H200 before the BF16 anchors existed (seed-0 checkpoints of this module) mean |dlogp| 0.110
    (dense) and 0.055 (MoE). The BF16 engines of the same modes show what compilation alone changes:
    when they are bitwise equal, ours must be too. Bound: mean |dlogp| < MODE_MEAN_BOUND."""
    eager, graphs, compiled = (runs[kind, m, "updated"]["start"] for m in MODES)
    custom = runs[kind, "compiled_custom_ops", "fresh"]
    bf16 = {m: runs[kind, m, "bf16"] for m in ANCHOR_MODES}
    for r in (custom, *bf16.values()):
        assert "start" in r, r["errors"]
    assert torch.equal(_flat(graphs, "prompt_lp"), _flat(eager, "prompt_lp"))
    assert graphs["tokens"] == eager["tokens"]
    anchor = (_flat(bf16["compiled"]["start"], "prompt_lp") - _flat(bf16["eager"]["start"], "prompt_lp")).abs()
    print(f"{kind}: BF16 engines, compiled vs eager: max |dlogp| {anchor.max():.3e}, mean {anchor.mean():.3e}")
    gaps = {}
    for label, obs in (("default compiled", compiled), ("compiled, custom_ops=all", custom["start"])):
        gaps[label] = diff = (_flat(obs, "prompt_lp") - _flat(eager, "prompt_lp")).abs()
        print(f"{kind}: nvfp4_sampler {label} vs eager: max |dlogp| {diff.max():.3e}, mean {diff.mean():.3e} over "
              f"{diff.numel()} prompt tokens; greedy tokens equal {obs['tokens'] == eager['tokens']}")
        assert diff.mean() < MODE_MEAN_BOUND, label
    if anchor.max() == 0:       # compilation changed nothing in the BF16 engine: nor may it in ours
        assert gaps["default compiled"].max() == 0
