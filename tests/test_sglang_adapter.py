"""The SGLang adapter without an engine: registration, config parsing, per-layer method choice, and a
real SGLang ReplicatedLinear loaded, applied and updated through the nvfp4_sampler linear method.
Run in the SGLang venv (see tests/sglang_helpers.py)."""
from __future__ import annotations

import argparse

import pytest
import torch

pytest.importorskip("sglang")

import tests.sglang_helpers  # noqa: E402,F401  (torchvision stub on sys.path before SGLang's layers)
from nvfp4_sampler.kernels import reference  # noqa: E402
from nvfp4_sampler.sampler_plugin import sglang as adapter  # noqa: E402
from nvfp4_sampler.sampler_format import SamplerConfig  # noqa: E402
from nvfp4_sampler.sampler_plugin.policy import fused_shard_names  # noqa: E402

PREFIX = "model.layers.0.self_attn.o_proj"


@pytest.fixture(scope="module")
def config_cls():
    adapter.register()
    adapter.register()                       # idempotent: SGLang may call it again in the same process
    from nvfp4_sampler.sampler_plugin.sglang.config import NVFP4SamplerConfig

    return NVFP4SamplerConfig


def test_register_adds_method_and_cli_choice(config_cls):
    from sglang.srt.arg_groups.choices import QUANTIZATION_CHOICES
    from sglang.srt.layers.quantization import get_quantization_config
    from sglang.srt.server_args import ServerArgs

    assert get_quantization_config("nvfp4_sampler") is config_cls
    assert QUANTIZATION_CHOICES.count("nvfp4_sampler") == 1
    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    args = parser.parse_args(["--model-path", "m", "--quantization", "nvfp4_sampler"])
    assert args.quantization == "nvfp4_sampler"


def test_from_config_takes_sglang_keys_and_rejects_unknown_options(config_cls):
    cfg = config_cls.from_config({**SamplerConfig(keep_bf16=("model.layers.0.",), prequantized=True).to_dict(),
                                  "packed_modules_mapping": {"w12": ["w1", "w2"]}, "hf_config": object()})
    assert cfg.sampler == SamplerConfig(keep_bf16=("model.layers.0.",), prequantized=True)
    assert fused_shard_names("model.layers.1.mlp.w12", cfg.packed_modules_mapping) == ["model.layers.1.mlp.w1", "model.layers.1.mlp.w2"]
    assert fused_shard_names("model.layers.1.self_attn.qkv_proj", cfg.packed_modules_mapping) == [
        f"model.layers.1.self_attn.{p}_proj" for p in "qkv"]
    with pytest.raises(ValueError, match="unknown quantization_config option.*'block'"):
        config_cls.from_config({"quant_method": "nvfp4_sampler", "block": 32})


def test_method_choice_follows_policy(config_cls):
    from sglang.srt.layers.linear import LinearBase
    from sglang.srt.layers.quantization.unquant import UnquantizedLinearMethod

    from nvfp4_sampler.sampler_plugin.sglang.linear import NVFP4LinearMethod

    cfg = config_cls(SamplerConfig(keep_bf16=("model.layers.1.mlp.up_proj",)))
    layer = LinearBase(16, 16)
    for prefix in ("lm_head", "model.layers.0.mlp.gate", "model.layers.2.self_attn.qkv_proj"):
        method = cfg.get_quant_method(layer, prefix)
        assert isinstance(method, UnquantizedLinearMethod if "qkv" not in prefix else NVFP4LinearMethod), prefix
    assert cfg.get_quant_method(layer, "model.layers.0.mlp.gate_up_proj").shard_names == [
        "model.layers.0.mlp.gate_proj", "model.layers.0.mlp.up_proj"]
    with pytest.raises(ValueError, match="splits the fused module model.layers.1.mlp.gate_up_proj"):
        cfg.get_quant_method(layer, "model.layers.1.mlp.gate_up_proj")


