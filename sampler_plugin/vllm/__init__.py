"""vLLM adapter for the nvfp4_sampler quantization method (entry point `vllm.general_plugins`).

Thin: parameters and loaders per vLLM's layer API, everything else in `sampler_plugin.layers`.
"""


def register() -> None:
    """Register `nvfp4_sampler` and the `safetensors_file` weight-transfer backend with vLLM (called in
    every vLLM process)."""
    from . import config, file_transfer  # config registers the QuantizationConfig on import

    file_transfer.register()
