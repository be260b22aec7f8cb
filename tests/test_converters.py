"""converters: lossless TE conversion, recipe reproduction, fused-expert split, layout, TP, bad input."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from nvfp4_sampler.converters import name_map, schema
from nvfp4_sampler.converters.convert import ConvertOptions, convert, iter_buckets
from nvfp4_sampler.converters.report import te_conversion_report
from nvfp4_sampler.converters.sources import SafetensorsFolder, StateDictSource, TENVFP4Weight
from nvfp4_sampler.kernels import reference
from nvfp4_sampler.kernels.format import NVFP4Tensor
from nvfp4_sampler.sampler_format import Recipe, SamplerConfig, is_nvfp4_weight
from nvfp4_sampler.testing.models import tiny_qwen3, tiny_qwen3_moe

REPO = Path(__file__).resolve().parents[1]
LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
           "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
# Awkward sizes: N of k/v (32) and K of down (80, K/16 = 5) are not multiples of the 128x4 scale tiles.
CONFIG = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 96,
          "num_attention_heads": 3, "num_key_value_heads": 1, "head_dim": 32, "intermediate_size": 80,
          "num_hidden_layers": 1, "vocab_size": 64}


def _weights(seed: int = 0, config: dict = CONFIG) -> dict[str, torch.Tensor]:
    """BF16 master weights of a one-layer model described by `config` (heavy-tailed, like trained ones)."""
    g = torch.Generator().manual_seed(seed)
    out = {"model.embed_tokens.weight": torch.randn(config["vocab_size"], config["hidden_size"], generator=g),
           "model.norm.weight": torch.ones(config["hidden_size"])}
    for leaf in LINEARS:
        name = f"model.layers.0.{leaf}.weight"
        n, k = schema.expected_shape(name, config)
        out[name] = torch.randn(n, k, generator=g) * torch.rand(n, 1, generator=g) ** 4
    return {k: v.to(torch.bfloat16) for k, v in out.items()}


def _te_layout(q: NVFP4Tensor, amax: torch.Tensor, *, swizzled: bool, seed: int = 1) -> TENVFP4Weight:
    """The learner tensor as TransformerEngine stores it: uint8 scale_inv padded to [roundup(M,128),
    roundup(K/16,4)]; compact row-major with uninitialised padding (random bytes here), or swizzled."""
    m, ksf = q.block_scales.shape
    if swizzled:
        scale_inv = reference.swizzle_scales_128x4(q.block_scales).view(torch.uint8)
    else:
        g = torch.Generator().manual_seed(seed)
        scale_inv = torch.randint(0, 256, (-(-m // 128) * 128, -(-ksf // 4) * 4), dtype=torch.uint8, generator=g)
        scale_inv[:m, :ksf] = q.block_scales.view(torch.uint8)
    return TENVFP4Weight(q.codes.clone(), scale_inv, amax.float().reshape(1), swizzled)


def _learner(weights: dict[str, torch.Tensor], recipe: str, *, swizzled: bool = False) -> dict:
    """What a TE learner holds: NVFP4 linears quantized with `recipe` (per-tensor amax), the rest BF16."""
    out = {}
    for name, w in weights.items():
        if is_nvfp4_weight(name, SamplerConfig()):
            out[name] = _te_layout(reference.quantize_weight(w, recipe=recipe), w.abs().float().amax(), swizzled=swizzled)
        else:
            out[name] = w
    return out


def _read(folder: Path) -> dict[str, torch.Tensor]:
    index = json.loads((folder / schema.INDEX_FILE).read_text())["weight_map"]
    out = {}
    for file in sorted(set(index.values())):
        out.update(load_file(folder / file))
    assert sorted(out) == sorted(index)
    return out


def _bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


# ---------------------------------------------------------------- lossless and reproduction guarantees

@pytest.mark.parametrize("recipe", ["1d", "2d"])
@pytest.mark.parametrize("swizzled", [False, True])
def test_te_nvfp4_converts_with_zero_bits_changed(tmp_path, recipe, swizzled):
    weights = _weights()
    learner = _learner(weights, recipe, swizzled=swizzled)
    summary = convert(StateDictSource(learner, config=CONFIG), tmp_path / "out", ConvertOptions(recipe=Recipe(weight=recipe)))
    out = _read(tmp_path / "out")
    for name, te in learner.items():
        if not isinstance(te, TENVFP4Weight):
            assert _bits_equal(out[name], te), name
            continue
        prefix = name.removesuffix(".weight")
        m, k = te.shape
        assert _bits_equal(out[f"{prefix}.weight"], te.data), name
        # the learner's block scales: from TE's padded buffer (compact) or by unswizzling (swizzled)
        scales = (reference.unswizzle_scales_128x4(te.scale_inv.view(torch.float8_e4m3fn), m, k // 16) if swizzled
                  else te.scale_inv[:m, :k // 16].view(torch.float8_e4m3fn))
        assert _bits_equal(out[f"{prefix}.weight_scale"], scales), name
        assert _bits_equal(out[f"{prefix}.weight_scale_2"], reference.decode_scale_from_amax(te.amax.reshape(()))), name
    reports = {r.name: r for r in summary.reports}
    assert len(reports) == len(LINEARS)
    assert all(r.source == "te" and r.conv_bits_changed == 0 and r.conv_max_abs == 0.0 for r in reports.values())


@pytest.mark.parametrize("swizzled", [False, True])
def test_conversion_report_counts_changed_bits(swizzled):
    """The lossless report is a real comparison with TE's storage: one flipped bit shows up."""
    name = "model.layers.0.mlp.down_proj.weight"
    te = _learner({name: _weights()[name]}, "2d", swizzled=swizzled)[name]
    q = te.to_nvfp4(name)
    assert te_conversion_report(name, te, q).conv_bits_changed == 0
    codes = q.codes.clone()
    codes[3, 1] ^= 0x10
    r = te_conversion_report(name, te, q.replace(codes=codes))
    assert r.conv_bits_changed == 1 and r.conv_max_abs > 0
    scales = q.block_scales.clone()
    scales.view(torch.uint8)[5, 4] ^= 0x01
    r = te_conversion_report(name, te, q.replace(block_scales=scales))
    assert r.conv_bits_changed == 1 and r.conv_max_abs > 0


