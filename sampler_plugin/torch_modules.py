"""Plain-torch NVFP4 modules and `quantize_model`: a transformers model made W4A4 in place.

The same layer operations as the engine adapters (`sampler_plugin.layers`), so a quantized
transformers model is the pure-torch forward that the plugins are tested against, and an embedded
engine for tools that need no vLLM. Every checkpoint tensor keeps its own second-level scale.
"""
from __future__ import annotations

import torch
from torch import nn

from nvfp4_sampler.kernels import NVFP4Tensor
from nvfp4_sampler.sampler_format import SamplerConfig, should_quantize

from . import layers


class NVFP4Linear(nn.Module):
    """y = x W^T + b with W [N, K] in NVFP4 and x quantized per config (per token by default)."""

    def __init__(self, weight: NVFP4Tensor, bias: torch.Tensor | None, config: SamplerConfig):
        super().__init__()
        self.codes = nn.Parameter(weight.codes, requires_grad=False)
        self.block_scales = nn.Parameter(weight.block_scales, requires_grad=False)
        self.global_scale = nn.Parameter(weight.global_scale, requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)
        self.config = config
        self.backend = layers.choose_backend(config, op="linear", name="NVFP4Linear", device=weight.codes.device,
                                             k=weight.codes.shape[-1] * 2)

    @classmethod
    def from_linear(cls, linear: nn.Linear, name: str, config: SamplerConfig, weights: bool = True,
                    device: torch.device | str | None = None) -> "NVFP4Linear":
        """Quantize `linear` (checkpoint prefix `name`) with config.recipe.weight and config.recipe.op_order
        into storage on `device` (default: the weight's); weights=False: the storage only
        (`layers.create_weight`: NaN scales until a checkpoint is written)."""
        n, k = linear.weight.shape
        w = layers.create_weight(n, k, device=device or linear.weight.device, name=name)
        if weights:
            layers.write(w, layers.Shard(name, (n, k), slice(0, n)), "weight", linear.weight.detach(), config=config)
        return cls(w, None if linear.bias is None else linear.bias.to(w.codes.device), config)

    def weight(self) -> NVFP4Tensor:
        return NVFP4Tensor(self.codes, self.block_scales, self.global_scale)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return layers.apply_linear(x, self.weight(), bias=self.bias, config=self.config, backend=self.backend)


class NVFP4Experts(nn.Module):
    """Stacked SwiGLU experts (transformers' `gate_up_proj` [E, 2I, H], `down_proj` [E, H, I]) in NVFP4.

    forward(hidden_states [T, H], top_k_index [T, k], top_k_weights [T, k]) -> [T, H], as the
    transformers experts module it replaces; routing stays the model's.
    """

    def __init__(self, w13: NVFP4Tensor, w2: NVFP4Tensor, config: SamplerConfig):
        super().__init__()
        self.w13 = nn.ParameterList([nn.Parameter(t, requires_grad=False) for t in dataclass_tensors(w13)])
        self.w2 = nn.ParameterList([nn.Parameter(t, requires_grad=False) for t in dataclass_tensors(w2)])
        self.config = config
        self.backend = layers.choose_backend(config, op="moe", name="NVFP4Experts", device=w13.codes.device,
                                             k=w13.codes.shape[-1] * 2)

    @classmethod
    def from_experts(cls, experts: nn.Module, name: str, config: SamplerConfig, weights: bool = True,
                     device: torch.device | str | None = None,
                     proj_names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")) -> "NVFP4Experts":
        """Quantize each expert's gate, up and down projection as its own checkpoint tensor (weights=False:
        the storage only, as `from_linear`)."""
        gate_up, down = experts.gate_up_proj.detach(), experts.down_proj.detach()   # [E, 2I, H], [E, H, I]
        e_count, two_i, hidden = gate_up.shape
        inter = two_i // 2
        w13 = layers.create_weight(two_i, hidden, experts=e_count, device=device or gate_up.device, name=name)
        w2 = layers.create_weight(hidden, inter, experts=e_count, global_per_row=False, device=device or down.device,
                                  name=name)
        gate, up, dn = proj_names
        for e in range(e_count if weights else 0):
            layers.write(w13, layers.Shard(f"{name}.{e}.{gate}", (inter, hidden), slice(0, inter), e), "weight",
                         gate_up[e, :inter], config=config)
            layers.write(w13, layers.Shard(f"{name}.{e}.{up}", (inter, hidden), slice(inter, two_i), e), "weight",
                         gate_up[e, inter:], config=config)
            layers.write(w2, layers.Shard(f"{name}.{e}.{dn}", (hidden, inter), slice(0, hidden), e), "weight",
                         down[e], config=config)
        return cls(w13, w2, config)

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        w13, w2 = (NVFP4Tensor(*p) for p in (self.w13, self.w2))
        return layers.apply_moe(hidden_states, w13, w2, top_k_weights, top_k_index, config=self.config,
                                backend=self.backend)


def dataclass_tensors(w: NVFP4Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return w.codes, w.block_scales, w.global_scale


def _is_stacked_experts(module: nn.Module) -> bool:
    """transformers >= 5 experts: 3-D `gate_up_proj` and `down_proj` parameters."""
    gate_up, down = getattr(module, "gate_up_proj", None), getattr(module, "down_proj", None)
    return isinstance(gate_up, nn.Parameter) and isinstance(down, nn.Parameter) and gate_up.dim() == 3


def quantize_model(model: nn.Module, config: SamplerConfig | None = None, *, weights: bool = True,
                   device: torch.device | str | None = None) -> dict[str, str]:
    """Replace, in place, every nn.Linear and stacked-experts module that `policy.should_quantize`
    selects by its NVFP4 counterpart (names are the checkpoint's module prefixes), its storage on `device`
    (default: the module's). weights=False: the NVFP4 storage only, for a checkpoint written next (the
    modules' BF16 values are never read: a model built without initialization, its pages never touched;
    `layers.LoadTracker` names what such a checkpoint left unwritten).

    Returns {module name: "linear" | "experts"} of the replaced modules.
    """
    config = config or SamplerConfig()
    replaced: dict[str, str] = {}
    for name, module in list(model.named_modules()):
        if not name or not should_quantize(name, config):
            continue
        if isinstance(module, nn.Linear):
            new, kind = NVFP4Linear.from_linear(module, name, config, weights, device), "linear"
        elif _is_stacked_experts(module):
            new, kind = NVFP4Experts.from_experts(module, name, config, weights, device), "experts"
        else:
            continue
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, child, new)
        replaced[name] = kind
    return replaced
