"""Where does vLLM's nvfp4_sampler prompt log-prob gap against the torch W4A4 forward come from?

Per layer and operator, on the same token sequences and the same BF16 weights:
  vllm   (one subprocess per quantization) vLLM's prompt log-probs, and every linear layer's input
         and output captured inside the engine (`diagnostics.engine_capture`, eager mode)
  torch  (subprocess) the transformers forward of the same weights, BF16 and W4A4 per token
         (`sampler_plugin.torch_modules`), with each operator's input
  compare  mean |dlogp| vLLM vs torch for BF16 and for NVFP4; then per operator, in model order:
         input_rel_err  ||x_vllm - x_torch|| / ||x_torch||  (drift arriving from upstream)
         code_mismatch  share of per-token NVFP4 codes of x that differ (what the drift does to codes)
         op_err         ||y_vllm - y_ref|| / ||y_ref|| with y_ref = the reference op (kernels.reference)
                        applied to vLLM's OWN input x: nonzero beyond BF16 output rounding (~2^-9)
                        means the engine's op computes something else than the spec (an integration
                        error), zero means the gap is upstream drift amplified into code flips.

  python bench/engine_numerics.py all --out DIR [--model HF_DIR] [--seqs 4 --len 128]

Without --model it builds a random Llama with SmolLM2-135M's shapes (hidden 576, 30 layers, 9 heads,
3 KV heads, MLP 1536, vocab 49152) so it runs where the real weights are not installed. Runs on CUDA
(the H200 through ../shared/gpu-vllm) or on the CPU vLLM build.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import torch

PAIRS = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "o_proj": ("o_proj",), "gate_up_proj": ("gate_proj", "up_proj"),
         "down_proj": ("down_proj",)}


def build_model(path: Path, *, seed: int = 0) -> Path:
    """A random Llama with SmolLM2-135M's shapes and the tiny test tokenizer (token ids are sent directly)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from nvfp4_sampler.testing.models import tokenizer

    if (path / "config.json").exists():
        return path
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                      num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=2048, rms_norm_eps=1e-5,
                      tie_word_embeddings=True, rope_theta=100000.0, initializer_range=0.04, bos_token_id=0,
                      eos_token_id=0)
    LlamaForCausalLM(cfg).to(torch.bfloat16).save_pretrained(path)
    tokenizer(path)
    return path


def sequences(n: int, length: int, vocab: int, *, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(1, min(vocab, 49152), (n, length), generator=g).tolist()


def run_vllm(model: Path, seqs: list[list[int]], quantization: str | None, out: Path) -> None:
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")     # the worker lives in this process
    os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
    from vllm import LLM, SamplingParams

    from nvfp4_sampler.diagnostics import engine_capture

    kw = {"quantization": quantization} if quantization else {}
    cpu = not torch.cuda.is_available()
    llm = LLM(model=str(model), dtype="bfloat16", enforce_eager=True, max_model_len=1024, seed=0,
              enable_prefix_caching=False, max_num_batched_tokens=4096,
              kv_cache_memory_bytes=1 << 30,     # fixed: no memory profiling (other GPU processes may run)
              **({} if cpu else {"gpu_memory_utilization": 0.3, "attention_backend": "TRITON_ATTN"}), **kw)
    llm.collective_rpc(engine_capture.install)
    result = {"logprobs": [], "acts": []}
    for s in seqs:
        o = llm.generate({"prompt_token_ids": s}, SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)[0]
        result["logprobs"].append([o.prompt_logprobs[t][s[t]].logprob for t in range(1, len(s))])
        calls = llm.collective_rpc(engine_capture.collect)[0]
        result["acts"].append({name: (torch.cat([x for x, _ in c]), torch.cat([y for _, y in c]))
                               for name, c in calls.items()})
    torch.save(result, out)


def run_torch(model: Path, seqs: list[list[int]], out: Path) -> None:
    from transformers import AutoModelForCausalLM

    from nvfp4_sampler.sampler_format import SamplerConfig
    from nvfp4_sampler.sampler_plugin.torch_modules import quantize_model

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    result = {}
    for kind in ("bf16", "nvfp4"):
        m = AutoModelForCausalLM.from_pretrained(model, dtype=torch.bfloat16).to(dev).eval()
        if kind == "nvfp4":
            quantize_model(m, SamplerConfig())
        names = [n for n, _ in m.named_modules() if n.endswith(("q_proj", "o_proj", "gate_proj", "down_proj"))]
        rows = {"logprobs": [], "acts": []}
        for s in seqs:
            acts = {}
            hooks = [m.get_submodule(n).register_forward_pre_hook(
                lambda mod, a, n=n: acts.__setitem__(n, a[0].detach().reshape(-1, a[0].shape[-1]).cpu()))
                for n in names]
            with torch.no_grad():
                ids = torch.tensor([s], device=dev)
                logp = torch.log_softmax(m(input_ids=ids).logits[0, :-1].float(), -1)
            for h in hooks:
                h.remove()
            rows["logprobs"].append(logp.gather(1, ids[0, 1:, None])[:, 0].cpu().tolist())
            rows["acts"].append(acts)
        result[kind] = rows
    result["bf16_weights"] = {k: v for k, v in AutoModelForCausalLM.from_pretrained(
        model, dtype=torch.bfloat16).state_dict().items() if k.endswith("proj.weight")}
    torch.save(result, out)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp(min=1e-30))


