"""Engine-agnostic configuration of the nvfp4_sampler quantization method.

`SamplerConfig` is what `quantization_config` in a checkpoint's config.json holds (quant_method
"nvfp4_sampler") and what `--quantization nvfp4_sampler` builds with defaults for online
quantization of a BF16 checkpoint; it belongs to the format contract (`sampler_format`) and is
re-exported here for the adapters.
"""
from __future__ import annotations

import torch

from nvfp4_sampler.sampler_format import ACTIVATION_SCALINGS, FORMAT_VERSION, METHOD_NAME, WEIGHT_RECIPES, SamplerConfig  # noqa: F401

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
