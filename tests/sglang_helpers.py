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


def bucket_payloads(tensors: dict[str, torch.Tensor], *, inline: bool = False) -> list[str]:
    """`update_weights_from_tensor(load_format="flattened_bucket")` payload (one entry per TP rank), as miles
    builds it: SGLang's FlattenedTensorBucket of all dtypes, serialized by MultiprocessingSerializer (base64).
    inline: pickled with the data inside (`inline_payload`), for a server in another process."""
    from sglang.srt.utils import MultiprocessingSerializer
    from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket

    bucket = FlattenedTensorBucket(named_tensors=list(tensors.items()))
    data = {"flattened_tensor": bucket.get_flattened_tensor(), "metadata": bucket.get_metadata()}
    return inline_payload(data) if inline else [MultiprocessingSerializer.serialize(data, output_str=True)]


def inline_payload(obj) -> list[str]:
    """`serialized_named_tensors` (one TP rank) holding `obj` pickled with its tensor data inside, base64:
    on CPU, torch's shared-memory handles do not cross unrelated processes (a GPU trainer sends CUDA IPC
    handles); SGLang's SafeUnpickler accepts plain tensor pickles."""
    import base64
    import pickle

    return [base64.b64encode(pickle.dumps(obj)).decode()]


def save_checkpoint(tensors: dict[str, torch.Tensor], path) -> Path:
    """`tensors` as one safetensors file in folder `path` (a full or partial checkpoint, for
    update_weights_from_disk)."""
    from safetensors.torch import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    save_file({n: t.contiguous() for n, t in tensors.items()}, path / "model.safetensors", metadata={"format": "pt"})
    return path


def bad_updates(bf16: dict[str, torch.Tensor], pq: dict[str, torch.Tensor], *, quantized: str, plain: str,
                triplet: str) -> dict[str, tuple[dict[str, torch.Tensor], str]]:
    """Updates that hold the `bf16` checkpoint's tensors first and one bad tensor last:
    {case: (named tensors, what the error must say)}. quantized: a quantized checkpoint tensor's prefix;
    plain: a BF16 tensor (a norm); triplet: a prefix sent as the NVFP4 triplet taken from `pq`."""
    w = bf16[f"{quantized}.weight"]
    nan = w.clone()
    nan.view(-1)[-1] = float("nan")
    codes, scale, scale_2 = (pq[f"{triplet}.{k}"] for k in ("weight", "weight_scale", "weight_scale_2"))
    cases = {
        "shape": ({f"{quantized}.weight": w[:, :-16]}, f"{quantized}.weight: shape"),
        "nan": ({f"{quantized}.weight": nan}, f"{quantized}.weight: contains NaN or Inf"),
        "plain_shape": ({plain: bf16[plain][:-1]}, f"{plain}: AssertionError"),
        "plain_inf": ({plain: torch.full_like(bf16[plain], float("inf"))}, f"{plain}: contains NaN or Inf"),
        "unknown": ({"model.layers.0.mlp.no_such_proj.weight": w},
                    "model.layers.0.mlp.no_such_proj.weight: no parameter"),
        "scale_dtype": ({f"{triplet}.weight": codes, f"{triplet}.weight_scale": scale.float(),
                         f"{triplet}.weight_scale_2": scale_2}, f"{triplet}.weight_scale: dtype torch.float32"),
        "incomplete_triplet": ({f"{triplet}.weight": codes, f"{triplet}.weight_scale": scale},
                               f"{triplet}.weight_scale_2: an update of {triplet} holds either"),
    }
    return {case: ({**{n: t for n, t in bf16.items() if n not in bad}, **bad}, said)
            for case, (bad, said) in cases.items()}
