"""Format-level spec tests: E2M1 codes and rounding, nibble packing, the NVFP4Tensor container and
the 128x4 swizzled scale layout (docs/FORMAT.md sections 1, 2 and 6)."""
import pytest
import torch

from nvfp4_sampler.kernels import reference as R
from nvfp4_sampler.kernels.format import NVFP4Tensor

# code -> value, bit 3 the sign (docs/FORMAT.md table)
E2M1_TABLE = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]


def test_e2m1_decode_table_with_signed_zero():
    got = R.e2m1_decode(torch.arange(16, dtype=torch.uint8))
    assert got.tolist() == E2M1_TABLE
    assert torch.signbit(got).tolist() == [False] * 8 + [True] * 8


def test_e2m1_encode_grid_values_round_trip():
    values = torch.tensor(E2M1_TABLE)
    assert R.e2m1_encode(values).tolist() == list(range(16))


@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_e2m1_round_to_nearest_even_at_every_decision_point(sign):
    # midpoints between neighbours; a tie goes to the even code (0, 1.0, 2.0, 4.0)
    ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0]) * sign
    low = torch.tensor([0, 1, 2, 3, 4, 5, 6], dtype=torch.uint8)   # code just below each midpoint
    s = 8 if sign < 0 else 0
    assert R.e2m1_encode(ties).tolist() == [0 | s, 2 | s, 2 | s, 4 | s, 4 | s, 6 | s, 6 | s]
    below = torch.nextafter(ties, torch.zeros_like(ties))
    above = torch.nextafter(ties, ties * 2)
    assert R.e2m1_encode(below).tolist() == (low | s).tolist()
    assert R.e2m1_encode(above).tolist() == ((low + 1) | s).tolist()


def test_e2m1_sign_bit_kept_for_values_rounding_to_zero():
    x = torch.tensor([-0.0, 0.0, -0.1, 0.1, -0.25, 0.25, -1e-30])
    assert R.e2m1_encode(x).tolist() == [8, 0, 8, 0, 8, 0, 8]


def test_e2m1_encode_saturates_beyond_six():
    x = torch.tensor([5.0001, 6.0, 7.0, 1e30, -6.5, -1e30])
    assert R.e2m1_encode(x).tolist() == [7, 7, 7, 7, 15, 15]


def test_pack_even_element_in_low_nibble():
    codes = torch.tensor([[0x1, 0x2, 0xF, 0x8, 0x0, 0x7]], dtype=torch.uint8)
    assert R.pack_nibbles(codes).tolist() == [[0x21, 0x8F, 0x70]]


def test_unpack_inverts_pack_on_all_bytes():
    every = torch.arange(256, dtype=torch.int32).to(torch.uint8).reshape(4, 64)
    codes = R.unpack_nibbles(every)
    assert codes.shape == (4, 128) and int(codes.max()) == 15
    assert torch.equal(codes[:, 0::2], every & 0xF) and torch.equal(codes[:, 1::2], every >> 4)
    assert torch.equal(R.pack_nibbles(codes), every)


