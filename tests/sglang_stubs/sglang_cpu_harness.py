"""Test-only SGLang general plugin: run SGLang 0.5.23's default (CUDA) code paths on a CPU torch.

Loaded in every SGLang process (engine, tokenizer, scheduler) through the `sglang.srt.plugins`
entry point of the dist-info folder beside this file, once the SGLang test harness puts this folder
on PYTHONPATH. It is not part of the nvfp4_sampler adapter.

SGLang's own CPU engine (SGLANG_USE_CPU_ENGINE=1) needs the sgl-kernel CPU build, which PyPI does
not serve; without it SGLang takes its generic path, where only the rotary embedding picks a
compiled kernel (vllm._custom_ops). Marking that module as CPU selects its torch-native forward.
"""


def apply() -> None:
    import sglang.srt.layers.rotary_embedding.base as rotary_base

    rotary_base._is_cpu = True
