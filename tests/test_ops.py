"""The torch custom ops (`torch.ops.nvfp4_sampler.*`) and load-time backend selection, on CPU.

- Each op equals the executable spec (`kernels.reference`) bit for bit on the reference backend.
- `torch.library.opcheck`: fake (meta) implementations give the real output's shapes, dtypes and
  strides; AOT dispatch traces them (dynamic shapes too); no autograd kernel is needed. Its
  `test_schema` util is left out: on CPU it compares float8 inputs with `allclose`, which torch
  does not implement for float8 (`mul_cpu_reduced_float` for Float8_e4m3fn); the test
  `test_ops_do_not_mutate_inputs` checks the no-mutation part of the schema instead.
- torch.compile(fullgraph=True) of a layer forward equals eager bitwise (same kernels run).
- Backend selection fails at load, naming the layer and every backend's reason.
"""
from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from nvfp4_sampler.kernels import dispatch, reference
from nvfp4_sampler.kernels.format import NVFP4Tensor
from nvfp4_sampler.sampler_plugin import layers
from nvfp4_sampler.sampler_format import Recipe, SamplerConfig

OPCHECK_UTILS = ("test_faketensor", "test_aot_dispatch_dynamic", "test_autograd_registration")
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def _weight(n: int, k: int, *, seed: int, device: str, experts: int | None = None) -> NVFP4Tensor:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(*(() if experts is None else (experts,)), n, k, generator=g)
    return reference.quantize_weight(w).to(device)


def _x(m: int, k: int, *, seed: int, device: str, dtype=torch.bfloat16) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(m, k, generator=g) * torch.logspace(-3, 3, m)[:, None]).to(dtype).to(device)


