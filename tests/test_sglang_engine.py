"""SGLang nvfp4_sampler on tiny random Qwen3 (dense) and Qwen3-MoE models: numerics, pre-quantized
load, in-place updates through SGLang's begin_weight_update / update_weights_from_tensor /
end_weight_update.

Two real SGLang CPU engines per model, in float32 so that the comparison with the pure-torch forward
is not lost in BF16 rounding (a W4A4 model flips activation codes on one-ulp differences):
  online   -- BF16 checkpoint of seed 0, quantized at load (`quantization="nvfp4_sampler"`)
  prequant -- the converter's sampler checkpoint of seed 1 (quant_method read from config.json)
Run in the SGLang venv (see tests/sglang_helpers.py).
"""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("sglang")

from safetensors.torch import save_file  # noqa: E402

from converters.convert import convert  # noqa: E402
from tests import models  # noqa: E402
from tests.sglang_helpers import checkpoint_tensors as tensors
from tests.sglang_helpers import make_engine, prompt_logprobs, update  # noqa: E402
from tests.vllm_helpers import reference_logprobs, reference_model, token_ids  # noqa: E402

pytestmark = pytest.mark.engine
# float32 engine vs float32 torch forward: same codes unless an activation sits within float32
# rounding of an E2M1/E4M3 decision point; measured max |diff| below 1e-4 on these prompts.
TOL = 1e-3
# Per model: its builder and one checkpoint tensor that is a single shard of a fused SGLang parameter.
KINDS = {
    "dense": (models.tiny_qwen3, "model.layers.0.self_attn.k_proj"),        # of qkv_proj
    "moe": (models.tiny_qwen3_moe, "model.layers.1.mlp.experts.3.up_proj"),  # of experts.w13_weight
}


@pytest.fixture(scope="module", params=sorted(KINDS))
def kind(request):
    return request.param


@pytest.fixture(scope="module")
def ckpts(kind, tmp_path_factory):
    d = tmp_path_factory.mktemp(f"sglang_{kind}")
    build = KINDS[kind][0]
    paths = {"dir": d}
    for s in (0, 1):
        paths[f"bf16_{s}"] = build(d / f"bf16_{s}", seed=s)
        convert(paths[f"bf16_{s}"], d / f"pq_{s}")
        paths[f"pq_{s}"] = d / f"pq_{s}"
    return paths


@pytest.fixture(scope="module")
def ids(ckpts):
    return token_ids(ckpts["bf16_0"])


@pytest.fixture(scope="module")
def online(ckpts):
    engine = make_engine(ckpts["bf16_0"], quantization="nvfp4_sampler", dtype="float32")
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def prequant(ckpts):
    engine = make_engine(ckpts["pq_1"], dtype="float32")
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def base(online, ids):
    """Log-probs of the online engine as loaded (seed 0), before any update."""
    return prompt_logprobs(online, ids)


def test_online_logprobs_equal_torch_reference(ckpts, ids, base):
    ref = reference_logprobs(reference_model(ckpts["bf16_0"]), ids)
    assert (base - ref).abs().max().item() < TOL
    from transformers import AutoModelForCausalLM

    bf16 = AutoModelForCausalLM.from_pretrained(str(ckpts["bf16_0"]), dtype=torch.float32).eval()
    # the engine is W4A4, not the unquantized model: quantization moves log-probs by far more than TOL
    assert (base - reference_logprobs(bf16, ids)).abs().max().item() > 20 * TOL


def test_prequantized_logprobs_equal_torch_reference(ckpts, ids, prequant):
    ref = reference_logprobs(reference_model(ckpts["bf16_1"]), ids)
    assert (prompt_logprobs(prequant, ids) - ref).abs().max().item() < TOL


def test_bf16_update_equals_fresh_engine(ckpts, ids, online, prequant, base):
    """All tensors of seed 1 in BF16, quantized on arrival == a fresh engine loaded with seed 1."""
    update(online, tensors(ckpts["bf16_1"]))
    updated = prompt_logprobs(online, ids)
    assert (updated - base).abs().max().item() > 20 * TOL
    assert torch.equal(updated, prompt_logprobs(prequant, ids))


def test_nvfp4_update_restores_exactly(ckpts, ids, online, base):
    """Seed 1, then the pre-quantized triplets (and BF16 norms/embeddings) of seed 0: log-probs as loaded."""
    update(online, tensors(ckpts["bf16_1"]))
    update(online, tensors(ckpts["pq_0"]))
    assert torch.equal(prompt_logprobs(online, ids), base)


@pytest.mark.parametrize("payload", ["bf16", "pq"])
def test_single_shard_update(kind, ckpts, ids, online, payload):
    """One shard of a fused parameter from seed 1 (BF16 weight or NVFP4 triplet): the others keep seed 0."""
    prefix = KINDS[kind][1]
    update(online, tensors(ckpts["pq_0"]))
    new = {n: t for n, t in tensors(ckpts[f"{payload}_1"]).items() if n.startswith(prefix + ".")}
    assert len(new) == (1 if payload == "bf16" else 3)
    update(online, new)
    # reference: the seed-0 BF16 checkpoint with that one tensor from seed 1
    mixed = ckpts["dir"] / f"mixed_{payload}"
    shutil.copytree(ckpts["bf16_0"], mixed, dirs_exist_ok=True)
    state = tensors(ckpts["bf16_0"])
    state[f"{prefix}.weight"] = tensors(ckpts["bf16_1"])[f"{prefix}.weight"]
    save_file(state, mixed / "model.safetensors", metadata={"format": "pt"})
    ref = reference_logprobs(reference_model(mixed), ids)
    assert (prompt_logprobs(online, ids) - ref).abs().max().item() < TOL


def test_missing_scale_fails_at_load_naming_the_tensor(tmp_path):
    """A pre-quantized checkpoint without one weight_scale: the engine refuses to start and says which.
    Run in a child process: SGLang ends the process that started a failed engine."""
    convert(models.tiny_qwen3(tmp_path / "bf16"), tmp_path / "pq")
    missing = "model.layers.1.mlp.down_proj.weight_scale"
    state = tensors(tmp_path / "pq")
    del state[missing]
    for f in (tmp_path / "pq").glob("*.safetensors"):
        f.unlink()
    save_file(state, tmp_path / "pq" / "model.safetensors", metadata={"format": "pt"})
    (tmp_path / "pq" / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": {n: "model.safetensors" for n in state}}))
    code = "import sys; from tests.sglang_helpers import make_engine; make_engine(sys.argv[1], dtype='float32')"
    run = subprocess.run([sys.executable, "-c", code, str(tmp_path / "pq")], capture_output=True, text=True,
                         timeout=600, cwd=Path(__file__).parent.parent)
    assert run.returncode != 0
    assert f"nvfp4_sampler: checkpoint tensor(s) missing: {missing} " in run.stdout + run.stderr
