"""Engine-agnostic configuration of the nvfp4_sampler quantization method.

It is what `quantization_config` in a checkpoint's config.json holds (quant_method
"nvfp4_sampler") and what `--quantization nvfp4_sampler` builds with defaults for online
quantization of a BF16 checkpoint.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import torch

METHOD_NAME = "nvfp4_sampler"
FORMAT_VERSION = 1
ACTIVATION_SCALINGS = ("per_token", "per_tensor")
WEIGHT_RECIPES = ("1d", "2d")


@dataclasses.dataclass(frozen=True)
class SamplerConfig:
    """activation_scaling: "per_token" (default; a token's codes ignore its batch neighbours) or
    "per_tensor" (dynamic, one scale per batch: for comparison only).
    weight_recipe: "1d" (1x16 blocks) or "2d" (16x16 tiles, TransformerEngine's weight recipe).
    keep_bf16: module-name prefixes left unquantized, on top of lm_head, embeddings and MoE routers.
    backend: "auto" or a kernels.dispatch backend name.
    prequantized: True when the checkpoint holds NVFP4 codes and scales (written by the converter).
    """

    activation_scaling: str = "per_token"
    weight_recipe: str = "1d"
    keep_bf16: tuple[str, ...] = ()
    backend: str = "auto"
    prequantized: bool = False

    def __post_init__(self):
        if self.activation_scaling not in ACTIVATION_SCALINGS:
            raise ValueError(f"{METHOD_NAME}: activation_scaling must be one of {ACTIVATION_SCALINGS}, "
                             f"got {self.activation_scaling!r}")
        if self.weight_recipe not in WEIGHT_RECIPES:
            raise ValueError(f"{METHOD_NAME}: weight_recipe must be one of {WEIGHT_RECIPES}, got {self.weight_recipe!r}")
        if isinstance(self.keep_bf16, str) or not all(isinstance(p, str) for p in self.keep_bf16):
            raise ValueError(f"{METHOD_NAME}: keep_bf16 must be a list of module-name prefixes, got {self.keep_bf16!r}")
        object.__setattr__(self, "keep_bf16", tuple(self.keep_bf16))

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "SamplerConfig":
        """Parse a `quantization_config` dict; unknown keys and a wrong format_version raise ValueError."""
        d = dict(d)
        method = d.pop("quant_method", METHOD_NAME)
        if method != METHOD_NAME:
            raise ValueError(f"quant_method must be {METHOD_NAME!r}, got {method!r}")
        version = d.pop("format_version", FORMAT_VERSION)
        if version != FORMAT_VERSION:
            raise ValueError(f"{METHOD_NAME}: format_version {version} is not supported (this build reads {FORMAT_VERSION})")
        fields = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - fields)
        if unknown:
            raise ValueError(f"{METHOD_NAME}: unknown quantization_config option(s) {unknown}; known: {sorted(fields)}")
        if "keep_bf16" in d and isinstance(d["keep_bf16"], list):
            d["keep_bf16"] = tuple(d["keep_bf16"])
        return cls(**d)

    def to_dict(self) -> dict[str, Any]:
        """The `quantization_config` dict written into a sampler checkpoint's config.json."""
        d = dataclasses.asdict(self)
        d["keep_bf16"] = list(self.keep_bf16)
        return {"quant_method": METHOD_NAME, "format_version": FORMAT_VERSION, **d}


class EngineConfigBasics:
    """The answers vLLM's and SGLang's QuantizationConfig both ask for, identical in both engines.

    Engine adapters list it before their engine's QuantizationConfig base class.
    """

    def get_name(self) -> str:
        return METHOD_NAME

    def get_supported_act_dtypes(self) -> list[torch.dtype]:
        return [torch.bfloat16, torch.float16, torch.float32]

    @classmethod
    def get_min_capability(cls) -> int:
        return 0      # the torch reference backend runs on every device

    @staticmethod
    def get_config_filenames() -> list[str]:
        return []     # quantization_config lives in config.json; none: online quantization