def _backend(device: str) -> str:
    return dispatch.choose_backend(device).name


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality (float8 compared as bytes: torch.equal does not take float8 on CPU)."""
    as_bits = (lambda t: t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t)
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(as_bits(a), as_bits(b))


@pytest.mark.parametrize("scaling", ["per_token", "per_tensor"])
@pytest.mark.parametrize("with_amax", [False, True])
@pytest.mark.parametrize("with_bias", [False, True])
def test_linear_op_equals_reference(scaling, with_amax, with_bias):
    x, w = _x(7, 64, seed=0, device="cpu"), _weight(48, 64, seed=1, device="cpu")
    w = w.replace(global_scale=w.global_scale * torch.linspace(0.5, 2, 48))     # per-row (fused shards)
    bias = torch.randn(48).to(x.dtype) if with_bias else None
    amax = None
    if with_amax:   # a larger amax than x has, as a tensor-parallel rank gets from its neighbours
        amax = 3 * (x.abs().float().amax(-1) if scaling == "per_token" else x.abs().float().amax())
    got = torch.ops.nvfp4_sampler.linear(x, w.codes, w.block_scales, w.global_scale, bias, amax, scaling=scaling,
                                         op_order="vllm", backend="reference")
    assert torch.equal(got, reference.linear(x, w, bias=bias, scaling=scaling, amax=amax))
    if with_amax:
        assert not torch.equal(got, reference.linear(x, w, bias=bias, scaling=scaling))


def test_nonfinite_rows_give_nan_rows_without_raising():
    """vLLM's profile runs feed uninitialized attention outputs: the op must not raise (the spec does);
    per token, a row with NaN/Inf gives a NaN row and the other rows are exact."""
    x, w = _x(6, 64, seed=0, device="cpu", dtype=torch.float32), _weight(16, 64, seed=1, device="cpu")
    x[1, 5], x[4, 0] = float("nan"), float("-inf")
    y = torch.ops.nvfp4_sampler.linear(x, w.codes, w.block_scales, w.global_scale, None, None, scaling="per_token",
                                       op_order="vllm", backend="reference")
    assert y.isnan().all(-1).tolist() == [False, True, False, False, True, False]
    good = [0, 2, 3, 5]
    assert torch.equal(y[good], reference.linear(x[good], w))


def test_moe_op_equals_reference():
    e, h, i, t, k = 4, 64, 32, 9, 2
    x = _x(t, h, seed=0, device="cpu")
    w13, w2 = _weight(2 * i, h, seed=1, device="cpu", experts=e), _weight(h, i, seed=2, device="cpu", experts=e)
    ids = torch.randint(0, e, (t, k), generator=torch.Generator().manual_seed(3))
    wts = torch.rand(t, k, generator=torch.Generator().manual_seed(4))
    got = torch.ops.nvfp4_sampler.moe(x, w13.codes, w13.block_scales, w13.global_scale, w2.codes, w2.block_scales,
                                      w2.global_scale, wts, ids, op_order="vllm", backend="reference")
    assert torch.equal(got, reference.moe(x, w13, w2, wts, ids))


def _te_sensitive_x() -> torch.Tensor:
    """bf16 rows whose codes differ between the two op orders (searched over seeds: S_enc's one or
    two roundings and the block-scale product order differ at E4M3 and E2M1 ties)."""
    from nvfp4_sampler.kernels import reference as R
    g = torch.Generator().manual_seed(0)
    for _ in range(200):
        x = (torch.randn(4, 64, generator=g) * torch.exp2(torch.randint(-6, 6, (4, 1), generator=g).float()))
        x = x.to(torch.bfloat16)
        a, b = R.quantize_per_token(x), R.quantize_per_token(x, op_order="te")
        if not torch.equal(a.codes, b.codes):
            return x
    raise AssertionError("no input separates the op orders")


def test_ops_take_the_op_order():
    """op_order reaches the quantizer of every op: te equals the reference in TE's order and
    differs from vLLM's on inputs where the orders differ."""
    x = _te_sensitive_x()
    w = _weight(32, 64, seed=1, device="cpu")
    ops = torch.ops.nvfp4_sampler
    y = {o: ops.linear(x, w.codes, w.block_scales, w.global_scale, None, None, scaling="per_token", op_order=o,
                       backend="reference") for o in ("vllm", "te")}
    assert torch.equal(y["te"], reference.linear(x, w, op_order="te"))
    assert not torch.equal(y["te"], y["vllm"])
    q = ops.quantize_activations(x, None, scaling="per_token", op_order="te", backend="reference")
    want = reference.quantize_per_token(x, op_order="te")
    assert all(_same(a, b) for a, b in zip(q, (want.codes, want.block_scales, want.global_scale)))
    e, h, i = 2, 64, 32
    w13, w2 = _weight(2 * i, h, seed=2, device="cpu", experts=e), _weight(h, i, seed=3, device="cpu", experts=e)
    ids, wts = torch.zeros(4, 1, dtype=torch.int64), torch.ones(4, 1)
    got = ops.moe(x, w13.codes, w13.block_scales, w13.global_scale, w2.codes, w2.block_scales, w2.global_scale,
                  wts, ids, op_order="te", backend="reference")
    assert torch.equal(got, reference.moe(x, w13, w2, wts, ids, op_order="te"))


@pytest.mark.parametrize("scaling", ["per_token", "per_tensor"])
def test_quantize_activations_op_equals_reference(scaling):
    x = _x(3, 96, seed=5, device="cpu", dtype=torch.float32).reshape(3, 1, 96)
    got = torch.ops.nvfp4_sampler.quantize_activations(x, None, scaling=scaling, op_order="vllm", backend="reference")
    want = reference.quantize_activations(x, scaling=scaling)
    assert all(_same(a, b) for a, b in zip(got, (want.codes, want.block_scales, want.global_scale)))


