"""vLLM adapter for the nvfp4_sampler quantization method (entry point `vllm.general_plugins`).

Thin: parameters and loaders per vLLM's layer API, everything else in `sampler_plugin.layers`.
"""


def register() -> None:
    """Register `nvfp4_sampler` with vLLM (called in every vLLM process)."""
    from . import config  # noqa: F401  (registers the QuantizationConfig on import)
