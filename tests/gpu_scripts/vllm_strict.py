"""One CUDA vLLM engine (one process), strict or default, for tests/test_gpu_vllm_strict.py; results as JSON.

  python -m tests.gpu_scripts.vllm_strict --model DIR --new DIR --attention {TRITON_ATTN,FLASH_ATTN}
         --mode {graphs,compiled} [--execution {strict,default}] --out FILE.json

--execution strict (the default): VLLM_BATCH_INVARIANT=1, set before vLLM is imported, and
`LLM(DIR, quantization="nvfp4_sampler", hf_overrides={"quantization_config": {..., "strict": true}})`
(online quantization, BF16, in-process); --execution default, the test's control: VLLM_BATCH_INVARIANT=0
and the same config without strict (the batch-dependent paths).
Records `nvfp4_layers()` (backend and strict per layer), then for greedy and sampled decoding, batch 1
and the mixed batch of PROMPTS (lengths 24, 40, 9, 70): the decode log-probs and the prompt log-probs
of the same sequences recomputed in one prefill batch (`tests.vllm_helpers.decode_and_recompute`);
then updates the weights in place to --new (`nvfp4_apply_update`, after graph capture) and records
the same again. A failing step records its error and the script goes on.
"""
from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
os.environ.setdefault("VLLM_DISABLE_COMPILE_CACHE", "1")

from tests.gpu_scripts.vllm_engine import CAPTURE_SIZES, EXTENSION, MODES, recorder  # noqa: E402

PROMPTS = [[(7 * i + 3 * j) % 997 + 10 for j in range(n)] for i, n in enumerate((24, 40, 9, 70))]
NEW_TOKENS = 16


def observe(llm) -> dict:
    """(kind, batch) -> [decoded, recomputed] log-probs per prompt (`decode_and_recompute`)."""
    from vllm import SamplingParams

    from tests.vllm_helpers import decode_and_recompute

    params = {"greedy": SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True, logprobs=0),
              "sampled": SamplingParams(max_tokens=NEW_TOKENS, temperature=1.0, seed=3, ignore_eos=True, logprobs=0)}
    return {f"{kind}|{batch}": decode_and_recompute(llm, prompts, p) for kind, p in params.items()
            for batch, prompts in (("batch1", PROMPTS[:1]), ("mixed", PROMPTS))}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--new", required=True, help="BF16 checkpoint folder to update to (after start)")
    ap.add_argument("--attention", choices=("TRITON_ATTN", "FLASH_ATTN"), required=True)
    ap.add_argument("--mode", choices=("graphs", "compiled"), required=True)
    ap.add_argument("--execution", choices=("strict", "default"), default="strict",
                    help="strict: batch-invariant (strict config, VLLM_BATCH_INVARIANT=1); default: the control")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    strict = args.execution == "strict"
    # vLLM's attention modules read it when imported: set (either way, whatever the caller's environment
    # says) before the first vLLM import below
    os.environ["VLLM_BATCH_INVARIANT"] = "1" if strict else "0"
    out: dict = {"attention": args.attention, "mode": args.mode, "execution": args.execution,
                 "model": args.model, "errors": {}}
    save, step = recorder(args.out, out)

    from safetensors.torch import load_file, save_file
    from vllm import LLM

    from nvfp4_sampler.sampler_format import SamplerConfig

    t0 = time.time()
    llm = LLM(args.model, quantization="nvfp4_sampler", dtype="bfloat16", skip_tokenizer_init=True,
              hf_overrides={"quantization_config": SamplerConfig(strict=strict).to_dict()}, max_model_len=512,
              gpu_memory_utilization=0.08, kv_cache_memory_bytes=1 << 30, attention_backend=args.attention, seed=0,
              enable_prefix_caching=False, worker_extension_cls=EXTENSION, **MODES[args.mode])
    out["start_seconds"] = round(time.time() - t0, 1)
    out["capture_sizes"] = CAPTURE_SIZES
    step("layers", lambda: llm.collective_rpc("nvfp4_layers")[0])
    step("start", lambda: observe(llm))
    staged = Path(args.out).with_suffix(".staged.safetensors")

    def update():
        save_file(load_file(Path(args.new) / "model.safetensors"), staged)
        llm.collective_rpc("nvfp4_apply_update", args=(str(staged), 1))
        return observe(llm)

    step("updated", update)
    staged.unlink(missing_ok=True)
    out["total_seconds"] = round(time.time() - t0, 1)
    save()


if __name__ == "__main__":
    main()