def _op_cases(device: str):
    backend = _backend(device)
    x, w = _x(5, 64, seed=0, device=device), _weight(32, 64, seed=1, device=device)
    gs_rows = w.global_scale.expand(32).contiguous()
    amax = x.abs().float().amax(-1) * 2
    e, h, i = 4, 64, 32
    w13, w2 = _weight(2 * i, h, seed=2, device=device, experts=e), _weight(h, i, seed=3, device=device, experts=e)
    ids = torch.randint(0, e, (5, 2), generator=torch.Generator().manual_seed(4)).to(device)
    wts = torch.rand(5, 2, generator=torch.Generator().manual_seed(5)).to(device)
    ops = torch.ops.nvfp4_sampler
    return [
        (ops.linear.default, (x, w.codes, w.block_scales, gs_rows, None, None),
         dict(scaling="per_token", op_order="vllm", backend=backend)),
        (ops.linear.default, (x.float(), w.codes, w.block_scales, w.global_scale, torch.randn(32, device=device), None),
         dict(scaling="per_tensor", op_order="te", backend=backend)),
        (ops.linear.default, (x[None], w.codes, w.block_scales, gs_rows, None, amax[None]),
         dict(scaling="per_token", op_order="te", backend="reference")),
        (ops.moe.default, (x, w13.codes, w13.block_scales, w13.global_scale, w2.codes, w2.block_scales,
                           w2.global_scale, wts, ids), dict(op_order="vllm", backend=backend)),
        (ops.quantize_activations.default, (x, None), dict(scaling="per_token", op_order="te", backend=backend)),
        (ops.quantize_activations.default, (x, amax.max()), dict(scaling="per_tensor", op_order="vllm", backend=backend)),
    ]


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck(device):
    for op, args, kwargs in _op_cases(device):
        result = torch.library.opcheck(op, args, kwargs, test_utils=OPCHECK_UTILS)
        assert set(result.values()) == {"SUCCESS"}, (op, result)


def test_ops_do_not_mutate_inputs():
    for op, args, kwargs in _op_cases("cpu"):
        before = [a.clone() if isinstance(a, torch.Tensor) else a for a in args]
        op(*args, **kwargs)
        assert all(_same(a, b) for a, b in zip(args, before) if isinstance(a, torch.Tensor)), op


def test_fake_shapes():
    """Meta shapes without running a kernel: what dynamo and inductor see."""
    with FakeTensorMode():
        x = torch.empty(2, 7, 256, dtype=torch.bfloat16)
        codes, scales = torch.empty(96, 128, dtype=torch.uint8), torch.empty(96, 16, dtype=torch.float8_e4m3fn)
        y = torch.ops.nvfp4_sampler.linear(x, codes, scales, torch.empty(96), None, None, scaling="per_token",
                                           op_order="vllm", backend="reference")
        assert (y.shape, y.dtype) == ((2, 7, 96), torch.bfloat16)
        c, s, g = torch.ops.nvfp4_sampler.quantize_activations(x, None, scaling="per_token", op_order="vllm",
                                                                 backend="reference")
        assert [(t.shape, t.dtype) for t in (c, s, g)] == [((2, 7, 128), torch.uint8), ((2, 7, 16), torch.float8_e4m3fn),
                                                           ((2, 7), torch.float32)]
        _, _, g = torch.ops.nvfp4_sampler.quantize_activations(x, None, scaling="per_tensor", op_order="vllm",
                                                                 backend="reference")
        assert g.shape == ()
        t = torch.empty(5, 256, dtype=torch.float16)
        y = torch.ops.nvfp4_sampler.moe(t, torch.empty(8, 64, 128, dtype=torch.uint8),
                                        torch.empty(8, 64, 16, dtype=torch.float8_e4m3fn), torch.empty(8),
                                        torch.empty(8, 256, 16, dtype=torch.uint8),
                                        torch.empty(8, 256, 2, dtype=torch.float8_e4m3fn), torch.empty(8),
                                        torch.empty(5, 2), torch.empty(5, 2, dtype=torch.int64), op_order="vllm",
                                        backend="reference")
        assert (y.shape, y.dtype) == ((5, 256), torch.float16)


