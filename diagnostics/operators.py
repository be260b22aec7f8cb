"""Operator layer: what each quantized operator saw and produced on the learner side vs the sampler
side, aligned by (sequence, position) and, for MoE, by (token, expert id).

Both sides are plain-torch models made NVFP4 by `sampler_plugin.torch_modules.quantize_model` (the
learner-side computation and the embedded engine): `record(model)` hooks every `NVFP4Linear` and
`NVFP4Experts` and keeps, per call, the activation input and the codes / block scales / global scale
the op quantized it to (with the module's own config, per call, so per-tensor scaling sees exactly
the tensor the op saw). `teacher_forced` runs a whole sequence in one forward (the learner);
`decode` feeds the same tokens one at a time through the KV cache (the sampler). `compare` aligns
the two traces and reports, per layer, separately:

  act_code_mismatch     share of activation elements whose E2M1 code differs
  act_scale_mismatch    share of 16-element blocks whose E4M3 scale differs
  act_global_mismatch   share of rows (tokens) whose second-level scale differs
  input_rel_err         ||x_learner - x_sampler|| / ||x_sampler|| of the op's input (upstream drift)
  positions             (sequence, position) of every token with a code or scale mismatch
MoE layers add, on the (token, expert) pairs both sides routed to:
  routing_flip_rate     share of (token, slot) choices of the learner that the sampler did not make
                        (expert ids compared as sets: a permuted order is no flip)
  expert_out_rel_err    mean ||y_l - y_s|| / ||y_s|| of the expert outputs for the shared pairs
  expert_out_exact      share of shared pairs whose expert output is bit-identical
  routing_weight_max_diff  max |w_l - w_s| of the routing weights of shared pairs
"""
from __future__ import annotations

import dataclasses

import torch

from nvfp4_sampler.kernels import reference as R
from nvfp4_sampler.kernels.format import NVFP4Tensor
from nvfp4_sampler.sampler_plugin.torch_modules import NVFP4Experts, NVFP4Linear


@dataclasses.dataclass
class Quantized:
    """One operator input of a whole sequence: x [T, K] (input dtype), codes uint8 [T, K] (unpacked),
    scales float8_e4m3fn [T, K/16], global_scale float32 [T] (per row, also for per-tensor scaling)."""

    x: torch.Tensor
    codes: torch.Tensor
    scales: torch.Tensor
    global_scale: torch.Tensor

    @classmethod
    def of(cls, x: torch.Tensor, *, scaling: str, op_order: str = "vllm") -> "Quantized":
        """Quantize one call's input x [M, K] as the op does."""
        q = R.quantize_activations(x, scaling=scaling, op_order=op_order)
        return cls(x, R.unpack_nibbles(q.codes), q.block_scales, q.row_global_scale().contiguous())

    @classmethod
    def cat(cls, parts: list["Quantized"]) -> "Quantized":
        return cls(*(torch.cat([getattr(p, f.name) for p in parts]) for f in dataclasses.fields(cls)))


@dataclasses.dataclass
class MoeCall:
    """Routing of one sequence through one MoE layer: topk_ids int64 [T, k], topk_weights float [T, k]."""

    topk_ids: torch.Tensor
    topk_weights: torch.Tensor


@dataclasses.dataclass
class Trace:
    """Per module name, the whole sequence's operator inputs (rows = positions 0..T-1)."""

    acts: dict[str, Quantized]
    moe: dict[str, MoeCall]
    logprobs: torch.Tensor | None = None       # float32 [T-1]: log p(token t+1 | tokens <= t)