@pytest.mark.parametrize("recipe", ["1d", "2d"])
def test_bf16_masters_with_learner_recipe_reproduce_learner_weights(tmp_path, recipe):
    weights = _weights(seed=3)
    convert(StateDictSource(_learner(weights, recipe), config=CONFIG), tmp_path / "te", ConvertOptions(recipe=Recipe(weight=recipe)))
    summary = convert(StateDictSource(weights, config=CONFIG), tmp_path / "bf16", ConvertOptions(recipe=Recipe(weight=recipe)))
    te, bf16 = _read(tmp_path / "te"), _read(tmp_path / "bf16")
    assert sorted(te) == sorted(bf16)
    assert all(_bits_equal(te[n], bf16[n]) for n in te)
    # quantization error is reported against the BF16 masters, and is what NVFP4 costs (~10%)
    for r in summary.reports:
        w = weights[r.name].float()
        deq = reference.dequantize(reference.quantize_weight(weights[r.name], recipe=recipe))
        assert r.quant_rel_fro == pytest.approx(((deq - w).norm() / w.norm()).item(), rel=1e-6)
        assert r.quant_max_abs == pytest.approx((deq - w).abs().max().item(), rel=1e-6)
        assert 0.02 < r.quant_rel_fro < 0.2


def test_te_op_order_reproduces_a_te_learner_and_is_recorded(tmp_path):
    """--op-order te: BF16 masters convert to the codes TE's quantizer gives (reference with
    op_order="te"), and the checkpoint's quantization_config says so, so the sampler quantizes
    activations the same way."""
    weights = _weights(seed=4)
    convert(StateDictSource(weights, config=CONFIG), tmp_path / "te", ConvertOptions(recipe=Recipe(weight="2d", op_order="te")))
    out = _read(tmp_path / "te")
    differs = 0
    for leaf in LINEARS:
        name, w = f"model.layers.0.{leaf}", weights[f"model.layers.0.{leaf}.weight"]
        want = reference.quantize_weight(w, recipe="2d", op_order="te")
        other = reference.quantize_weight(w, recipe="2d")
        assert _bits_equal(out[f"{name}.weight"], want.codes)
        assert _bits_equal(out[f"{name}.weight_scale"], want.block_scales)
        assert _bits_equal(out[f"{name}.weight_scale_2"], want.global_scale)
        differs += not (_bits_equal(want.codes, other.codes) and _bits_equal(want.global_scale, other.global_scale))
    assert differs, "these weights do not separate the op orders"
    cfg = json.loads((tmp_path / "te" / "config.json").read_text())["quantization_config"]
    assert cfg["op_order"] == "te" and cfg["weight_recipe"] == "2d"