class _Block(torch.nn.Module):
    """Two NVFP4 linears and a BF16 op between them, the way an engine's forward calls the layer ops."""

    def __init__(self, config: SamplerConfig):
        super().__init__()
        self.config = config
        self.w1, self.w2 = (NVFP4Tensor(*(torch.nn.Parameter(t, requires_grad=False) for t in (
            w.codes, w.block_scales, w.global_scale.expand(w.codes.shape[0]).contiguous())))
            for w in (_weight(128, 64, seed=1, device="cpu"), _weight(64, 128, seed=2, device="cpu")))
        self.backend = layers.choose_backend(config, op="linear", name="block", device="cpu", k=64)

    def forward(self, x):
        h = layers.apply_linear(x, self.w1, bias=None, config=self.config, backend=self.backend)
        return layers.apply_linear(torch.nn.functional.silu(h), self.w2, bias=None, config=self.config,
                                   backend=self.backend)


@pytest.mark.parametrize("scaling", ["per_token", "per_tensor"])
def test_compiled_layer_forward_equals_eager(scaling):
    block = _Block(SamplerConfig(recipe=Recipe(activation_scaling=scaling)))
    compiled = torch.compile(block, fullgraph=True, dynamic=True)
    for m in (1, 5, 33):
        x = _x(m, 64, seed=m, device="cpu")
        assert torch.equal(compiled(x), block(x)), m


def test_compiled_moe_forward_equals_eager():
    """Router softmax/top-k in the compiled graph, experts through the MoE op (what an engine compiles)."""
    e, h, i = 4, 64, 32
    config = SamplerConfig()
    w13, w2 = (NVFP4Tensor(*(w.codes, w.block_scales, w.global_scale)) for w in
               (_weight(2 * i, h, seed=1, device="cpu", experts=e), _weight(h, i, seed=2, device="cpu", experts=e)))
    router = torch.randn(e, h, generator=torch.Generator().manual_seed(3))
    backend = layers.choose_backend(config, op="moe", name="experts", device="cpu", k=h)

    def forward(x):
        wts, ids = torch.topk(torch.softmax(x.float() @ router.T, -1), 2)
        return layers.apply_moe(x, w13, w2, wts / wts.sum(-1, keepdim=True), ids, config=config, backend=backend)

    compiled = torch.compile(forward, fullgraph=True, dynamic=True)
    for m in (1, 6, 17):
        x = _x(m, h, seed=m, device="cpu")
        assert torch.equal(compiled(x), forward(x)), m


# ---- load-time backend selection -------------------------------------------------------------

def test_choose_backend_auto_on_cpu_is_the_reference():
    assert dispatch.choose_backend("cpu").name == "reference"
    assert layers.choose_backend(SamplerConfig(), op="moe", name="m", device="cpu", k=64) == "reference"


def test_unknown_backend_names_the_layer():
    with pytest.raises(ValueError, match=r"model\.layers\.0\.mlp\.up_proj: unknown NVFP4 backend 'cutlass'"):
        layers.choose_backend(SamplerConfig(backend="cutlass"), op="linear", name="model.layers.0.mlp.up_proj",
                              device="cpu", k=64)


def test_forced_backend_that_cannot_run_raises_with_its_reason():
    with pytest.raises(RuntimeError, match=r"model\.layers\.1\.self_attn\.o_proj: backend 'triton_hopper' cannot "
                                           r"run linear .* triton_hopper: needs a CUDA device, got cpu"):
        layers.choose_backend(SamplerConfig(backend="triton_hopper"), op="linear", name="model.layers.1.self_attn.o_proj",
                              device="cpu", k=64)


def test_no_backend_collects_every_reason():
    with pytest.raises(RuntimeError) as e:
        layers.choose_backend(SamplerConfig(recipe=Recipe(activation_scaling="per_tensor")), op="moe", name="model.layers.0.mlp.experts",
                              device="cpu", k=64)
    msg = str(e.value)
    assert "model.layers.0.mlp.experts: no NVFP4 backend can run moe" in msg
    assert "triton_hopper: needs a CUDA device" in msg and "reference: MoE experts implement per-token" in msg