@pytest.fixture
def linear(config_cls):
    from sglang.srt.layers.linear import ReplicatedLinear

    return ReplicatedLinear(64, 48, bias=True, quant_config=config_cls(), prefix=PREFIX)


def load(layer, tensors: dict[str, torch.Tensor]) -> None:
    """What SGLang's model.load_weights does for an unfused linear: each tensor to its param's loader."""
    for kind, t in tensors.items():
        param = getattr(layer, kind)
        param.weight_loader(param, t)


def test_linear_equals_reference_and_session_updates(linear):
    torch.manual_seed(0)
    w0, w1, bias, x = torch.randn(48, 64), torch.randn(48, 64), torch.randn(48), torch.randn(5, 64)
    assert [n for n, _ in linear.named_parameters()] == ["weight", "weight_scale", "weight_scale_2", "bias"]
    load(linear, {"weight": w0.bfloat16(), "bias": bias})
    linear.quant_method.process_weights_after_loading(linear)
    out, _ = linear(x)
    expected = reference.linear(x, reference.quantize_weight(w0.bfloat16()), bias=bias)
    assert torch.equal(out, expected)
    memory = linear.quant_method.memory          # codes 48*32 + block scales 48*4 + row scales 48*4 bytes
    assert (memory.created, memory.processed, memory.nbytes, memory.bf16_nbytes) == (1, 1, 1920, 48 * 64 * 2)

    # begin_weight_update / update_weights_from_tensor (an NVFP4 triplet) / end_weight_update
    q1 = reference.quantize_weight(w1)
    linear.quant_method.restore_weights_before_loading(linear)
    load(linear, {"weight": q1.codes, "weight_scale": q1.block_scales, "weight_scale_2": q1.global_scale})
    linear.quant_method.process_weights_after_loading(linear)
    assert torch.equal(linear(x)[0], reference.linear(x, q1, bias=bias))

    # later post-load calls (end_weight_update) check nothing: updates are checked whole up front (updates.py)
    linear.quant_method.process_weights_after_loading(linear)


def test_linear_refuses_bad_tensors(linear):
    with pytest.raises(ValueError, match=rf"{PREFIX}.weight: shape \(48, 32\) does not match the model's \(48, 64\)"):
        load(linear, {"weight": torch.randn(48, 32)})
    with pytest.raises(ValueError, match=rf"{PREFIX}.weight_scale: dtype torch.float32"):
        load(linear, {"weight_scale": torch.ones(48, 4)})
    load(linear, {"weight": torch.zeros(48, 32, dtype=torch.uint8)})
    with pytest.raises(ValueError, match=rf"missing: {PREFIX}.weight_scale, {PREFIX}.weight_scale_2"):
        linear.quant_method.process_weights_after_loading(linear)     # at start-up: names what never arrived


class TinyModel(torch.nn.Module):
    """A quantized ReplicatedLinear plus a BF16 norm, with a load_weights that streams its input the way
    SGLang's models do (checkpoint name -> parameter -> its weight_loader, unknown names skipped)."""

    def __init__(self, linear):
        super().__init__()
        self.proj = linear
        self.norm = torch.nn.Parameter(torch.ones(64), requires_grad=False)      # no weight_loader: SGLang's default

    def load_weights(self, weights):
        from sglang.srt.model_loader.weight_utils import default_weight_loader

        params = dict(self.named_parameters())
        for name, tensor in weights:
            if name.startswith(PREFIX + "."):
                name = "proj." + name.rpartition(".")[2]
            if name in params:
                getattr(params[name], "weight_loader", default_weight_loader)(params[name], tensor)


@pytest.fixture
def tiny(linear):
    model = TinyModel(linear)
    torch.manual_seed(0)
    model.load_weights([(f"{PREFIX}.weight", torch.randn(48, 64).bfloat16()), (f"{PREFIX}.bias", torch.randn(48))])
    linear.quant_method.process_weights_after_loading(linear)
    return model


