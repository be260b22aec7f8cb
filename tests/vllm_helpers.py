"""Helpers shared by the vLLM engine tests: engine construction, prompt log-probs, torch reference."""
from __future__ import annotations

import gc
import os

import torch

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")        # GiB of KV cache per CPU engine

EXTENSION = "nvfp4_sampler.sampler_plugin.vllm.worker_extension.NVFP4SamplerWorkerExtension"
PROMPTS = ["The capital of France is Paris. The quick brown fox jumps over the lazy dog.",
           "def add(a, b):\n    return a + b\n",
           "Reinforcement learning trains a policy on samples drawn from the policy itself."]


def make_llm(model, **kwargs):
    """A vLLM CPU engine with the reload extension; prefix caching off so reloads never meet stale KV."""
    from vllm import LLM

    return LLM(str(model), max_model_len=256, enforce_eager=True, enable_prefix_caching=False, seed=0,
               worker_extension_cls=EXTENSION, **kwargs)


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