def test_k_not_multiple_of_16_is_refused():
    with pytest.raises(RuntimeError, match=r"down_proj: .*reference: K=264 is not a multiple of 16"):
        layers.choose_backend(SamplerConfig(), op="linear", name="model.layers.0.mlp.down_proj", device="cpu", k=264)


def test_requirements_validate_their_fields():
    with pytest.raises(ValueError, match="op must be one of"):
        dispatch.Requirements("conv")
    with pytest.raises(ValueError, match="scaling must be"):
        dispatch.Requirements("linear", scaling="per_channel")


@pytest.mark.gpu
def test_cuda_auto_choice_and_tp_amax_support():
    """On the H200: auto picks Triton; a row-parallel TP layer (amax override) gets a backend that takes it."""
    assert layers.choose_backend(SamplerConfig(), op="linear", name="l", device="cuda", k=64) == "triton_hopper"
    tp = layers.choose_backend(SamplerConfig(), op="linear", name="l", device="cuda", k=64, tp_amax=True)
    x, w = _x(5, 64, seed=0, device="cuda"), _weight(32, 64, seed=1, device="cuda")
    amax = x.abs().float().amax(-1) * 2
    got = torch.ops.nvfp4_sampler.linear(x, w.codes, w.block_scales, w.global_scale, None, amax, scaling="per_token",
                                         op_order="vllm", backend=tp)
    want = reference.linear(x.cpu(), w.to("cpu"), amax=amax.cpu())
    torch.testing.assert_close(got.cpu().float(), want.float(), rtol=2 ** -7, atol=1e-3)


def test_vllm_adapter_fails_at_create_weights_naming_the_layer():
    """The real vLLM linear method refuses a layer no backend serves when its weights are created."""
    pytest.importorskip("vllm")
    from nvfp4_sampler.sampler_plugin.vllm.linear import NVFP4LinearMethod

    method = NVFP4LinearMethod(SamplerConfig(backend="triton_hopper"), "model.layers.0.mlp.gate_up_proj",
                               ["model.layers.0.mlp.gate_proj", "model.layers.0.mlp.up_proj"], layers.MemoryReport())
    layer = torch.nn.Module()
    with pytest.raises(RuntimeError, match=r"model\.layers\.0\.mlp\.gate_up_proj: backend 'triton_hopper' cannot run"):
        method.create_weights(layer, 64, [32, 32], 64, 64, torch.bfloat16)
    method = NVFP4LinearMethod(SamplerConfig(), "model.layers.0.mlp.gate_up_proj",
                               ["model.layers.0.mlp.gate_proj", "model.layers.0.mlp.up_proj"], layers.MemoryReport())
    method.create_weights(layer, 64, [32, 32], 64, 64, torch.bfloat16)
    assert layer.nvfp4_backend == "reference" and layer.nvfp4_tp_group is None


def test_hopper_mma_takes_tileable_per_token_linears_only():
    """What the tiled backend can serve is decided from the layer at load (device aside): per-token linears
    with K % 128 == 0 and 16-row parts; strict refuses activations the tensor-core kernel cannot take."""
    can = dispatch.HopperMmaBackend.can_implement
    assert can(dispatch.Requirements("linear", k=2048, rows=(2048, 512, 512)))[0]
    for req, why in [(dispatch.Requirements("linear", k=2048), "16-row parts"),
                     (dispatch.Requirements("linear", k=2000, rows=(64,)), "K % 128"),
                     (dispatch.Requirements("linear", k=2048, rows=(64, 24)), "16-row parts"),
                     (dispatch.Requirements("linear", scaling="per_tensor", k=2048, rows=(64,)), "per-token"),
                     (dispatch.Requirements("moe", k=2048), "per-token linears only"),
                     (dispatch.Requirements("linear", k=2048, rows=(64,), strict=True, dtype=torch.float32), "bf16/fp16")]:
        ok, reason = can(req)
        assert not ok and why in reason, (req, reason)
    assert dispatch.HopperMmaBackend.is_supported(torch.device("cpu")) == (False, "needs a CUDA device, got cpu")
