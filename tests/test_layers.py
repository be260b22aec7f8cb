"""sampler_plugin.layers and torch_modules without an engine: storage, checkpoint writes, updates."""
from __future__ import annotations

import pytest
import torch

from nvfp4_sampler.kernels import reference
from nvfp4_sampler.sampler_plugin import commit, layers
from nvfp4_sampler.sampler_format import Recipe, SamplerConfig
from nvfp4_sampler.sampler_plugin.torch_modules import NVFP4Linear, quantize_model

CFG = SamplerConfig()


def _bytes(t):
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


def _fused(n=(32, 16), k=64):
    """A qkv-like fused weight of two checkpoint tensors a (n[0] rows) and b (n[1] rows)."""
    w = layers.create_weight(sum(n), k, name="m.ab_proj")
    shards = {"a": layers.Shard("m.a_proj", (n[0], k), slice(0, n[0])),
              "b": layers.Shard("m.b_proj", (n[1], k), slice(n[0], sum(n)))}
    return w, shards


def test_create_weight_refuses_k_not_multiple_of_16():
    with pytest.raises(ValueError, match="m.down_proj: input size K=40 is not a multiple of 16"):
        layers.create_weight(8, 40, name="m.down_proj")


def test_bf16_write_equals_reference_per_shard_and_read_inverts_it():
    torch.manual_seed(0)
    w, shards = _fused()
    a, b = torch.randn(32, 64, dtype=torch.bfloat16), 10 * torch.randn(16, 64, dtype=torch.bfloat16)
    layers.write(w, shards["a"], "weight", a, config=CFG)
    layers.write(w, shards["b"], "weight", b, config=CFG)
    for t, s in ((a, shards["a"]), (b, shards["b"])):
        q, got = reference.quantize_weight(t), layers.read(w, s)
        assert torch.equal(got["weight"], q.codes) and torch.equal(_bytes(got["weight_scale"]), _bytes(q.block_scales))
        assert torch.equal(got["weight_scale_2"], q.global_scale)
    # each shard keeps its own second-level scale, applied per row
    assert w.global_scale[0] != w.global_scale[40]
    x = torch.randn(3, 64, dtype=torch.bfloat16)
    out = layers.apply_linear(x, w, bias=None, config=CFG)
    expect = torch.cat([reference.linear(x, reference.quantize_weight(a)), reference.linear(x, reference.quantize_weight(b))], -1)
    assert torch.equal(out, expect)


def test_2d_recipe_write_equals_reference():
    torch.manual_seed(3)
    t = torch.randn(40, 64, dtype=torch.bfloat16)
    w = layers.create_weight(40, 64)
    layers.write(w, layers.Shard("p", (40, 64), slice(0, 40)), "weight", t, config=SamplerConfig(recipe=Recipe(weight="2d")))
    q = reference.quantize_weight(t, recipe="2d")
    assert torch.equal(w.codes, q.codes) and torch.equal(_bytes(w.block_scales), _bytes(q.block_scales))
    assert not torch.equal(w.codes, reference.quantize_weight(t).codes)


def test_te_op_order_config_quantizes_weights_and_activations_the_te_way():
    """Recipe(weight="2d", op_order="te"): TE's recipe end to end in a layer; the weight
    written on arrival and the linear equal the reference in TE's order, not in vLLM's."""
    from tests.test_reference_te import heavy_tailed
    cfg = SamplerConfig(recipe=Recipe(weight="2d", op_order="te"))
    t = heavy_tailed(48, 64, torch.bfloat16, 3)          # a seed whose S_enc differs by 1 ulp between orders
    w = layers.create_weight(48, 64)
    layers.write(w, layers.Shard("p", (48, 64), slice(0, 48)), "weight", t, config=cfg)
    q = reference.quantize_weight(t, recipe="2d", op_order="te")
    assert torch.equal(w.codes, q.codes) and torch.equal(_bytes(w.block_scales), _bytes(q.block_scales))
    assert torch.equal(w.global_scale, q.global_scale.expand(48))
    assert not torch.equal(w.global_scale, reference.quantize_weight(t, recipe="2d").global_scale.expand(48))
    x = heavy_tailed(6, 64, torch.float32, 6)
    out = layers.apply_linear(x, w, bias=None, config=cfg)
    assert torch.equal(out, reference.linear(x, q, op_order="te"))
    assert not torch.equal(out, reference.linear(x, reference.quantize_weight(t, recipe="2d")))
    with pytest.raises(ValueError, match="op_order must be one of"):
        Recipe(op_order="cuda")


