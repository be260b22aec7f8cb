"""Engine-agnostic configuration of the nvfp4_sampler quantization method.

`SamplerConfig` is what `quantization_config` in a checkpoint's config.json holds (quant_method
"nvfp4_sampler") and what `--quantization nvfp4_sampler` builds with defaults for online
quantization of a BF16 checkpoint; it belongs to the format contract (`sampler_format`) and is
re-exported here for the adapters.
"""
from __future__ import annotations

from nvfp4_sampler.sampler_format import ACTIVATION_SCALINGS, FORMAT_VERSION, METHOD_NAME, WEIGHT_RECIPES, SamplerConfig  # noqa: F401