def _tensor(rows=(4,), k=32, gs_shape=()):
    return dict(codes=torch.zeros(*rows, k // 2, dtype=torch.uint8),
                block_scales=torch.zeros(*rows, k // 16, dtype=torch.float8_e4m3fn),
                global_scale=torch.ones(gs_shape, dtype=torch.float32))


@pytest.mark.parametrize("field, bad, err", [
    ("codes", torch.zeros(4, 16, dtype=torch.int8), TypeError),
    ("block_scales", torch.zeros(4, 2), TypeError),
    ("global_scale", torch.ones((), dtype=torch.float64), TypeError),
    ("block_scales", torch.zeros(4, 3, dtype=torch.float8_e4m3fn), ValueError),
    ("block_scales", torch.zeros(5, 2, dtype=torch.float8_e4m3fn), ValueError),
    ("global_scale", torch.ones(3), ValueError),
    ("global_scale", torch.ones(4, 1), ValueError),
])
def test_nvfp4tensor_validation_names_the_field(field, bad, err):
    fields = _tensor()
    fields[field] = bad
    with pytest.raises(err, match=field):
        NVFP4Tensor(**fields)


def test_nvfp4tensor_shape_nbytes_and_row_global_scale():
    t = NVFP4Tensor(**_tensor(rows=(3, 5), k=64, gs_shape=(3,)))
    assert t.shape == (3, 5, 64)
    assert t.nbytes == 3 * 5 * 32 + 3 * 5 * 4 + 3 * 4
    t = t.replace(global_scale=torch.tensor([1.0, 2.0, 3.0]))
    assert t.row_global_scale().tolist() == [[1.0] * 5, [2.0] * 5, [3.0] * 5]
    assert NVFP4Tensor(**_tensor()).row_global_scale().tolist() == [1.0] * 4


# ---- 128x4 swizzled scale layout (REFERENCES.md section 2) ----

SWIZZLE_SHAPES = [(1, 1), (1, 4), (100, 3), (128, 4), (200, 9), (384, 8), (257, 5)]


def _random_scales(m, k, seed=0):
    """float8_e4m3fn [m, k] with random nonzero, non-NaN bit patterns (1..126)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(1, 127, (m, k), generator=g, dtype=torch.uint8).view(torch.float8_e4m3fn)


@pytest.mark.parametrize("m, k", SWIZZLE_SHAPES)
def test_swizzle_offset_formula_element_by_element(m, k):
    lin = _random_scales(m, k)
    sw = R.swizzle_scales_128x4(lin)
    mp, kp = -(-m // 128) * 128, -(-k // 4) * 4
    assert sw.shape == (mp, kp) and sw.dtype == torch.float8_e4m3fn
    flat = sw.view(torch.uint8).flatten()
    hit = torch.zeros(mp * kp, dtype=torch.bool)
    for r in range(m):
        for c in range(k):
            off = (r // 128) * (kp // 4 * 512) + (c // 4) * 512 + (r % 32) * 16 + ((r % 128) // 32) * 4 + c % 4
            assert flat[off] == lin.view(torch.uint8)[r, c], (r, c, off)
            hit[off] = True
    assert int(hit.sum()) == m * k                    # a bijection onto distinct offsets
    assert not flat[~hit].any()                       # everything else is zero padding


@pytest.mark.parametrize("m, k", SWIZZLE_SHAPES)
def test_unswizzle_inverts_swizzle(m, k):
    lin = _random_scales(m, k, seed=1)
    back = R.unswizzle_scales_128x4(R.swizzle_scales_128x4(lin), m, k)
    assert back.dtype == lin.dtype and torch.equal(back.view(torch.uint8), lin.view(torch.uint8))


@pytest.mark.parametrize("m, k", SWIZZLE_SHAPES)
def test_swizzle_equals_vllm_swizzle_blockscale(m, k, monkeypatch):
    from vllm.model_executor.layers.quantization.utils.nvfp4_utils import swizzle_blockscale
    # vLLM moves its result to CUDA at the end; on CPU make .cuda() the identity (no numerics involved).
    monkeypatch.setattr(torch.Tensor, "cuda", lambda self, *a, **kw: self)
    lin = _random_scales(m, k, seed=2)
    theirs = swizzle_blockscale(lin)
    ours = R.swizzle_scales_128x4(lin)
    assert torch.equal(ours.view(torch.uint8).flatten(), theirs.contiguous().view(torch.uint8).flatten())


@pytest.mark.parametrize("m, k", [(100, 3), (384, 8)])
def test_swizzle_inverse_equals_vllm_convert_swizzled_to_linear(m, k):
    from vllm.model_executor.layers.quantization.utils.nvfp4_emulation_utils import convert_swizzled_to_linear
    lin = _random_scales(m, k, seed=3)
    sw = R.swizzle_scales_128x4(lin)
    theirs = convert_swizzled_to_linear(sw.view(torch.uint8), m, k * 16, 16)
    # vLLM slices the columns with the element count K, not K/16: the padded columns stay (zeros)
    assert torch.equal(theirs[:, :k], lin.view(torch.uint8))
    assert not theirs[:, k:].any()


def test_recipe_is_frozen_validates_itself_and_keeps_the_config_json_keys():
    """The recipe travels as one frozen object; on disk its fields keep the `quantization_config`
    keys existing checkpoints hold (`weight_recipe`, `op_order`, `activation_scaling`)."""
    import dataclasses

    from nvfp4_sampler.sampler_format import Recipe, SamplerConfig

    te = Recipe(weight="2d", op_order="te")
    assert te.to_json() == {"weight_recipe": "2d", "op_order": "te", "activation_scaling": "per_token"}
    assert Recipe.from_json(te.to_json()) == te and Recipe.from_json({}) == Recipe()
    with pytest.raises(dataclasses.FrozenInstanceError):
        te.op_order = "vllm"
    for bad in (dict(weight="3d"), dict(op_order="cuda"), dict(activation_scaling="per_block")):
        with pytest.raises(ValueError, match="must be one of"):
            Recipe(**bad)
    # a config.json written before the Recipe existed loads as it is, and writes the same keys back
    on_disk = {"quant_method": "nvfp4_sampler", "format_version": 1, "activation_scaling": "per_token",
               "weight_recipe": "2d", "op_order": "te", "keep_bf16": [], "backend": "auto", "prequantized": True}
    cfg = SamplerConfig.from_dict(on_disk)
    assert cfg.recipe == te and cfg.prequantized and cfg.to_dict() == on_disk
    with pytest.raises(ValueError, match="unknown quantization_config"):
        SamplerConfig.from_dict({**on_disk, "recipe": "2d"})
    with pytest.raises(ValueError, match="recipe must be a Recipe"):
        SamplerConfig(recipe="2d")


def test_recipe_flags_come_from_the_contract():
    import argparse

    from nvfp4_sampler.sampler_format import Recipe
    from nvfp4_sampler.sampler_format.args import add_recipe_args, recipe_from_args

    p = argparse.ArgumentParser()
    add_recipe_args(p)
    assert recipe_from_args(p.parse_args([])) == Recipe()
    args = p.parse_args(["--recipe", "2d", "--op-order", "te", "--activation-scaling", "per_tensor"])
    assert recipe_from_args(args) == Recipe(weight="2d", op_order="te", activation_scaling="per_tensor")
    with pytest.raises(SystemExit):
        p.parse_args(["--recipe", "3d"])
    q = argparse.ArgumentParser()
    add_recipe_args(q, activation_scaling=False)
    assert recipe_from_args(q.parse_args(["--op-order", "te"])) == Recipe(op_order="te")
