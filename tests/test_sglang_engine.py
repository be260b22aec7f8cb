"""SGLang nvfp4_sampler on tiny random Qwen3 (dense) and Qwen3-MoE models: numerics, pre-quantized
load, in-place updates as slime and miles run them (begin_weight_update / update_weights_from_tensor,
plain and load_format="flattened_bucket" / end_weight_update; update_weights_from_disk), full and
partial, BF16 and NVFP4 triplets, and bad updates refused whole with the old weights kept.

Two real SGLang CPU engines per model, in float32 so that the comparison with the pure-torch forward
is not lost in BF16 rounding (a W4A4 model flips activation codes on one-ulp differences):
  online   -- BF16 checkpoint of seed 0, quantized at load (`quantization="nvfp4_sampler"`)
  prequant -- the converter's sampler checkpoint of seed 1 (quant_method read from config.json)
Run in the SGLang venv (see tests/sglang_helpers.py).
"""
from __future__ import annotations

import dataclasses
import functools
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("sglang")

from safetensors.torch import save_file  # noqa: E402

from nvfp4_sampler.converters.convert import convert  # noqa: E402
from nvfp4_sampler.testing import models  # noqa: E402
from tests.sglang_helpers import bad_updates, bucket_payloads, make_engine, prompt_logprobs  # noqa: E402
from tests.sglang_helpers import save_checkpoint, update  # noqa: E402
from tests.sglang_helpers import checkpoint_tensors as tensors  # noqa: E402
from tests.vllm_helpers import reference_logprobs, reference_model, token_ids  # noqa: E402

pytestmark = pytest.mark.engine
# float32 engine vs float32 torch forward: same codes unless an activation sits within float32
# rounding of an E2M1/E4M3 decision point; measured max |diff| below 1e-4 on these prompts.
TOL = 1e-3


@dataclasses.dataclass(frozen=True)
class Kind:
    build: object
    parts: dict[str, str]     # partial updates: checkpoint-name prefix of one shard / expert / layer
    quantized: str            # a quantized checkpoint tensor (bad-update cases)
    plain: str                # a BF16 tensor
    triplet: str              # a quantized checkpoint tensor sent as an NVFP4 triplet


KINDS = {
    "dense": Kind(models.tiny_qwen3,
                  {"shard": "model.layers.0.self_attn.k_proj.", "layer": "model.layers.1."},   # k_proj: of qkv_proj
                  quantized="model.layers.1.mlp.down_proj", plain="model.layers.1.post_attention_layernorm.weight",
                  triplet="model.layers.0.mlp.up_proj"),
    "moe": Kind(models.tiny_qwen3_moe,
                {"shard": "model.layers.1.mlp.experts.3.up_proj.",        # of experts.w13_weight
                 "expert": "model.layers.0.mlp.experts.5.", "layer": "model.layers.1."},
                quantized="model.layers.1.mlp.experts.7.down_proj", plain="model.norm.weight",
                triplet="model.layers.0.mlp.experts.2.gate_proj"),
}


@pytest.fixture(scope="module", params=sorted(KINDS))
def kind(request):
    return request.param


@pytest.fixture(scope="module")
def ckpts(kind, tmp_path_factory):
    d = tmp_path_factory.mktemp(f"sglang_{kind}")
    build = KINDS[kind].build
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