def test_other_recipe_does_not_reproduce_a_2d_learner(tmp_path):
    """The seed's conversion error: re-quantizing 2D-learned weights with 1D scales changes codes."""
    weights = _weights(seed=4)
    convert(StateDictSource(_learner(weights, "2d"), config=CONFIG), tmp_path / "te", ConvertOptions(recipe=Recipe(weight="2d")))
    convert(StateDictSource(weights, config=CONFIG), tmp_path / "bf16", ConvertOptions(recipe=Recipe(weight="1d")))
    te, bf16 = _read(tmp_path / "te"), _read(tmp_path / "bf16")
    assert not _bits_equal(te["model.layers.0.mlp.gate_proj.weight_scale"],
                           bf16["model.layers.0.mlp.gate_proj.weight_scale"])


# ---------------------------------------------------------------- layout, names, config

@pytest.fixture(scope="module")
def moe_folder(tmp_path_factory) -> Path:
    return tiny_qwen3_moe(tmp_path_factory.mktemp("moe") / "src")


def test_layout_and_config_round_trip(tmp_path, moe_folder):
    options = ConvertOptions(recipe=Recipe(weight="2d"), keep_bf16=("model.layers.1.self_attn",), bucket_bytes=100_000)
    summary = convert(moe_folder, tmp_path / "out", options)
    out_dir = tmp_path / "out"
    cfg = json.loads((out_dir / "config.json").read_text())
    assert SamplerConfig.from_dict(cfg["quantization_config"]) == options.sampler_config()
    assert cfg["quantization_config"]["prequantized"] is True and cfg["quantization_config"]["format_version"] == 1
    src_cfg = json.loads((moe_folder / "config.json").read_text())
    assert {k: v for k, v in cfg.items() if k != "quantization_config"} == src_cfg
    for f in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (out_dir / f).read_bytes() == (moe_folder / f).read_bytes()
    shards = sorted(out_dir.glob("model-*.safetensors"))
    assert len(shards) > 1 and shards[0].name == f"model-00001-of-{len(shards):05d}.safetensors"
    with safe_open(shards[0], "pt") as f:
        assert f.metadata()["nvfp4_sampler_format_version"] == "1"
    out, src = _read(out_dir), SafetensorsFolder(moe_folder)
    for name, shape, dtype in src.specs():
        if is_nvfp4_weight(name, options.sampler_config()):
            prefix = name.removesuffix(".weight")
            for n, spec in schema.quantized_specs(prefix, *shape).items():
                assert (out[n].dtype, tuple(out[n].shape)) == (spec.dtype, spec.shape), n
        else:
            assert (out[name].dtype, tuple(out[name].shape)) == (dtype, shape), name
    assert "model.layers.1.self_attn.q_proj.weight_scale" not in out              # kept by keep_bf16
    assert "model.layers.0.self_attn.q_proj.weight_scale" in out
    assert "model.layers.0.mlp.gate.weight_scale" not in out                      # router stays BF16
    assert "model.layers.0.mlp.experts.7.down_proj.weight_scale_2" in out
    assert summary.tensors_in == len(src.specs()) and summary.tensors_out == len(out)
    assert summary.bytes_in == src.nbytes and summary.bytes_out == sum(p.stat().st_size for p in shards) - sum(
        8 + int.from_bytes(p.read_bytes()[:8], "little") for p in shards)


