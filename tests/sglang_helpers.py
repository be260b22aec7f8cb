"""Harness of the SGLang engine tests (run in the SGLang venv: `make venv-sglang`, then
`flock /tmp/nvfp4-engine.lock .venv-sglang/bin/python -m pytest -q tests/test_sglang_*.py`).

SGLang 0.5.23 runs on a CPU-only torch here with two test-only helpers from tests/sglang_stubs,
put on PYTHONPATH for the engine's spawned processes too: a torchvision import stub, and a
`sglang.srt.plugins` entry point (sglang_cpu_harness) that selects torch-native rotary embeddings.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

import torch

STUBS = Path(__file__).parent / "sglang_stubs"
if str(STUBS) not in sys.path:
    sys.path.insert(0, str(STUBS))
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(STUBS), os.environ.get("PYTHONPATH")) if p)

# SGLang on CPU: torch-native attention and sampling, no CUDA graphs, a small KV pool (the default
# sizes it from free RAM and takes ~30 s to allocate).
ENGINE_ARGS = dict(device="cpu", attention_backend="torch_native", sampling_backend="pytorch", disable_cuda_graph=True,
                   max_total_tokens=4096, random_seed=0, log_level="error")


def make_engine(model, **kwargs):
    """An in-process SGLang CPU engine (`sgl.Engine`) with ENGINE_ARGS plus kwargs."""
    import sglang as sgl

    return sgl.Engine(model_path=str(model), **ENGINE_ARGS, **kwargs)


def server_command(model, *, port: int, **kwargs) -> list[str]:
    """`python -m sglang.launch_server` on 127.0.0.1:port with ENGINE_ARGS plus kwargs, as argv."""
    argv = [sys.executable, "-m", "sglang.launch_server", "--model-path", str(model), "--host", "127.0.0.1",
            "--port", str(port)]
    for key, value in {**ENGINE_ARGS, **kwargs}.items():
        flag = "--" + key.replace("_", "-")
        argv += [flag] if value is True else [flag, str(value)]
    return argv


def logprobs_from_outputs(outs: list[dict], ids: list[list[int]]) -> torch.Tensor:
    """float64 [sum(len - 1)] from SGLang generate outputs with return_logprob and logprob_start_len=0."""
    lps = []
    for out, i in zip(outs, ids):
        entries = out["meta_info"]["input_token_logprobs"]          # [(logprob, token_id, text)]
        assert [tok for _, tok, _ in entries] == i
        lps += [lp for lp, _, _ in entries[1:]]
    return torch.tensor(lps, dtype=torch.float64)


GREEDY_ONE = {"max_new_tokens": 1, "temperature": 0}


def prompt_logprobs(engine, ids: list[list[int]]) -> torch.Tensor:
    """float64 [sum(len - 1)]: log p(token_t | tokens_<t) of every prompt token after the first."""
    outs = engine.generate(input_ids=ids, sampling_params=GREEDY_ONE, return_logprob=True, logprob_start_len=0)
    return logprobs_from_outputs(outs, ids)


def checkpoint_tensors(path) -> dict[str, torch.Tensor]:
    """Every checkpoint tensor of the HF folder `path` (all safetensors shards)."""
    from safetensors.torch import load_file

    return {n: t for f in sorted(Path(path).glob("*.safetensors")) for n, t in load_file(f).items()}


def update(engine, tensors: dict[str, torch.Tensor]) -> None:
    """One SGLang weight-update session: begin, update_weights_from_tensor(checkpoint-named tensors), end."""
    steps = (("begin_weight_update", engine.begin_weight_update),
             ("update_weights_from_tensor", lambda: engine.update_weights_from_tensor(list(tensors.items()))),
             ("end_weight_update", engine.end_weight_update))
    for step, call in steps:
        success, message = call()
        assert success, f"{step}: {message}"