def test_flattened_bucket_update_equals_fresh_engine(ckpts, ids, online, prequant, base):
    """As miles sends it (load_format="flattened_bucket", several buckets in one session, a checkpoint
    tensor's triplet within one bucket): BF16 of seed 1 == a fresh engine on seed 1; then the NVFP4
    triplets of seed 0 restore the loaded log-probs bit-exactly."""
    for source, expected in (("bf16_1", prompt_logprobs(prequant, ids)), ("pq_0", base)):
        state = tensors(ckpts[source])
        names = sorted(state)
        cut = next(i for i in range(len(names) // 2, len(names))       # first name of another module
                   if names[i].rpartition(".")[0] != names[i - 1].rpartition(".")[0])
        assert online.begin_weight_update()[0]
        for bucket in (names[:cut], names[cut:]):
            ok, message = online.update_weights_from_tensor(bucket_payloads({n: state[n] for n in bucket}),
                                                            load_format="flattened_bucket", flush_cache=False)
            assert ok, message
        assert online.end_weight_update()[0]
        assert torch.equal(prompt_logprobs(online, ids), expected), source


def test_disk_update_equals_fresh_engine(ckpts, ids, online, prequant, base):
    """update_weights_from_disk (no session): BF16 folder of seed 1 == a fresh engine on seed 1; the sampler
    checkpoint of seed 0 restores the loaded log-probs bit-exactly."""
    for source, expected in (("bf16_1", prompt_logprobs(prequant, ids)), ("pq_0", base)):
        ok, message, *_ = online.update_weights_from_disk(str(ckpts[source]))
        assert ok, message
        assert torch.equal(prompt_logprobs(online, ids), expected), source


@pytest.mark.parametrize("route", ["tensor", "disk"])
@pytest.mark.parametrize("payload", ["bf16", "pq"])
@pytest.mark.parametrize("part", ["shard", "expert", "layer"])
def test_partial_update(kind, ckpts, ids, online, part, payload, route):
    """One shard of a fused parameter, one expert, or one layer from seed 1 (BF16, or NVFP4 triplets plus the
    layer's BF16 norms): the rest keeps seed 0 (reference: the seed-0 checkpoint with those tensors of seed 1)."""
    prefix = KINDS[kind].parts.get(part)
    if prefix is None:
        pytest.skip(f"the {kind} model has no {part}")
    update(online, tensors(ckpts["pq_0"]))
    new = {n: t for n, t in tensors(ckpts[f"{payload}_1"]).items() if n.startswith(prefix)}
    if part == "shard":
        assert len(new) == (1 if payload == "bf16" else 3)
    if route == "tensor":
        update(online, new)
    else:
        folder = save_checkpoint(new, ckpts["dir"] / f"part_{payload}_{part}")
        ok, message, *_ = online.update_weights_from_disk(str(folder))
        assert ok, message
    assert (prompt_logprobs(online, ids) - partial_reference(ckpts, ids, prefix)).abs().max().item() < TOL


@functools.cache
def _partial_reference(seed0: Path, seed1: Path, folder: Path, prefix: str, ids: tuple) -> torch.Tensor:
    shutil.copytree(seed0, folder, dirs_exist_ok=True)
    state = tensors(seed0)
    state.update({n: t for n, t in tensors(seed1).items() if n.startswith(prefix)})
    save_file(state, folder / "model.safetensors", metadata={"format": "pt"})
    return reference_logprobs(reference_model(folder), [list(i) for i in ids])


def partial_reference(ckpts, ids: list[list[int]], prefix: str) -> torch.Tensor:
    """Torch reference log-probs of the seed-0 BF16 checkpoint with the tensors under `prefix` from seed 1
    (computed once per prefix: the payloads and routes of one part share it)."""
    return _partial_reference(ckpts["bf16_0"], ckpts["bf16_1"], ckpts["dir"] / f"mixed_{prefix.strip('.')}", prefix,
                              tuple(map(tuple, ids)))


def test_bad_update_refused_whole_engine_keeps_old_weights(kind, ckpts, ids, online, base):
    """Every tensor of seed 1, then one bad tensor last (wrong shape, NaN, Inf in a norm, unknown name, float32
    block scales, incomplete triplet): answered (False, message naming it), nothing written; the engine keeps
    serving seed 0 bit-exactly, over update_weights_from_tensor (plain and flattened_bucket) and from disk."""
    k = KINDS[kind]
    update(online, tensors(ckpts["pq_0"]))
    cases = bad_updates(tensors(ckpts["bf16_1"]), tensors(ckpts["pq_1"]), quantized=k.quantized, plain=k.plain,
                        triplet=k.triplet)
    assert online.begin_weight_update()[0]
    for case, (named, said) in cases.items():
        for load_format, payload in ((None, list(named.items())), ("flattened_bucket", bucket_payloads(named))):
            ok, message = online.update_weights_from_tensor(payload, load_format=load_format)
            assert not ok and "weight update refused, no tensor written" in message and said in message, (case, message)
    assert online.end_weight_update()[0]
    assert torch.equal(prompt_logprobs(online, ids), base)
    for case in ("shape", "incomplete_triplet"):
        folder = save_checkpoint(cases[case][0], ckpts["dir"] / f"bad_{case}")
        ok, message, *_ = online.update_weights_from_disk(str(folder))
        assert not ok and cases[case][1] in message, (case, message)
    assert torch.equal(prompt_logprobs(online, ids), base)
    ok, message, *_ = online.update_weights_from_disk(str(ckpts["bf16_1"]))   # and takes the next good update
    assert ok, message
    assert not torch.equal(prompt_logprobs(online, ids), base)


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