def test_fused_transformers5_experts_split_like_per_expert_checkpoint(tmp_path, moe_folder):
    """An in-memory transformers-5 state dict (fused gate_up_proj [E, 2I, H] / down_proj [E, H, I])
    converts to exactly the files of its save_pretrained (per-expert) checkpoint."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(moe_folder, dtype=torch.bfloat16)
    state = model.state_dict()
    assert tuple(state["model.layers.0.mlp.experts.gate_up_proj"].shape) == (8, 128, 128)
    assert tuple(state["model.layers.0.mlp.experts.down_proj"].shape) == (8, 128, 64)
    wrapped = ((f"module.{n}", t) for n, t in state.items())                       # a DDP-wrapped, one-shot stream
    convert(StateDictSource(wrapped, config=model.config.to_dict()), tmp_path / "fused", ConvertOptions())
    convert(moe_folder, tmp_path / "files", ConvertOptions())
    fused, files = _read(tmp_path / "fused"), _read(tmp_path / "files")
    assert sorted(fused) == sorted(files)
    assert all(_bits_equal(fused[n], files[n]) for n in files)


def test_shared_group_scale_equals_quantize_weight_group(tmp_path):
    """shared_group_scale: q/k/v and gate/up each share one weight_scale_2 and are bit for bit
    `reference.quantize_weight_group` (in either op order); without it every tensor has its own."""
    weights = _weights(seed=5)
    for op_order in ("vllm", "te"):
        out_dir = tmp_path / op_order
        options = ConvertOptions(shared_group_scale=True, recipe=Recipe(op_order=op_order))
        convert(StateDictSource(weights, config=CONFIG), out_dir, options)
        out = _read(out_dir)
        for group in (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj")):
            parent = "model.layers.0.self_attn" if "q_proj" in group else "model.layers.0.mlp"
            want = reference.quantize_weight_group([weights[f"{parent}.{m}.weight"] for m in group], op_order=op_order)
            for m, q in zip(group, want):
                assert _bits_equal(out[f"{parent}.{m}.weight"], q.codes), m
                assert _bits_equal(out[f"{parent}.{m}.weight_scale"], q.block_scales), m
                assert _bits_equal(out[f"{parent}.{m}.weight_scale_2"], q.global_scale), m
        down = reference.quantize_weight(weights["model.layers.0.mlp.down_proj.weight"], op_order=op_order)
        assert _bits_equal(out["model.layers.0.mlp.down_proj.weight_scale_2"], down.global_scale)   # not fused
    convert(StateDictSource(weights, config=CONFIG), tmp_path / "own", ConvertOptions())
    own = _read(tmp_path / "own")
    scales = {own[f"model.layers.0.self_attn.{m}.weight_scale_2"].item() for m in ("q_proj", "k_proj", "v_proj")}
    assert len(scales) == 3


def test_shared_group_scale_fused_experts_equal_per_expert_files(tmp_path, moe_folder):
    """Experts: gate and up of each expert share a scale, the same bits whether the source is the
    per-expert folder or a transformers-5 state dict with fused gate_up_proj [E, 2I, H]; a one-shot
    iterable source is refused (a group's amax must be read before the group is quantized)."""
    from transformers import AutoModelForCausalLM

    options = ConvertOptions(shared_group_scale=True)
    convert(moe_folder, tmp_path / "files", options)
    model = AutoModelForCausalLM.from_pretrained(moe_folder, dtype=torch.bfloat16)
    state = model.state_dict()
    convert(StateDictSource(state, config=model.config.to_dict()), tmp_path / "fused", options)
    files, fused = _read(tmp_path / "files"), _read(tmp_path / "fused")
    assert sorted(fused) == sorted(files) and all(_bits_equal(fused[n], files[n]) for n in files)
    expert = "model.layers.0.mlp.experts.3"
    assert torch.equal(files[f"{expert}.gate_proj.weight_scale_2"], files[f"{expert}.up_proj.weight_scale_2"])
    gate_up = state["model.layers.0.mlp.experts.gate_up_proj"][3]
    assert files[f"{expert}.gate_proj.weight_scale_2"] == reference.decode_scale_from_amax(gate_up.abs().amax().float())
    with pytest.raises(ValueError, match="shared_group_scale needs a source whose tensors are known up front"):
        convert(StateDictSource(iter(state.items()), config=model.config.to_dict()), tmp_path / "iter", options)


def test_name_map():
    assert name_map.rename("_orig_mod.module.model.norm.weight") == "model.norm.weight"
    assert name_map.rename("model.layers.0.self_attn.rotary_emb.inv_freq") is None
    assert name_map.rename("lm_head.weight") == "lm_head.weight"
    assert name_map.rename("lm_head.weight", tied_embeddings=True) is None
    assert name_map.expand("model.layers.2.mlp.experts.3.up_proj.weight", (64, 128)) == [
        name_map.Mapped("model.layers.2.mlp.experts.3.up_proj.weight")]
    split = name_map.expand("model.layers.2.mlp.experts.gate_up_proj", (2, 8, 32))
    assert [m.name for m in split] == [f"model.layers.2.mlp.experts.{e}.{p}.weight"
                                       for e in (0, 1) for p in ("gate_proj", "up_proj")]
    assert split[3].index == (1, slice(4, 8))
    with pytest.raises(ValueError, match="gate_up_proj: fused expert tensor"):
        name_map.expand("model.layers.2.mlp.experts.gate_up_proj", (2, 7, 32))


def test_iter_buckets_respect_bucket_bytes_and_match_files(tmp_path, moe_folder):
    convert(moe_folder, tmp_path / "files", ConvertOptions())
    files = _read(tmp_path / "files")
    limit = 50_000
    buckets = list(iter_buckets(SafetensorsFolder(moe_folder), ConvertOptions(bucket_bytes=limit)))
    assert len(buckets) > 5
    streamed = {}
    for b in buckets:
        size = sum(t.numel() * t.element_size() for t in b.values())
        groups = {n.rsplit(".", 1)[0] if n.endswith(("weight", "weight_scale", "weight_scale_2")) else n for n in b}
        assert size <= limit or len(groups) == 1        # only a single oversized group may exceed the limit
        streamed.update(b)
    assert sorted(streamed) == sorted(files)
    assert all(_bits_equal(streamed[n].contiguous(), files[n]) for n in files)


# ---------------------------------------------------------------- tensor parallel

def test_tp_shards_concatenate_to_the_unsharded_checkpoint(tmp_path):
    folder = tiny_qwen3(tmp_path / "src")
    convert(folder, tmp_path / "tp1", ConvertOptions())
    convert(folder, tmp_path / "tp2", ConvertOptions(tp=2))
    full = _read(tmp_path / "tp1")
    ranks = [_read(tmp_path / "tp2" / schema.RANK_DIR.format(rank=r)) for r in range(2)]
    assert sorted(p.name for p in (tmp_path / "tp2").iterdir()) == ["rank-00", "rank-01"]
    assert (tmp_path / "tp2" / "rank-01" / "tokenizer.json").exists()
    for name, t in full.items():
        dim = schema.tp_dim(name)
        if dim is None:
            assert all(_bits_equal(r[name], t) for r in ranks), name
        else:
            assert ranks[0][name].shape[dim] * 2 == t.shape[dim], name
            assert _bits_equal(torch.cat([r[name] for r in ranks], dim), t), name
    assert schema.tp_dim("model.layers.0.mlp.down_proj.weight") == 1


def test_tp_splits_qwen2_biases_with_their_columns(tmp_path):
    config = {**CONFIG, "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2",
              "num_attention_heads": 2, "num_key_value_heads": 2, "hidden_size": 64, "head_dim": 32,
              "intermediate_size": 64}
    weights = _weights(config=config)
    for leaf in ("q_proj", "k_proj", "v_proj", "o_proj"):
        n = weights[f"model.layers.0.self_attn.{leaf}.weight"].shape[0]
        weights[f"model.layers.0.self_attn.{leaf}.bias"] = torch.arange(n, dtype=torch.bfloat16)
    convert(StateDictSource(weights, config=config), tmp_path / "tp2", ConvertOptions(tp=2))
    ranks = [_read(tmp_path / "tp2" / schema.RANK_DIR.format(rank=r)) for r in range(2)]
    q_bias = weights["model.layers.0.self_attn.q_proj.bias"]
    assert _bits_equal(ranks[1]["model.layers.0.self_attn.q_proj.bias"], q_bias[32:])      # column-parallel: split
    assert _bits_equal(ranks[1]["model.layers.0.self_attn.o_proj.bias"],
                       weights["model.layers.0.self_attn.o_proj.bias"])                    # row-parallel: replicated
    assert tuple(ranks[0]["model.layers.0.self_attn.q_proj.weight"].shape) == (32, 32)      # [N/2, K/2 bytes]
    assert tuple(ranks[0]["model.layers.0.self_attn.o_proj.weight_scale"].shape) == (64, 2)  # [N, K/16/2]


def test_tp_refuses_row_split_off_block_boundary(tmp_path):
    # down_proj K=48: 24 per rank, not a multiple of 16 (heads are divisible by 2)
    config = {**CONFIG, "num_attention_heads": 2, "num_key_value_heads": 2, "intermediate_size": 48}
    with pytest.raises(ValueError, match=r"down_proj.weight: dim 1 of size 48 cannot be split on a 16-element"):
        convert(StateDictSource(_weights(config=config), config=config), tmp_path / "out", ConvertOptions(tp=2))
    with pytest.raises(ValueError, match="does not divide num_attention_heads=3"):
        convert(StateDictSource(_weights(), config=CONFIG), tmp_path / "out", ConvertOptions(tp=2))
    assert not (tmp_path / "out").exists()


# ---------------------------------------------------------------- bad input: clear error, DST untouched

def _sharded(tmp_path: Path, weights: dict, config: dict = CONFIG) -> Path:
    """A two-shard HF folder with an index."""
    src = tmp_path / "src"
    src.mkdir()
    names = sorted(weights)
    parts = {"model-00001-of-00002.safetensors": names[: len(names) // 2],
             "model-00002-of-00002.safetensors": names[len(names) // 2:]}
    for file, part in parts.items():
        save_file({n: weights[n] for n in part}, src / file)
    weight_map = {n: f for f, part in parts.items() for n in part}
    (src / schema.INDEX_FILE).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (src / "config.json").write_text(json.dumps(config))
    return src


def _assert_untouched(tmp_path: Path) -> None:
    assert not (tmp_path / "out").exists()
    assert not list(tmp_path.glob(".out.tmp-*"))


def test_missing_shard(tmp_path):
    src = _sharded(tmp_path, _weights())
    (src / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match=r"missing shard\(s\) \['model-00002-of-00002.safetensors'\]"):
        convert(src, tmp_path / "out")
    _assert_untouched(tmp_path)


def test_shape_mismatch(tmp_path):
    weights = _weights()
    weights["model.layers.0.self_attn.k_proj.weight"] = weights["model.layers.0.self_attn.q_proj.weight"].clone()
    with pytest.raises(ValueError, match=r"k_proj.weight: shape mismatch, got \[96, 96\], the model config "
                                         r"expects \[32, 96\]"):
        convert(_sharded(tmp_path, weights), tmp_path / "out")
    _assert_untouched(tmp_path)


def test_dtype_mismatch(tmp_path):
    weights = _weights()
    weights["model.layers.0.mlp.up_proj.weight"] = weights["model.layers.0.mlp.up_proj.weight"].to(torch.int8)
    with pytest.raises(ValueError, match=r"up_proj.weight: dtype mismatch.*got torch.int8"):
        convert(_sharded(tmp_path, weights), tmp_path / "out")
    _assert_untouched(tmp_path)


def test_unknown_architecture(tmp_path):
    config = {**CONFIG, "architectures": ["GPT2LMHeadModel"]}
    with pytest.raises(ValueError, match=r"unknown architecture \['GPT2LMHeadModel'\].*Qwen3MoeForCausalLM"):
        convert(_sharded(tmp_path, _weights(), config), tmp_path / "out")
    _assert_untouched(tmp_path)


def test_k_not_divisible_by_16(tmp_path):
    config = {**CONFIG, "hidden_size": 72, "head_dim": 24}
    with pytest.raises(ValueError, match=r"model.layers.0.\S+.weight: K=72 is not a multiple of 16"):
        convert(_sharded(tmp_path, _weights(config=config), config), tmp_path / "out")
    _assert_untouched(tmp_path)


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
@pytest.mark.parametrize("name", ["model.layers.0.mlp.up_proj.weight", "model.norm.weight"])
def test_nan_inf_in_weights(tmp_path, bad, name):
    """A non-finite value in a late tensor (quantized or kept): earlier shards were already written."""
    weights = _weights()
    weights[name].view(-1)[5] = bad
    with pytest.raises(ValueError, match=rf"{name}: contains NaN or Inf"):
        convert(_sharded(tmp_path, weights), tmp_path / "out", ConvertOptions(bucket_bytes=1000))
    _assert_untouched(tmp_path)


def test_existing_destination_is_refused(tmp_path):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "keep.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="already exists"):
        convert(StateDictSource(_weights(), config=CONFIG), tmp_path / "out")
    assert [p.name for p in (tmp_path / "out").iterdir()] == ["keep.txt"]


def test_nvfp4_source_for_a_bf16_module_is_refused(tmp_path):
    weights = _learner(_weights(), "1d")
    with pytest.raises(ValueError, match=r"q_proj.weight: source is NVFP4 but the sampler keeps this module in BF16"):
        convert(StateDictSource(weights, config=CONFIG), tmp_path / "out",
                ConvertOptions(keep_bf16=("model.layers.0.self_attn",)))
    _assert_untouched(tmp_path)


def test_te_scale_inv_of_wrong_padding_is_refused():
    w = _weights()["model.layers.0.mlp.down_proj.weight"]
    te = _learner({"model.layers.0.mlp.down_proj.weight": w}, "1d")["model.layers.0.mlp.down_proj.weight"]
    bad = TENVFP4Weight(te.data, te.scale_inv[:, :5], te.amax)
    with pytest.raises(ValueError, match=r"down_proj: TE scale_inv must be uint8/float8_e4m3fn \[128, 8\]"):
        bad.to_nvfp4("down_proj")


# ---------------------------------------------------------------- CLI

def test_cli_convert_prints_summary(tmp_path):
    src = _sharded(tmp_path, _weights())
    (src / "tokenizer.json").write_text("{}")
    run = subprocess.run([sys.executable, "-m", "nvfp4_sampler.server.cli", "convert", str(src), str(tmp_path / "out"),
                          "--recipe", "2d", "--op-order", "te", "--shared-group-scale",
                          "--keep-bf16", "model.layers.0.mlp.down_proj"],
                         cwd=REPO, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert "converted 9 tensors -> 21" in run.stdout and "GB/s" in run.stdout
    assert "model.layers.0.mlp.gate_proj.weight" in run.stdout and "q_relfro" in run.stdout
    assert "100%" in run.stderr                                   # the progress bar
    assert (tmp_path / "out" / "tokenizer.json").exists()
    cfg = json.loads((tmp_path / "out" / "config.json").read_text())["quantization_config"]
    assert cfg["weight_recipe"] == "2d" and cfg["keep_bf16"] == ["model.layers.0.mlp.down_proj"]
    assert cfg["op_order"] == "te"
    out = _read(tmp_path / "out")
    assert len({out[f"model.layers.0.self_attn.{m}.weight_scale_2"].item() for m in ("q_proj", "k_proj", "v_proj")}) == 1
    assert len({out[f"model.layers.0.mlp.{m}.weight_scale_2"].item() for m in ("gate_proj", "up_proj")}) == 1


def test_cli_error_is_clear_and_nonzero(tmp_path):
    run = subprocess.run([sys.executable, "-m", "nvfp4_sampler.server.cli", "convert", str(tmp_path / "nope"), str(tmp_path / "out")],
                         cwd=REPO, capture_output=True, text=True, timeout=120)
    assert run.returncode == 2 and "Traceback" not in run.stderr
    assert run.stderr.strip().splitlines()[-1] == f"nvfp4-sampler convert: error: {tmp_path / 'nope'}: no config.json"
    assert not (tmp_path / "out").exists()


# ---------------------------------------------------------------- GPU path (the H200)

@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("recipe", ["1d", "2d"])
def test_cuda_conversion_is_bit_identical_to_cpu(tmp_path, recipe):
    weights = _weights(seed=7)
    convert(StateDictSource(weights, config=CONFIG), tmp_path / "cpu", ConvertOptions(recipe=Recipe(weight=recipe)))
    convert(StateDictSource(weights, config=CONFIG), tmp_path / "gpu", ConvertOptions(recipe=Recipe(weight=recipe), device="cuda"))
    cpu, gpu = _read(tmp_path / "cpu"), _read(tmp_path / "gpu")
    assert sorted(cpu) == sorted(gpu) and all(_bits_equal(cpu[n], gpu[n]) for n in cpu)
