"""`nvfp4-sampler diagnose`: the learner-vs-sampler report from a file, or live against a sampler.

  diagnose --input run.json --out DIR
      run.json holds {"logp_sampler": [[...]], "logp_learner": [[...]], "advantages"?, "masks"?}
      (the /v1/diagnostics request body): writes DIR/report.json and the PNG plots.
  diagnose --url URL --model BF16_DIR --out DIR [--learner per_token|per_tensor|bf16] [--operators] [--device D]
      samples responses from the sampler at URL (a sidecar over vLLM or the embedded engine, or a plain
      vLLM server) through the official `openai` client with its decode log-probs, all prompts at once
      (the engine batches them, as in an RL rollout; --sequential: one at a time, batch 1), recomputes them
      teacher-forced with a local learner (BF16_DIR quantized per --learner, plain torch), then writes
      the report and plots. A sidecar's /v1/logprobs also recomputes them on the sampler itself: the
      report's "sampler_recompute" says how far decode is from that (bitwise equal in strict mode).
      --operators adds the operator layer: the same local weights run as the learner (whole sequence) and
      as the sampler (token by token through the KV cache), compared per layer (`diagnostics.operators`),
      written to DIR/operators.json.
Advantages: --advantages a,b,... (one per response) or --synthetic-advantages (random signs, seeded;
only to exercise the direction shares and the weights, not a reward).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import random
from concurrent import futures as concurrent_futures
from pathlib import Path

import torch

from nvfp4_sampler.sampler_format import ACTIVATION_SCALINGS, Recipe, SamplerConfig
from nvfp4_sampler.sampler_format.args import add_recipe_args, recipe_from_args

from .operators import compare, decode, model_device, teacher_forced
from .plots import write_plots
from .report import Params, mismatch_report, pad, recompute_agreement

PROMPTS = [
    "Write one sentence about the sea.",
    "Explain in two sentences why the sky is blue.",
    "List three fruits and describe each briefly.",
    "Tell a very short story about a robot who learns to paint.",
    "What is reinforcement learning? Answer briefly.",
    "Describe a city at night.",
    "Give advice to someone learning to cook.",
    "Summarize the plot of a fairy tale you know.",
]


def add_parser(sub) -> None:
    p = sub.add_parser("diagnose", help="learner-vs-sampler mismatch report (metrics, tails, weights, plots)")
    p.add_argument("--input", default=None, help="JSON with logp_sampler, logp_learner[, advantages, masks]")
    p.add_argument("--url", default=None, help="sampler URL (sidecar or vLLM server) to sample from")
    p.add_argument("--model", default=None, help="the learner's BF16 HF folder (with --url)")
    p.add_argument("--learner", choices=(*ACTIVATION_SCALINGS, "bf16"), default="per_token",
                   help="learner-side activation scaling of the W4A4 recompute, or bf16 (no quantization)")
    add_recipe_args(p, activation_scaling=False)        # the learner's; match the sampler's config
    p.add_argument("--prompts", type=int, default=4, help="number of built-in prompts to sample (with --url)")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--sequential", action="store_true",
                   help="sample one prompt at a time (batch 1) instead of all at once (mixed batches)")
    p.add_argument("--advantages", default=None, help="comma-separated, one per response")
    p.add_argument("--synthetic-advantages", action="store_true", help="random +-1 per response (seeded)")
    p.add_argument("--operators", action="store_true", help="also the operator layer on the local weights")
    p.add_argument("--device", default="cpu", help="where the local learner (and the operator layer) runs: cpu, "
                   "cuda, cuda:N (its NVFP4 ops take that device's backends)")
    p.add_argument("--out", default="diagnose-out", help="output folder (report.json, *.png)")
    p.set_defaults(func=run)


def load_learner(model_dir: str | Path, recipe: Recipe | None, device: str | torch.device = "cpu"):
    """The learner-side model on `device`: BF16 transformers, W4A4 quantized with `recipe` (weights and
    activations, `sampler_plugin.torch_modules.quantize_model`), or plain BF16 when recipe is None."""
    from transformers import AutoModelForCausalLM

    from nvfp4_sampler.sampler_plugin.torch_modules import quantize_model

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).to(device).eval()
    if recipe is not None:
        quantize_model(model, SamplerConfig(recipe=recipe))
    return model


@torch.no_grad()
def learner_logprobs(model, seqs: list[list[int]], prompt_lens: list[int]) -> list[list[float]]:
    """Teacher-forced log-probs of seq[p:] per sequence (one forward each, fp32 log-softmax)."""
    out, dev = [], model_device(model)
    for s, p in zip(seqs, prompt_lens):
        logits = model(input_ids=torch.tensor([s], device=dev)).logits[0, p - 1:len(s) - 1].float()
        out.append(torch.log_softmax(logits, -1).gather(1, torch.tensor(s[p:], device=dev)[:, None])[:, 0].tolist())
    return out


def sample(url: str, tokenizer, prompts: list[str], *, max_tokens: int, seed: int, concurrent: bool = True):
    """Sample one response per prompt through the OpenAI completions route -> (prompt ids, response ids,
    the sampler's log-prob of each response token), in prompt order, dropping empty responses. concurrent:
    every request in flight at once (the engine decodes them in mixed batches), else one after another."""
    import openai

    oa = openai.OpenAI(base_url=f"{url.rstrip('/')}/v1", api_key="unused")
    model_id = oa.models.list().data[0].id

    def one(i: int):
        ids = tokenizer(prompts[i]).input_ids
        r = oa.completions.create(model=model_id, prompt=ids, max_tokens=max_tokens, temperature=1.0,
                                  seed=seed + i, logprobs=0, extra_body={"return_token_ids": True})
        ch = r.choices[0]
        resp = getattr(ch, "token_ids", None)
        if resp is None:
            raise RuntimeError(f"{url}: the completion has no token_ids (the engine ignores return_token_ids)")
        return ids, list(resp), list(ch.logprobs.token_logprobs)

    if concurrent:
        with concurrent_futures.ThreadPoolExecutor(max_workers=len(prompts)) as pool:
            done = list(pool.map(one, range(len(prompts))))
    else:
        done = [one(i) for i in range(len(prompts))]
    return [d for d in done if d[1]]


def sampler_recompute(url: str, seqs: list[list[int]], prompt_lens: list[int]) -> list[list[float]] | None:
    """The sampler's own teacher-forced log-probs of the responses (a sidecar's /v1/logprobs, docs/PROTOCOL.md);
    None where URL has no such route (a plain vLLM server)."""
    import httpx                                 # the openai client's own HTTP library

    r = httpx.post(f"{url.rstrip('/')}/v1/logprobs", json={"sequences": seqs, "prompt_lens": prompt_lens},
                   timeout=600)
    if r.status_code == 404:
        return None
    r.raise_for_status()
    return [row["logprobs"] for row in r.json()["results"]]


def run(args: argparse.Namespace) -> int:
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    params, recomputed = Params(), None
    if args.input:
        body = json.loads(Path(args.input).read_text())
        mu_rows, pi_rows = body["logp_sampler"], body["logp_learner"]
        adv, masks = body.get("advantages"), body.get("masks")
    elif args.url and args.model:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(args.model)
        prompts = (PROMPTS * (args.prompts // len(PROMPTS) + 1))[:args.prompts]
        samples = sample(args.url, tok, prompts, max_tokens=args.max_tokens, seed=args.seed,
                         concurrent=not args.sequential)
        recipe = recipe_from_args(args)
        learner = load_learner(args.model, None if args.learner == "bf16" else
                               dataclasses.replace(recipe, activation_scaling=args.learner), args.device)
        seqs = [p + r for p, r, _ in samples]
        pi_rows = learner_logprobs(learner, seqs, [len(p) for p, _, _ in samples])
        mu_rows, masks = [lp for _, _, lp in samples], None
        recomputed = sampler_recompute(args.url, seqs, [len(p) for p, _, _ in samples])
        adv = None
        if args.advantages:
            adv = [float(a) for a in args.advantages.split(",")]
        elif args.synthetic_advantages:
            rng = random.Random(args.seed)
            adv = [rng.choice((-1.0, 1.0)) for _ in samples]
        if args.operators:
            sampler = load_learner(args.model, recipe, args.device)
            ops = {}
            for i, s in enumerate(seqs):
                for name, row in compare(sampler, teacher_forced(learner, s), decode(sampler, s), sequence=i).items():
                    ops.setdefault(name, []).append(row)
            (out_dir / "operators.json").write_text(json.dumps(ops))
            print(f"operator layer: {len(ops)} quantized operators x {len(seqs)} sequences -> {out_dir / 'operators.json'}")
    else:
        raise SystemExit("diagnose: give --input FILE, or --url URL with --model BF16_DIR")

    report = mismatch_report(mu_rows, pi_rows, advantages=adv, masks=masks, params=params)
    if recomputed is not None:
        report["sampler_recompute"] = recompute_agreement(mu_rows, recomputed)
    (out_dir / "report.json").write_text(json.dumps(report))
    lengths = [len(r) for r in mu_rows]
    mask = pad([[1.0] * n for n in lengths], name="mask").bool()
    if masks is not None:
        mask &= pad(masks, name="masks", lengths=lengths).bool()
    adv_t = None
    if adv is not None:
        adv_t = pad(adv, name="advantages", lengths=lengths) if adv and isinstance(adv[0], list) else torch.tensor(adv)
    plots = write_plots(pad(mu_rows, name="logp_sampler"), pad(pi_rows, name="logp_learner"), mask, out_dir,
                        advantages=adv_t, segment=params.risk_segment, depth_threshold=params.risk_depth,
                        flip_margin=params.flip_margin)
    m, t = report["metrics"], report["tail"]
    print(f"tokens {m['tokens']}  mean|gap| {m['mean_abs_gap']:.4f}  max|gap| {m['max_abs_gap']:.3f}  "
          f"kl {m['kl']:+.5f}  k3 {m['k3']:.5f}  chi2 {m['chi2']:.5f}  log-ppl diff {m['log_ppl_diff']:+.5f}")
    print(f"segments {t['segments']}  tail depth mean {t['tail_depth_mean']:.3f} max {t['tail_depth_max']:.3f}  "
          f"risky share {t['risky_share']:.3f}")
    if "directions" in report:
        print(f"flip share {report['directions']['flip_share']:.3f}")
    if "sampler_recompute" in report:
        r = report["sampler_recompute"]
        print(f"sampler decode vs its own recompute (/v1/logprobs): max |d| {r['max_abs']:.3g}  mean "
              f"{r['mean_abs']:.3g}  bitwise equal {r['equal_share']:.3f} of {r['tokens']} tokens")
    print("weights: " + "  ".join(f"{k} mean {v['mean']:.3f} zeroed {v['zeroed_share']:.3f}"
                                  for k, v in report["weight_summary"].items()))
    print(f"wrote {out_dir / 'report.json'} and {', '.join(p.name for p in plots)}")
    return 0