def snapshot(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[n].view(torch.uint8), b[n].view(torch.uint8)) for n in a)


def bad_updates() -> dict[str, tuple[list, str]]:
    """Updates whose bad tensor comes last, after good ones: (named tensors, the name the error must give)."""
    q = reference.quantize_weight(torch.randn(48, 64))
    good = [("norm", torch.full((64,), 2.0)), (f"{PREFIX}.bias", torch.zeros(48))]
    nan = torch.randn(48, 64)
    nan[3, 5] = float("nan")
    return {
        "shape": (good + [(f"{PREFIX}.weight", torch.randn(48, 80))], f"{PREFIX}.weight: shape (48, 80)"),
        "dtype": (good + [(f"{PREFIX}.weight", q.codes), (f"{PREFIX}.weight_scale", q.block_scales.float()),
                          (f"{PREFIX}.weight_scale_2", q.global_scale)], f"{PREFIX}.weight_scale: dtype torch.float32"),
        "nan": (good + [(f"{PREFIX}.weight", nan)], f"{PREFIX}.weight: contains NaN"),
        "nan_plain": ([(f"{PREFIX}.weight", torch.randn(48, 64)), ("norm", torch.full((64,), float("inf")))],
                      "norm: contains NaN or Inf"),
        "plain_shape": (good[1:] + [("norm", torch.ones(65))], "norm: AssertionError"),
        "plain_dtype": (good[1:] + [("norm", torch.ones(64, dtype=torch.uint8))], "norm: ValueError: dtype torch.uint8"),
        "unknown": (good + [("model.layers.0.nonexistent.weight", torch.ones(3))],
                    "model.layers.0.nonexistent.weight: no parameter of the model takes this tensor"),
        "incomplete_triplet": (good + [(f"{PREFIX}.weight", q.codes), (f"{PREFIX}.weight_scale", q.block_scales)],
                               f"{PREFIX}.weight_scale_2: an update of {PREFIX} holds either"),
    }


@pytest.mark.parametrize("case", sorted(bad_updates()))
def test_bad_update_refused_whole_naming_the_tensor(tiny, case):
    from nvfp4_sampler.sampler_plugin.sglang.updates import UpdateRejected, checked_loads

    weights, message = bad_updates()[case]
    before = snapshot(tiny)
    with checked_loads(tiny), pytest.raises(UpdateRejected, match="no tensor written") as e:
        tiny.load_weights(weights)
    assert message in str(e.value)
    assert same(snapshot(tiny), before)                   # nothing written, not even the good tensors before it
    assert "load_weights" not in tiny.__dict__ and "weight_loader" not in tiny.norm.__dict__    # all put back


def test_checked_update_writes_when_whole_update_is_good(tiny):
    from nvfp4_sampler.sampler_plugin.sglang.updates import checked_loads

    w1 = torch.randn(48, 64)
    q = reference.quantize_weight(w1)
    with checked_loads(tiny):
        tiny.load_weights([("norm", torch.full((64,), 2.0)), (f"{PREFIX}.weight", q.codes),
                           (f"{PREFIX}.weight_scale", q.block_scales), (f"{PREFIX}.weight_scale_2", q.global_scale)])
    assert torch.equal(tiny.norm, torch.full((64,), 2.0))
    x = torch.randn(5, 64)
    assert torch.equal(tiny.proj(x)[0], reference.linear(x, q, bias=tiny.proj.bias))


def test_register_adds_update_hooks(config_cls):
    from sglang.srt.plugins.hook_registry import HookRegistry

    from nvfp4_sampler.sampler_plugin.sglang.updates import atomic_update

    updater = "sglang.srt.model_executor.model_runner_components.weight_updater.WeightUpdater"
    for method in ("update_weights_from_tensor", "update_weights_from_disk", "load_weights_from_distributed"):
        hooks = [h for _, h, _ in HookRegistry._hooks[f"{updater}.{method}"]]
        assert hooks.count(atomic_update) == 1, method