class Recorder:
    """Forward hooks on the NVFP4 modules of `model`; every call appends to `calls[name]`."""

    def __init__(self, model: torch.nn.Module):
        self.calls: dict[str, list[Quantized]] = {}
        self.routes: dict[str, list[MoeCall]] = {}
        self.modules = {n: m for n, m in model.named_modules() if isinstance(m, (NVFP4Linear, NVFP4Experts))}
        self._handles = []

    def _hook(self, name: str):
        def hook(module, args, kwargs, out):
            x = args[0] if args else kwargs["hidden_states"]
            x2 = x.detach().reshape(-1, x.shape[-1])
            self.calls.setdefault(name, []).append(Quantized.of(x2, scaling=module.config.recipe.activation_scaling,
                                                                op_order=module.config.recipe.op_order))
            if isinstance(module, NVFP4Experts):
                ids = args[1] if len(args) > 1 else kwargs["top_k_index"]
                w = args[2] if len(args) > 2 else kwargs["top_k_weights"]
                self.routes.setdefault(name, []).append(MoeCall(ids.detach().long(), w.detach()))
        return hook

    def __enter__(self) -> "Recorder":
        for name, m in self.modules.items():
            self._handles.append(m.register_forward_hook(self._hook(name), with_kwargs=True))
        return self

    def __exit__(self, *exc) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def trace(self) -> Trace:
        """Concatenate the calls of one sequence (batch size 1) along positions."""
        return Trace({n: Quantized.cat(c) for n, c in self.calls.items()},
                     {n: MoeCall(torch.cat([c.topk_ids for c in cs]), torch.cat([c.topk_weights for c in cs]))
                      for n, cs in self.routes.items()})


def record(model: torch.nn.Module) -> Recorder:
    return Recorder(model)


def model_device(model: torch.nn.Module) -> torch.device:
    """The device of a model's parameters (where its inputs go)."""
    return next(model.parameters()).device


def _token_logprobs(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """logits [T-1, V], tokens [T-1] -> float32 [T-1]."""
    return torch.log_softmax(logits.float(), -1).gather(1, tokens[:, None])[:, 0]


@torch.no_grad()
def teacher_forced(model: torch.nn.Module, tokens: list[int]) -> Trace:
    """The learner side: one forward over the whole sequence (batch 1), on the model's device."""
    ids = torch.tensor([tokens], device=model_device(model))
    with record(model) as rec:
        logits = model(input_ids=ids).logits[0, :-1]
    tr = rec.trace()
    tr.logprobs = _token_logprobs(logits, ids[0, 1:])
    return tr


@torch.no_grad()
def decode(model: torch.nn.Module, tokens: list[int], *, prefill: int = 1) -> Trace:
    """The sampler side (batch 1): tokens[:prefill] (the prompt) in one forward, then every further
    token alone through the KV cache, as a sampler decodes its response."""
    from transformers import DynamicCache

    if not 1 <= prefill <= len(tokens):
        raise ValueError(f"prefill must be in [1, {len(tokens)}], got {prefill}")
    cache, dev = DynamicCache(), model_device(model)
    rows = []
    with record(model) as rec:
        out = model(input_ids=torch.tensor([tokens[:prefill]], device=dev), past_key_values=cache, use_cache=True)
        cache, rows = out.past_key_values, list(out.logits[0])
        for t in tokens[prefill:]:
            out = model(input_ids=torch.tensor([[t]], device=dev), past_key_values=cache, use_cache=True)
            cache = out.past_key_values
            rows.append(out.logits[0, -1])
    tr = rec.trace()
    tr.logprobs = _token_logprobs(torch.stack(rows[:-1]), torch.tensor(tokens[1:], device=dev))
    return tr


# --------------------------------------------------------------------------- comparison

def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp(min=1e-30))


def compare_acts(learner: Quantized, sampler: Quantized) -> dict:
    """Aligned rows of one operator (row t = position t of one sequence): mismatch shares and the
    positions that differ (module docstring)."""
    if learner.codes.shape != sampler.codes.shape:
        raise ValueError(f"traces are not aligned: learner codes {tuple(learner.codes.shape)} vs sampler "
                         f"{tuple(sampler.codes.shape)}")
    code = learner.codes != sampler.codes                                       # [T, K]
    scale = learner.scales.view(torch.uint8) != sampler.scales.view(torch.uint8)   # [T, K/16]
    glob = learner.global_scale != sampler.global_scale                         # [T]
    bad = code.any(-1) | scale.any(-1) | glob
    return {"act_code_mismatch": float(code.double().mean()), "act_scale_mismatch": float(scale.double().mean()),
            "act_global_mismatch": float(glob.double().mean()), "input_rel_err": _rel(learner.x, sampler.x),
            "positions": bad.nonzero()[:, 0].tolist()}


def _expert_outputs(module: NVFP4Experts, x: torch.Tensor, tok: torch.Tensor, expert: torch.Tensor) -> torch.Tensor:
    """Output [P, H] float32 of expert expert[p] on token row x[tok[p]] (routing weight 1), per pair."""
    w13 = NVFP4Tensor(*module.w13)
    w2 = NVFP4Tensor(*module.w2)
    out = torch.empty(tok.numel(), x.shape[-1], device=x.device)
    for e in expert.unique().tolist():
        sel = (expert == e).nonzero()[:, 0]
        ids = torch.full((sel.numel(), 1), e, dtype=torch.long, device=x.device)
        out[sel] = R.moe(x[tok[sel]], w13, w2, torch.ones(sel.numel(), 1, device=x.device), ids, op_order=module.config.recipe.op_order).float()
    return out