def test_tensor_parallel_slices_match_the_full_quantization():
    torch.manual_seed(1)
    full = torch.randn(32, 64)
    q = reference.quantize_weight(full)
    col = layers.create_weight(16, 64)           # rank 1 of 2, rows
    layers.write(col, layers.Shard("p", (32, 64), slice(0, 16), src_rows=slice(16, 32)), "weight", full, config=CFG)
    assert torch.equal(col.codes, q.codes[16:]) and torch.equal(col.global_scale, q.global_scale.expand(16))
    row = layers.create_weight(32, 32)           # rank 0 of 2, K
    layers.write(row, layers.Shard("p", (32, 64), slice(0, 32), src_cols=slice(0, 32)), "weight", full, config=CFG)
    assert torch.equal(row.codes, q.codes[:, :16]) and torch.equal(_bytes(row.block_scales), _bytes(q.block_scales[:, :2]))


def test_validate_names_the_tensor():
    s = layers.Shard("m.q_proj", (32, 64), slice(0, 32))
    with pytest.raises(ValueError, match=r"m\.q_proj\.weight: shape \(32, 48\)"):
        layers.validate(s, "weight", torch.zeros(32, 48))
    with pytest.raises(ValueError, match=r"m\.q_proj\.weight_scale: dtype torch\.uint8"):
        layers.validate(s, "weight_scale", torch.zeros(32, 4, dtype=torch.uint8))
    with pytest.raises(ValueError, match=r"m\.q_proj\.weight: contains NaN"):
        layers.validate(s, "weight", torch.full((32, 64), float("nan")))


def test_load_tracker_names_missing_tensors():
    w, shards = _fused()
    tracker = layers.LoadTracker(shards.values())
    tracker.record(shards["a"], "weight", torch.zeros(32, 64))          # BF16: all three
    tracker.record(shards["b"], "weight", torch.zeros(16, 32, dtype=torch.uint8))
    with pytest.raises(ValueError, match=r"missing: m\.b_proj\.weight_scale, m\.b_proj\.weight_scale_2"):
        tracker.check()


def test_apply_update_is_all_or_nothing():
    torch.manual_seed(2)
    w, shards = _fused()
    norm = torch.ones(64)
    targets = {**{s.name: commit.Target(weight=w, shard=s) for s in shards.values()}, "m.norm.weight": commit.Target(param=norm)}
    layers.write(w, shards["a"], "weight", torch.randn(32, 64), config=CFG)
    layers.write(w, shards["b"], "weight", torch.randn(16, 64), config=CFG)
    before = layers.read(w, shards["a"])["weight"]
    bad = {"m.a_proj.weight": torch.randn(32, 64), "m.norm.weight": torch.zeros(64),
           "m.b_proj.weight": torch.zeros(16, 32, dtype=torch.uint8)}               # incomplete triplet
    with pytest.raises(ValueError, match=r"m\.b_proj\.weight_scale"):
        commit.apply_update(targets, bad, config=CFG)
    assert torch.equal(layers.read(w, shards["a"])["weight"], before) and torch.equal(norm, torch.ones(64))
    with pytest.raises(ValueError, match=r"m\.c_proj\.weight: no such tensor"):
        commit.apply_update(targets, {"m.c_proj.weight": torch.zeros(4, 16)}, config=CFG)
    q = reference.quantize_weight(torch.randn(16, 64))
    nan_scales = q.block_scales.clone()
    nan_scales[0, 0] = float("nan")
    for name, bad_tensor in (("m.norm.weight", torch.full((64,), float("inf"))), ("m.b_proj.weight_scale", nan_scales)):
        update = {"m.b_proj.weight": q.codes, "m.b_proj.weight_scale": q.block_scales,
                  "m.b_proj.weight_scale_2": q.global_scale, "m.norm.weight": 2 * norm, name: bad_tensor}
        with pytest.raises(ValueError, match=rf"{name}: contains NaN or Inf"):      # the one rule: values too
            commit.apply_update(targets, update, config=CFG)
        assert torch.equal(norm, torch.ones(64)) and not torch.equal(layers.read(w, shards["b"])["weight"], q.codes)
    names = commit.apply_update(targets, {"m.b_proj.weight": q.codes, "m.b_proj.weight_scale": q.block_scales,
                                          "m.b_proj.weight_scale_2": q.global_scale, "m.norm.weight": 2 * norm},
                                config=CFG)
    assert len(names) == 4 and torch.equal(layers.read(w, shards["b"])["weight"], q.codes) and norm[0] == 2
    assert torch.equal(layers.read(w, shards["a"])["weight"], before)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16, torch.float8_e5m2, torch.float8_e4m3fn])
@pytest.mark.parametrize("where", ["small", "large"])
def test_first_nonfinite_names_the_tensor_among_many(dtype, where):
    """Small float tensors are checked joined per dtype (a few launches for hundreds), large ones alone:
    the bad one is named wherever it is, in every float dtype (float8 too); integer tensors are not values."""
    bad = float("nan") if dtype == torch.float8_e4m3fn else float("inf")
    named = [(f"n{i}", torch.ones(7 + i, dtype=torch.float32).to(dtype)) for i in range(200)]
    named += [("big", torch.zeros(commit.JOINED_MAX_NUMEL + 1, dtype=dtype)), ("ids", torch.arange(5)),
              ("other", torch.ones(3, dtype=torch.float64))]
    assert commit.first_nonfinite(named) is None
    name = "n137" if where == "small" else "big"
    dict(named)[name][-1] = bad
    assert commit.first_nonfinite(named) == name


