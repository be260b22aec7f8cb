"""Operator inputs inside a running engine, for the operator layer (`diagnostics.operators`).

Functions for vLLM's `LLM.collective_rpc(fn)`: each takes the engine's worker, finds its model
(`worker.model_runner.model`) and hooks the linear layers whose inputs the NVFP4 ops quantize
(`qkv_proj`, `o_proj`, `gate_up_proj`, `down_proj`; fused layers get the input of their shards).
Hooks copy each call's input x [tokens, K] and output y [tokens, N] to the CPU; `collect` returns
{layer name: [(x, y) per call]} and clears. Duck-typed on torch modules: no engine import here. Diagnostics only: hooks add a device ->
host copy per layer and call, and need eager mode (no CUDA graphs, no torch.compile).
"""
from __future__ import annotations

import torch

HOOKED_SUFFIXES = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
_STATE: dict[str, object] = {"calls": {}, "handles": []}


def _model(worker) -> torch.nn.Module:
    runner = getattr(worker, "model_runner", None)
    model = getattr(runner, "model", None)
    if model is None:
        raise RuntimeError(f"{type(worker).__name__}: no model_runner.model to hook")
    return model


def install(worker) -> int:
    """Hook every layer of HOOKED_SUFFIXES; returns how many."""
    remove(worker)
    calls: dict[str, list[tuple[torch.Tensor, torch.Tensor]]] = {}
    _STATE["calls"] = calls
    for name, module in _model(worker).named_modules():
        if name.endswith(HOOKED_SUFFIXES):
            def hook(mod, args, out, name=name):
                x, y = args[0], out[0] if isinstance(out, tuple) else out     # vLLM linears return (y, bias)
                calls.setdefault(name, []).append((x.detach().reshape(-1, x.shape[-1]).to("cpu", copy=True),
                                                   y.detach().reshape(-1, y.shape[-1]).to("cpu", copy=True)))
            _STATE["handles"].append(module.register_forward_hook(hook))
    return len(_STATE["handles"])


def collect(worker) -> dict[str, list[tuple[torch.Tensor, torch.Tensor]]]:
    """The (input, output) pairs recorded since install / the last collect, per layer (in call order); clears them."""
    out = {k: list(v) for k, v in _STATE["calls"].items()}
    _STATE["calls"].clear()
    return out


def remove(worker) -> None:
    for h in _STATE["handles"]:
        h.remove()
    _STATE["handles"] = []
