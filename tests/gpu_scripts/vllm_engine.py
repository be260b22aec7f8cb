"""One real CUDA vLLM engine (one process) for tests/test_gpu_vllm.py; results as JSON.

  python -m tests.gpu_scripts.vllm_engine --model DIR --mode {eager,graphs,compiled,compiled_custom_ops} --out FILE.json
         [--new DIR --old DIR] [--quant {nvfp4_sampler,bf16}]

Starts `LLM(DIR, quantization="nvfp4_sampler")` (online quantization of a BF16 checkpoint) in the given
mode (--quant bf16: the unquantized engine, the anchor of the modes comparison), in-process
(VLLM_ENABLE_V1_MULTIPROCESSING=0, as TRL's colocate mode runs it), and records
`observe()`: prompt log-probs (prefill), greedy tokens and their log-probs (decode, which CUDA graphs
replay in the graphs and compiled modes) -- twice (determinism). With --new/--old it then updates the
weights in place, after graph capture, through each path, recording `observe()` on the new weights
and again after restoring the old ones:
  ext   our worker extension: collective_rpc("nvfp4_apply_update", staged safetensors file)
  rpc   vLLM's layerwise reload: collective_rpc("reload_weights", weights_iterator=HF-named BF16 tensors),
        restored with reload_weights(weights_path=old folder)
  lw    model.load_weights([(name, tensor)]) on the model object (TRL colocate, verl)
A failing step records its error and the script goes on; the JSON is rewritten after every step.
"""
from __future__ import annotations

import argparse
import json
import os
import time
import traceback
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
os.environ.setdefault("VLLM_DISABLE_COMPILE_CACHE", "1")

EXTENSION = "nvfp4_sampler.sampler_plugin.vllm.worker_extension.NVFP4SamplerWorkerExtension"
CAPTURE_SIZES = [1, 2, 4, 8]
MODES = {
    "eager": dict(enforce_eager=True),
    "graphs": dict(compilation_config={"mode": 0, "cudagraph_mode": "FULL_DECODE_ONLY",
                                       "cudagraph_capture_sizes": CAPTURE_SIZES}),
    "compiled": dict(compilation_config={"cudagraph_capture_sizes": CAPTURE_SIZES}),   # vLLM's default mode
    # the default mode with vLLM's CUDA kernels for RMSNorm, SiLU-and-mul, rotary (as in eager) instead of
    # inductor-generated ones: the same kernels run as in eager around our custom ops
    "compiled_custom_ops": dict(compilation_config={"cudagraph_capture_sizes": CAPTURE_SIZES, "custom_ops": ["all"]}),
}
PROMPTS = [[(7 * i + 3 * j) % 997 + 10 for j in range(n)] for i, n in enumerate((24, 40, 9))]
NEW_TOKENS = 16


def observe(llm) -> dict:
    """Prompt log-probs [per prompt], greedy tokens and their log-probs, for a batch of 3 prompts."""
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True, logprobs=0, prompt_logprobs=0)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    return {
        "prompt_lp": [[d[t].logprob for d, t in zip(o.prompt_logprobs[1:], p[1:])] for o, p in zip(outs, PROMPTS)],
        "tokens": [list(o.outputs[0].token_ids) for o in outs],
        "decode_lp": [[d[t].logprob for d, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)] for o in outs],
    }


def recorder(path: str, out: dict):
    """(save, step) over the result dict `out` (with an "errors" dict), written to `path` as JSON after
    every step, so a run cut short keeps what it measured. step(name, fn) stores fn() under name, or
    the error and its traceback under errors[name]; the other steps still run."""
    def save():
        Path(path).write_text(json.dumps(out))

    def step(name, fn):
        t = time.time()
        try:
            out[name] = fn()
        except Exception as e:   # recorded for the test to report; the other steps still run
            out["errors"][name] = f"{type(e).__name__}: {e}\n{traceback.format_exc()[-3000:]}"
        out.setdefault("seconds", {})[name] = round(time.time() - t, 2)
        save()
    return save, step


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--mode", choices=sorted(MODES), required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--new", help="BF16 checkpoint folder to update to (after start)")
    ap.add_argument("--old", help="the folder the engine started from (restored after each update)")
    ap.add_argument("--quant", choices=("nvfp4_sampler", "bf16"), default="nvfp4_sampler")
    args = ap.parse_args()
    out: dict = {"mode": args.mode, "model": args.model, "quant": args.quant, "errors": {}}

    save, step = recorder(args.out, out)

    import torch
    from safetensors.torch import load_file, save_file
    from vllm import LLM

    t0 = time.time()
    llm = LLM(args.model, quantization=None if args.quant == "bf16" else args.quant, dtype="bfloat16",
              skip_tokenizer_init=True, max_model_len=512, gpu_memory_utilization=0.08, kv_cache_memory_bytes=1 << 30,
              attention_backend="TRITON_ATTN", seed=0, enable_prefix_caching=False, worker_extension_cls=EXTENSION,
              **MODES[args.mode])
    out["start_seconds"] = round(time.time() - t0, 1)
    config = llm.llm_engine.vllm_config.compilation_config
    out["compilation"] = {"mode": str(config.mode), "cudagraph_mode": str(config.cudagraph_mode)}
    model = llm.llm_engine.model_executor.driver_worker.model_runner.model
    out["backends"] = sorted({getattr(m, "nvfp4_backend", None) for m in model.modules()} - {None})
    code_ptrs = [p.data_ptr() for p in model.parameters() if getattr(p, "nvfp4_kind", "") == "weight"]
    step("start", lambda: observe(llm))
    step("repeat", lambda: observe(llm))
    if args.new:
        new_sd = load_file(Path(args.new) / "model.safetensors")
        old_sd = load_file(Path(args.old) / "model.safetensors")
        staged = Path(args.out).with_suffix(".staged.safetensors")

        def ext(sd, version):
            save_file(sd, staged)
            llm.collective_rpc("nvfp4_apply_update", args=(str(staged), version))
            return observe(llm)

        def rpc(**kwargs):
            llm.collective_rpc("reload_weights", kwargs={**kwargs, "is_checkpoint_format": True})
            return observe(llm)

        def lw(sd):
            with torch.no_grad():
                model.load_weights(list(sd.items()))
            return observe(llm)

        step("ext_new", lambda: ext(new_sd, 1))
        step("ext_restored", lambda: ext(old_sd, 2))
        step("rpc_new", lambda: rpc(weights_iterator=list(new_sd.items())))
        step("rpc_restored", lambda: rpc(weights_path=args.old))
        step("lw_new", lambda: lw(new_sd))
        step("lw_restored", lambda: lw(old_sd))
        staged.unlink(missing_ok=True)
    # storage after every update: NVFP4 codes stay uint8 (4-bit), at the addresses they had at start
    out["code_dtypes"] = sorted({str(p.dtype) for p in model.parameters() if getattr(p, "nvfp4_kind", "") == "weight"})
    out["code_ptrs_unchanged"] = code_ptrs == [p.data_ptr() for p in model.parameters()
                                               if getattr(p, "nvfp4_kind", "") == "weight"]
    out["total_seconds"] = round(time.time() - t0, 1)
    save()


if __name__ == "__main__":
    main()
