"""Bad configs and checkpoints stop the vLLM engine at load with the option's or tensor's name.

Each case starts a real engine in a subprocess (it dies during load, ~20-40 s) and reads its output.
Run: flock /tmp/nvfp4-engine.lock .venv/bin/python -m pytest -q tests/test_vllm_errors.py
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
from safetensors.torch import load_file, save_file

from nvfp4_sampler.testing import models

pytestmark = pytest.mark.engine

SCRIPT = textwrap.dedent("""
    import sys
    from vllm import LLM
    if __name__ == "__main__":
        LLM(sys.argv[1], quantization="nvfp4_sampler", max_model_len=128, enforce_eager=True, dtype="float32")
""")


def _edit_checkpoint(path, edit) -> None:
    sd = load_file(path / "model.safetensors")
    edit(sd)
    save_file(sd, path / "model.safetensors", metadata={"format": "pt"})


def _unknown_option(d):
    return _with_quantization_config(d, {"quant_method": "nvfp4_sampler", "activation_scalling": "per_token"})


def _strict_per_tensor(d):
    return _with_quantization_config(d, {"quant_method": "nvfp4_sampler", "strict": True,
                                         "activation_scaling": "per_tensor"})


def _strict_on_a_backend_that_cannot_run_it(d):
    return _with_quantization_config(d, {"quant_method": "nvfp4_sampler", "strict": True, "backend": "triton_hopper"})


def _with_quantization_config(d, qc: dict):
    p = models.tiny_qwen3(d / "m")
    cfg = json.loads((p / "config.json").read_text())
    cfg["quantization_config"] = qc
    (p / "config.json").write_text(json.dumps(cfg))
    return p


def _k_not_multiple_of_16(d):
    return models.tiny_qwen3(d / "m", intermediate_size=264)       # down_proj K = 264


def _missing_scale(d):
    p = models.write_prequantized(models.tiny_qwen3(d / "bf16"), d / "m")
    _edit_checkpoint(p, lambda sd: sd.pop("model.layers.1.self_attn.k_proj.weight_scale"))
    return p


def _mismatched_shape(d):
    p = models.write_prequantized(models.tiny_qwen3(d / "bf16"), d / "m")

    def edit(sd):
        sd["model.layers.0.mlp.up_proj.weight_scale"] = sd["model.layers.0.mlp.up_proj.weight_scale"][:, :4].contiguous()
    _edit_checkpoint(p, edit)
    return p


@pytest.mark.parametrize("build, message", [
    (_unknown_option, "unknown quantization_config option(s) ['activation_scalling']"),
    (_strict_per_tensor, "strict needs activation_scaling 'per_token'"),
    (_strict_on_a_backend_that_cannot_run_it, "model.layers.0.self_attn.qkv_proj: backend 'triton_hopper' cannot "
                                              "run linear (scaling=per_token, amax_override=False, K=128, rows=(256, "
                                              "128, 128), strict) on cpu: triton_hopper: needs a CUDA device, got cpu"),
    (_k_not_multiple_of_16, "model.layers.0.mlp.down_proj: input size K=264 is not a multiple of 16"),
    (_missing_scale, "checkpoint tensor(s) missing: model.layers.1.self_attn.k_proj.weight_scale"),
    (_mismatched_shape, "model.layers.0.mlp.up_proj.weight_scale: shape (256, 4) does not match the model's (256, 8)"),
], ids=["unknown-option", "strict-per-tensor", "strict-backend-cannot", "k-not-multiple-of-16", "missing-scale", "mismatched-shape"])
def test_engine_start_fails_naming_the_problem(tmp_path, build, message):
    model = build(tmp_path)
    script = tmp_path / "start.py"
    script.write_text(SCRIPT)
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    r = subprocess.run([sys.executable, str(script), str(model)], env=env, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode != 0
    assert message in r.stdout + r.stderr, (r.stdout + r.stderr)[-3000:]
