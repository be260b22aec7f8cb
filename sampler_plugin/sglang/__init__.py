"""SGLang adapter for the nvfp4_sampler quantization method (entry point `sglang.srt.plugins`)."""


def register() -> None:
    """Register `nvfp4_sampler` with SGLang."""
    raise NotImplementedError("SGLang adapter is not built yet")
