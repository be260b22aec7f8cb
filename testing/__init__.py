"""Tiny, deterministic models and checkpoints for tests and benchmarks (`nvfp4_sampler.testing`).

  models        tiny random Qwen3 / Qwen3-MoE HF folders with a trained byte-level tokenizer, the real
                SmolLM2-135M-Instruct, a pre-quantized (sampler) copy of a BF16 folder
  checkpoints   random BF16 checkpoints of real Qwen3 / Qwen3-MoE shapes (`SHAPES`, `build`)

Installed with the package, so users can build the same models the test suite runs on. Needs
transformers (and tokenizers) at call time, not at import.
"""