def compare_routing(learner: MoeCall, sampler: MoeCall) -> dict:
    """Routing of the same tokens [T, k] on both sides, expert ids compared as sets per token.

    Returns the flip rate, the shared (token, expert) pairs as (tok, expert, learner slot, sampler slot)
    int64 tensors [P], and the max routing-weight difference over them."""
    li, si = learner.topk_ids, sampler.topk_ids
    if li.shape != si.shape:
        raise ValueError(f"routing is not aligned: learner {tuple(li.shape)} vs sampler {tuple(si.shape)}")
    match = li[:, :, None] == si[:, None, :]                                    # [T, k(l), k(s)]
    tok, l_slot, s_slot = match.nonzero(as_tuple=True)
    flips = ~match.any(-1)                                                      # learner choices not taken
    wl = learner.topk_weights[tok, l_slot].float()
    ws = sampler.topk_weights[tok, s_slot].float()
    return {"routing_flip_rate": float(flips.double().mean()),
            "routing_flip_tokens": flips.any(-1).nonzero()[:, 0].tolist(),
            "routing_weight_max_diff": float((wl - ws).abs().max()) if tok.numel() else 0.0,
            "pairs": (tok, li[tok, l_slot], l_slot, s_slot)}


def compare_moe(module: NVFP4Experts, learner_x: Quantized, sampler_x: Quantized, learner: MoeCall,
                sampler: MoeCall) -> dict:
    """Routing flips and, on the (token, expert) pairs both sides chose, the expert-output error."""
    r = compare_routing(learner, sampler)
    tok, expert, _, _ = r.pop("pairs")
    yl = _expert_outputs(module, learner_x.x, tok, expert)
    ys = _expert_outputs(module, sampler_x.x, tok, expert)
    err = (yl.double() - ys.double()).norm(dim=-1) / ys.double().norm(dim=-1).clamp(min=1e-30)
    return {**r, "shared_pairs": int(tok.numel()), "expert_out_rel_err": float(err.mean()) if tok.numel() else 0.0,
            "expert_out_exact": float((yl == ys).all(-1).double().mean()) if tok.numel() else 1.0}


def compare(model: torch.nn.Module, learner: Trace, sampler: Trace, *, sequence: int = 0) -> dict[str, dict]:
    """Per module name (in model order): `compare_acts` and, for MoE layers, `compare_moe`. Positions
    are reported as (sequence, position) pairs."""
    out: dict[str, dict] = {}
    for name, module in model.named_modules():
        if name not in learner.acts:
            continue
        row = compare_acts(learner.acts[name], sampler.acts[name])
        row["positions"] = [(sequence, p) for p in row["positions"]]
        if name in learner.moe:
            row |= compare_moe(module, learner.acts[name], sampler.acts[name], learner.moe[name], sampler.moe[name])
            row["routing_flip_tokens"] = [(sequence, p) for p in row["routing_flip_tokens"]]
        out[name] = row
    return out


def compare_weights(learner: NVFP4Tensor, sampler: NVFP4Tensor) -> dict[str, float]:
    """Code / block-scale / global-scale mismatch shares of one weight quantized by the learner's
    recipe vs the sampler's (e.g. TE 2D vs 1D re-quantization: the checkpoint-conversion error)."""
    if learner.codes.shape != sampler.codes.shape:
        raise ValueError(f"weights differ in shape: {tuple(learner.shape)} vs {tuple(sampler.shape)}")
    cl, cs = R.unpack_nibbles(learner.codes), R.unpack_nibbles(sampler.codes)
    return {"weight_code_mismatch": float((cl != cs).double().mean()),
            "weight_scale_mismatch": float((learner.block_scales.view(torch.uint8)
                                            != sampler.block_scales.view(torch.uint8)).double().mean()),
            "weight_global_mismatch": float((learner.row_global_scale() != sampler.row_global_scale()).double().mean()),
            "weight_rel_err": _rel(R.dequantize(learner), R.dequantize(sampler))}
