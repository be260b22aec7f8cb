"""SGLang adapter for the nvfp4_sampler quantization method (entry point `sglang.srt.plugins`).

Thin: parameters and loaders per SGLang's layer API, everything else in `sampler_plugin.layers`.
SGLang runs `register` in every process (CLI, Engine, tokenizer, scheduler) before it parses
`--quantization` or builds a model.
"""
from nvfp4_sampler.sampler_format import METHOD_NAME


def register() -> None:
    """Register `nvfp4_sampler` with SGLang: its quantization registries, the argparse choices, and the
    hooks that make weight updates all-or-nothing (`updates.py`)."""
    from sglang.srt.arg_groups.choices import QUANTIZATION_CHOICES, add_quantization_method_choices
    from sglang.srt.layers import quantization

    from .config import NVFP4SamplerConfig
    from .updates import register_hooks

    # Mutated in place: other SGLang modules hold these same dict objects. On AMX CPUs SGLang looks
    # the name up in CPU_QUANTIZATION_METHODS; the torch reference backend runs there too.
    quantization.QUANTIZATION_METHODS[METHOD_NAME] = NVFP4SamplerConfig
    quantization.CPU_QUANTIZATION_METHODS[METHOD_NAME] = NVFP4SamplerConfig
    if METHOD_NAME not in QUANTIZATION_CHOICES:
        add_quantization_method_choices([METHOD_NAME])
    register_hooks()      # all-or-nothing weight updates (applied by SGLang once every plugin is loaded)
