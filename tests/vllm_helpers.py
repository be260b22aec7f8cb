"""Helpers shared by the vLLM engine tests: engine construction, prompt log-probs, torch reference."""
from __future__ import annotations

import gc
import os

import torch

from nvfp4_sampler.testing import models

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")        # GiB of KV cache per CPU engine

EXTENSION = "nvfp4_sampler.sampler_plugin.vllm.worker_extension.NVFP4SamplerWorkerExtension"
PROMPTS = ["The capital of France is Paris. The quick brown fox jumps over the lazy dog.",
           "def add(a, b):\n    return a + b\n",
           "Reinforcement learning trains a policy on samples drawn from the policy itself."]


def seed_checkpoints(folder, build) -> dict:
    """Seeds 0 and 1 of a tiny model (`build(path, seed=)`) in BF16 ("bf16_0", "bf16_1") and pre-quantized
    ("pq_0", "pq_1") under `folder` ("dir")."""
    paths = {f"bf16_{s}": build(folder / f"bf16_{s}", seed=s) for s in (0, 1)}
    paths |= {f"pq_{s}": models.write_prequantized(paths[f"bf16_{s}"], folder / f"pq_{s}") for s in (0, 1)}
    return paths | {"dir": folder}


def group_trainer(port: int, size: int, updates: list[dict[str, torch.Tensor]], *, timeout_s: float = 120
                  ) -> tuple[dict[int, int], list[bool]]:
    """The trainer's side of weight-group updates: rank 0 of a gloo `server.broadcast.WeightGroup` of `size` (the
    engine's workers the others), per-rank plans of the first update's names, then each update. Returns ({rank: its
    plan's bytes, 0: the whole plan's}, [whether each update was applied everywhere])."""
    from nvfp4_sampler.server import broadcast
    from nvfp4_sampler.server.plan import TransferPlan
    from nvfp4_sampler.server.wire import iter_entries

    group = broadcast.WeightGroup("127.0.0.1", port, 0, size, backend="gloo", timeout_s=timeout_s)
    full = TransferPlan.build(iter_entries(updates[0]), bucket_bytes=1 << 16)
    plans = broadcast.share_rank_plans(full, None, group)
    sent = [broadcast.send_rank_updates(plans, u, group) for u in updates]
    return {r: p.plan.nbytes for r, p in plans.items()} | {0: full.nbytes}, sent


def make_llm(model, **kwargs):
    """A vLLM CPU engine with the reload extension; prefix caching off so reloads never meet stale KV."""
    from vllm import LLM

    kwargs.setdefault("worker_extension_cls", EXTENSION)
    return LLM(str(model), max_model_len=256, enforce_eager=True, enable_prefix_caching=False, seed=0, **kwargs)


def shutdown(llm) -> None:
    llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()


def token_ids(model, prompts=PROMPTS) -> list[list[int]]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model))
    return [tok(p).input_ids for p in prompts]


def prompt_logprobs(llm, ids: list[list[int]]) -> torch.Tensor:
    """float64 [sum(len - 1)]: log p(token_t | tokens_<t) of every prompt token after the first."""
    from vllm import SamplingParams

    outs = llm.generate([{"prompt_token_ids": i} for i in ids], SamplingParams(max_tokens=1, prompt_logprobs=0),
                        use_tqdm=False)
    return torch.tensor([d[t].logprob for o, i in zip(outs, ids) for d, t in zip(o.prompt_logprobs[1:], i[1:])],
                        dtype=torch.float64)