def test_tied_parameters_take_the_last_named_value():
    """Two names of one parameter (tied embeddings) in one update: written once, by the last name in
    sorted order, as one copy after another did."""
    tied = torch.zeros(4, 8)
    targets = {"lm_head.weight": commit.Target(param=tied), "model.embed_tokens.weight": commit.Target(param=tied)}
    commit.apply_update(targets, {"lm_head.weight": torch.full((4, 8), 1.0),
                                  "model.embed_tokens.weight": torch.full((4, 8), 2.0)}, config=CFG)
    assert bool((tied == 2.0).all())


def test_copy_all_writes_large_and_small_tensors():
    """Tensors from LARGE_COPY_BYTES up are copied one by one, the rest batched: every one is written, a
    strided source included, in each dtype."""
    big = commit.LARGE_COPY_BYTES
    dst = [torch.zeros(big, dtype=torch.uint8), torch.zeros(big // 2, 2, dtype=torch.uint8)[:, :1],
           torch.zeros(5, dtype=torch.uint8), torch.zeros(big // 4 + 1, dtype=torch.float32), torch.zeros(3)]
    src = [torch.randint(0, 255, d.shape, dtype=torch.uint8) if d.dtype == torch.uint8 else torch.randn(d.shape)
           for d in dst]
    src[1] = torch.randint(0, 255, (big // 2, 3), dtype=torch.uint8)[:, 1:2]
    commit.copy_all(dst, src)
    assert all(torch.equal(d, s) for d, s in zip(dst, src))


def test_quantize_model_swaps_linears_by_policy():
    model = torch.nn.Sequential()
    model.add_module("proj", torch.nn.Linear(64, 32, bias=True))
    model.add_module("lm_head", torch.nn.Linear(32, 16, bias=False))
    x = torch.randn(5, 64)
    w = reference.quantize_weight(model.proj.weight.detach())
    expect = reference.linear(x, w, bias=model.proj.bias.detach())
    assert quantize_model(model) == {"proj": "linear"}
    assert isinstance(model.proj, NVFP4Linear) and isinstance(model.lm_head, torch.nn.Linear)
    assert torch.equal(model.proj(x), expect)


def test_tiled_storage_takes_every_write_in_its_layout_and_reads_back_modelopt():
    """A `hopper_mma` layer stores the "mma_tiled" layout: online BF16 and pre-quantized shard writes, a
    tensor-parallel K slice and a fused commit land exactly as `cuda_mma.tile_weight` of the ModelOpt
    storage, and `read` gives the checkpoint tensors back."""
    from nvfp4_sampler.kernels import cuda_mma
    torch.manual_seed(3)
    n, k = (32, 16), 512
    a, b = torch.randn(n[0], k, dtype=torch.bfloat16), torch.randn(n[1], 2 * k, dtype=torch.bfloat16)
    plain, shards = _fused(n, k)
    tiled = plain.replace(codes=plain.codes.clone(), block_scales=plain.block_scales.clone(), layout="mma_tiled")
    qb = reference.quantize_weight(b)
    sb = layers.Shard("m.b_proj", (n[1], 2 * k), slice(n[0], sum(n)), src_cols=slice(k, 2 * k))
    for w in (plain, tiled):
        layers.write(w, shards["a"], "weight", a, config=CFG)                          # online
        for kind, t in zip(layers.KINDS, (qb.codes, qb.block_scales, qb.global_scale)):
            layers.write(w, sb, kind, t, config=CFG)                                   # triplet, K slice
    want = cuda_mma.tile_weight(plain)
    assert torch.equal(tiled.codes, want.codes) and torch.equal(_bytes(tiled.block_scales), _bytes(want.block_scales))
    for s in (shards["a"], sb):
        got, ref = layers.read(tiled, s), layers.read(plain, s)
        assert all(torch.equal(_bytes(got[kind]), _bytes(ref[kind])) for kind in layers.KINDS)
    fresh = plain.replace(codes=torch.zeros_like(plain.codes), block_scales=torch.zeros_like(plain.block_scales),
                          layout="mma_tiled")
    commit._write_fused([(fresh, True, torch.tensor([0] * n[0] + [1] * n[1]),
                          {"weight": plain.codes, "weight_scale": plain.block_scales,
                           "weight_scale_2": plain.global_scale[[0, n[0]]]})])
    assert torch.equal(fresh.codes, want.codes) and torch.equal(_bytes(fresh.block_scales), _bytes(want.block_scales))