def compare(work: Path) -> dict:
    from nvfp4_sampler.kernels import reference as R

    t = torch.load(work / "torch.pt")
    weights = t["bf16_weights"]
    report = {}
    for kind, quant in (("bf16", None), ("nvfp4", "nvfp4_sampler")):
        v = torch.load(work / f"vllm_{kind}.pt")
        gaps = torch.cat([torch.tensor(a) - torch.tensor(b) for a, b in zip(v["logprobs"], t[kind]["logprobs"])])
        layers = []
        for vname in v["acts"][0]:
            suffix = vname.rsplit(".", 1)[1]
            shards = [vname.rsplit(".", 1)[0] + "." + s for s in PAIRS[suffix]]
            n = [a[shards[0]].shape[0] for a in t[kind]["acts"]]          # tokens per sequence
            xv = torch.cat([a[vname][0][:m] for a, m in zip(v["acts"], n)]).float()
            yv = torch.cat([a[vname][1][:m] for a, m in zip(v["acts"], n)]).float()
            xt = torch.cat([a[shards[0]] for a in t[kind]["acts"]]).float()
            ws = [weights[f"{s}.weight"] for s in shards]
            xb = xv.to(torch.bfloat16)
            if kind == "nvfp4":
                y_ref = torch.cat([R.linear(xb, R.quantize_weight(w)).float() for w in ws], -1)
                cv = R.unpack_nibbles(R.quantize_per_token(xb).codes)
                ct = R.unpack_nibbles(R.quantize_per_token(xt.to(torch.bfloat16)).codes)
                code_mismatch = float((cv != ct).double().mean())
            else:
                y_ref = torch.cat([torch.nn.functional.linear(xb, w).float() for w in ws], -1)
                code_mismatch = None
            layers.append({"layer": vname, "input_rel_err": _rel(xv, xt), "code_mismatch": code_mismatch,
                           "op_err": _rel(yv, y_ref)})
        report[kind] = {"mean_abs_dlogp": float(gaps.abs().mean()), "max_abs_dlogp": float(gaps.abs().max()),
                        "layers": layers}
    return report


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("step", choices=("all", "vllm-bf16", "vllm-nvfp4", "torch", "compare"))
    ap.add_argument("--out", required=True)
    ap.add_argument("--model", default=None, help="HF BF16 folder (default: random SmolLM2-shaped Llama)")
    ap.add_argument("--seqs", type=int, default=4)
    ap.add_argument("--len", type=int, default=128)
    a = ap.parse_args(argv)
    work = Path(a.out)
    work.mkdir(parents=True, exist_ok=True)
    model = Path(a.model) if a.model else build_model(work / "model")
    seqs = sequences(a.seqs, a.len, 49152)
    if a.step == "all":
        for step in ("vllm-bf16", "vllm-nvfp4", "torch"):            # one engine per subprocess
            cmd = [sys.executable, __file__, step, "--out", str(work), "--model", str(model), "--seqs", str(a.seqs),
                   "--len", str(a.len)]
            subprocess.run(cmd, check=True)
        a.step = "compare"
    if a.step.startswith("vllm-"):
        kind = a.step.split("-")[1]
        run_vllm(model, seqs, "nvfp4_sampler" if kind == "nvfp4" else None, work / f"vllm_{kind}.pt")
    elif a.step == "torch":
        run_torch(model, seqs, work / "torch.pt")
    elif a.step == "compare":
        report = compare(work)
        (work / "engine_numerics.json").write_text(json.dumps(report, indent=1))
        for kind, r in report.items():
            print(f"{kind}: vLLM vs torch prompt log-probs  mean|dlogp| {r['mean_abs_dlogp']:.4f}  "
                  f"max {r['max_abs_dlogp']:.3f}")
            print(f"  {'operator':<40} {'input_rel_err':>13} {'code_mismatch':>13} {'op_err':>9}")
            for row in r["layers"]:
                cm = "-" if row["code_mismatch"] is None else f"{row['code_mismatch']:.4f}"
                print(f"  {row['layer']:<40} {row['input_rel_err']:13.2e} {cm:>13} {row['op_err']:9.2e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