def greedy(llm, ids: list[list[int]], n: int = 8) -> list[list[int]]:
    from vllm import SamplingParams

    outs = llm.generate([{"prompt_token_ids": i} for i in ids], SamplingParams(max_tokens=n, temperature=0,
                                                                                ignore_eos=True), use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def reference_model(model, *, dtype=torch.float32, state: dict[str, torch.Tensor] | None = None, config=None):
    """The HF model (optionally with `state` tensors replacing checkpoint tensors), W4A4 via
    quantize_model under `config` (a SamplerConfig; default options when None)."""
    from transformers import AutoModelForCausalLM

    from nvfp4_sampler.sampler_plugin.torch_modules import quantize_model

    m = AutoModelForCausalLM.from_pretrained(str(model), dtype=dtype)
    if state:
        m.load_state_dict(state, strict=False)
    quantize_model(m, config)
    return m.eval()


@torch.no_grad()
def reference_logprobs(m, ids: list[list[int]]) -> torch.Tensor:
    out = []
    for i in ids:
        x = torch.tensor([i])
        lp = m(x).logits.double().log_softmax(-1)[0, :-1]
        out.append(lp.gather(-1, x[0, 1:, None]).squeeze(-1))
    return torch.cat(out)


@torch.no_grad()
def reference_greedy(m, ids: list[list[int]], n: int = 8) -> list[list[int]]:
    outs = []
    for i in ids:
        x = torch.tensor([i])
        for _ in range(n):
            x = torch.cat([x, m(x).logits[:, -1:].argmax(-1)], dim=1)
        outs.append(x[0, len(i):].tolist())
    return outs


# Greedy decode of two implementations (engine vs torch forward, compiled vs eager) is compared ALONG
# THE ENGINE'S OWN PATH, never token for token: free-running decodes part for good at the first near-tie
# that the two resolve differently, and every later token then differs (a fresh clone's dense test
# chose 278 where the reference chose 223, 3.9e-3 nats apart: the reference's top two on this
# machine are -3.9810 and -3.9849). A greedy token costs at most 2*delta under the reference when
# every log-prob of its step is within delta of the engine's; delta is ~1e-6 here (TOL = 1e-3 is
# asserted on the prompts), but a W4A4 code flip in a generated context can move it further (the
# 278/223 step needed delta >= 2e-3; on one machine a flip three tokens earlier moved later log-probs by up
# to 0.22 nats while the greedy regret stayed 3.9e-3), so NEAR_TIE = 1e-2 allows 2.5x that step. A clear wrong choice
# costs far more: the reference's top-two gap on the tiny random models is 3.9e-3..0.8 nats (median
# ~0.1) over their 24 greedy steps; a perturbed token or an off-by-one position costs 1.9..5.1 nats.
NEAR_TIE = 1e-2


@torch.no_grad()
def greedy_regret(m, ids: list[list[int]], outs: list[list[int]]) -> list[torch.Tensor]:
    """Per prompt, float64 [len(out)]: the reference's max log-prob minus its log-prob of the engine's
    token at each generated step, `m` teacher-forced on prompt + the engine's own generated tokens."""
    regrets = []
    for i, o in zip(ids, outs, strict=True):
        x = torch.tensor([i + o])
        lp = m(x).logits.double().log_softmax(-1)[0, len(i) - 1:-1]          # predicts o[0], ..., o[-1]
        regrets.append(lp.max(-1).values - lp.gather(-1, torch.tensor(o)[:, None]).squeeze(-1))
    return regrets


def assert_greedy_along_own_path(m, ids: list[list[int]], outs: list[list[int]], tol: float = NEAR_TIE,
                                 n: int = 8) -> float:
    """Every greedy token of an engine (`outs`, n per prompt) is the argmax of the reference `m` fed the
    engine's own sequence, up to a near-tie of `tol` nats; returns the largest regret (0 = same tokens)."""
    assert [len(o) for o in outs] == [n] * len(ids), [len(o) for o in outs]
    worst = 0.0
    for k, (o, r) in enumerate(zip(outs, greedy_regret(m, ids, outs))):
        t = int(r.argmax())
        assert r[t] <= tol, (f"prompt {k}, step {t}: engine token {o[t]} is {r[t]:.3e} nats below the "
                             f"reference's argmax (near-tie tolerance {tol:.0e}); engine tokens {o}")
        worst = max(worst, float(r[t]))
    return worst


def decode_and_recompute(llm, ids: list[list[int]], params) -> tuple[list[list[float]], list[list[float]]]:
    """Generate from the prompts `ids` with SamplingParams `params` (logprobs=0), then recompute every
    prompt + generated sequence in one prefill batch (prompt_logprobs): per prompt, the log-probs the
    engine returned for its generated tokens while decoding, and those tokens' prompt log-probs."""
    from vllm import SamplingParams

    outs = llm.generate([{"prompt_token_ids": i} for i in ids], params, use_tqdm=False)
    gens = [list(o.outputs[0].token_ids) for o in outs]
    decoded = [[d[t].logprob for d, t in zip(o.outputs[0].logprobs, g)] for o, g in zip(outs, gens)]
    again = llm.generate([{"prompt_token_ids": i + g} for i, g in zip(ids, gens)],
                         SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)
    recomputed = [[d[t].logprob for d, t in zip(o.prompt_logprobs[len(i):], g)] for o, i, g in zip(again, ids, gens)]
    return decoded, recomputed
