"""The transfer plan (`server.plan`): fused entries per layer, fixed offsets per bucket, one
validation pass per value class, all on CPU tensors."""
from __future__ import annotations

import time

import pytest
import torch

from nvfp4_sampler.server.plan import TransferPlan
from nvfp4_sampler.server.protocol import TensorEntry
from nvfp4_sampler.server.wire import iter_entries
from nvfp4_sampler.testing import manifests

H, I, E, NQ, NKV, V = 64, 32, 4, 64, 32, 100


def _triplet(g: torch.Generator, name: str, n: int, k: int) -> dict[str, torch.Tensor]:
    p = name.removesuffix(".weight")
    return {name: torch.randint(0, 256, (n, k // 2), generator=g, dtype=torch.uint8),
            f"{p}.weight_scale": (torch.randint(0, 0x7E, (n, k // 16), generator=g, dtype=torch.uint8)
                                  .view(torch.float8_e4m3fn)),
            f"{p}.weight_scale_2": torch.rand((), generator=g) + 0.01}


def moe_update(layers: int = 2, seed: int = 0) -> dict[str, torch.Tensor]:
    """A checkpoint-named NVFP4 update of a tiny Qwen3-MoE (triplets per expert)."""
    g = torch.Generator().manual_seed(seed)
    t = {"model.embed_tokens.weight": torch.randn(V, H, generator=g, dtype=torch.bfloat16)}
    for L in range(layers):
        p = f"model.layers.{L}"
        for s, n in (("q", NQ), ("k", NKV), ("v", NKV)):
            t |= _triplet(g, f"{p}.self_attn.{s}_proj.weight", n, H)
        t |= _triplet(g, f"{p}.self_attn.o_proj.weight", H, NQ)
        t[f"{p}.self_attn.q_norm.weight"] = torch.randn(16, generator=g, dtype=torch.bfloat16)
        t[f"{p}.input_layernorm.weight"] = torch.randn(H, generator=g, dtype=torch.bfloat16)
        t[f"{p}.mlp.gate.weight"] = torch.randn(E, H, generator=g, dtype=torch.bfloat16)
        for e in range(E):
            for s in ("gate", "up"):
                t |= _triplet(g, f"{p}.mlp.experts.{e}.{s}_proj.weight", I, H)
            t |= _triplet(g, f"{p}.mlp.experts.{e}.down_proj.weight", H, I)
    t["model.norm.weight"] = torch.randn(H, generator=g, dtype=torch.float32)
    return t


def test_fused_entries_and_roundtrip():
    t = moe_update()
    manifest = list(iter_entries(t))
    plan = TransferPlan.build(manifest, bucket_bytes=1 << 14)
    names = [e.name for e in plan.entries]
    per_layer = {"self_attn.qkv_proj.weight", "self_attn.o_proj.weight", "self_attn.q_norm.weight",
                 "input_layernorm.weight", "mlp.gate.weight", "mlp.experts.w13_weight", "mlp.experts.w2_weight"}
    assert sorted(names) == sorted(["model.embed_tokens.weight", "model.norm.weight"]
                                   + [f"model.layers.{L}.{n}" for L in range(2) for n in per_layer])
    assert len(manifest) == 2 + 2 * (4 + 3 + 3 * E) and len(plan.entries) == 2 + 2 * 7
    assert len(plan.buckets) > 1 and plan.plan_id == TransferPlan.from_dict(plan.to_dict()).plan_id
    assert vars(plan)["plan_id"] == plan.plan_id    # hashed once: every planned status answer names it
    fused = {}
    for b, bk in enumerate(plan.buckets):
        flat = plan.pack(b, t, plan.new_buffer(b))
        assert not plan.validate(b, flat).item()
        for r, off, n in bk.regions:
            assert off % 64 == 0 and off + n <= bk.nbytes
        got = {k: v for parts in plan.member_views(b, flat).values() for k, v in parts.items()}
        for k, v in got.items():
            assert v.dtype == t[k].dtype and torch.equal(v.reshape(-1).view(torch.uint8), t[k].reshape(-1).view(torch.uint8)), k
        fused |= {k: {kk: vv.clone() for kk, vv in v.items()} for k, v in plan.fused_views(b, flat).items()}
    assert sum(len(m.members) for m in plan.entries) == len(manifest)
    # the fused layout is vLLM's: w13 [E, 2I, H/2] gate rows then up rows, decode scales [E, 2]
    p = "model.layers.1.mlp.experts"
    w13 = fused[f"{p}.w13_weight"]
    assert torch.equal(w13["weight"], torch.stack([torch.cat([t[f"{p}.{e}.gate_proj.weight"],
                                                              t[f"{p}.{e}.up_proj.weight"]]) for e in range(E)]))
    assert w13["weight_scale"].shape == (E, 2 * I, H // 16) and w13["weight_scale_2"].shape == (E, 2)
    assert w13["weight_scale_2"][2, 1] == t[f"{p}.2.up_proj.weight_scale_2"]
    assert fused[f"{p}.w2_weight"]["weight"].shape == (E, H, I // 2)
    qkv = fused["model.layers.0.self_attn.qkv_proj.weight"]
    assert qkv["weight"].shape == (NQ + 2 * NKV, H // 2) and qkv["weight_scale_2"].shape == (3,)
    assert torch.equal(qkv["weight"][NQ:NQ + NKV], t["model.layers.0.self_attn.k_proj.weight"])


def test_incomplete_groups_stay_single():
    t = moe_update(layers=1)
    manifest = [e for e in iter_entries(t) if e.name not in ("model.layers.0.mlp.experts.3.up_proj.weight",
                                                              "model.layers.0.self_attn.v_proj.weight")]
    plan = TransferPlan.build(manifest)
    names = {e.name for e in plan.entries}
    assert "model.layers.0.mlp.experts.w13_weight" not in names and "model.layers.0.mlp.experts.0.gate_proj.weight" in names
    assert "model.layers.0.mlp.experts.w2_weight" in names and "model.layers.0.self_attn.q_proj.weight" in names
    flat = plan.pack(0, t, plan.new_buffer(0))
    views = plan.member_views(0, flat)
    assert set(views) == {e.name for e in manifest}
    assert torch.equal(views["model.layers.0.self_attn.q_proj.weight"]["model.layers.0.self_attn.q_proj.weight_scale_2"],
                       t["model.layers.0.self_attn.q_proj.weight_scale_2"])


@pytest.mark.parametrize("name,poison", [
    ("model.layers.1.input_layernorm.weight", float("nan")),
    ("model.norm.weight", float("inf")),
    ("model.layers.0.mlp.experts.2.down_proj.weight_scale_2", 0.0),
    ("model.layers.1.self_attn.k_proj.weight_scale_2", -1.0),
    ("model.layers.0.mlp.experts.1.up_proj.weight_scale", "nan8"),
])
def test_validation_flags_the_bucket_and_names_the_tensor(name, poison):
    t = moe_update()
    plan = TransferPlan.build(iter_entries(t))                 # one bucket
    assert len(plan.buckets) == 1
    x = t[name].clone()
    if poison == "nan8":
        x.view(torch.uint8).view(-1)[3] = 0xFF
    else:
        x.view(-1)[min(5, x.numel() - 1)] = poison
    t[name] = x
    flat = plan.pack(0, t, plan.new_buffer(0))
    flag = plan.validate(0, flat)
    assert flag.dtype == torch.bool and flag.item()
    assert plan.find_invalid(0, flat).startswith(name)


def test_codes_are_never_flagged():
    t = moe_update()
    for k, v in t.items():
        if v.dtype == torch.uint8:
            v.fill_(0xFF)
    plan = TransferPlan.build(iter_entries(t))
    assert not plan.validate(0, plan.pack(0, t, plan.new_buffer(0))).item()


def qwen3_30b_a3b_manifest(layers: int = 48) -> list[TensorEntry]:
    """The NVFP4 update manifest of Qwen3-30B-A3B as the converter emits it: one entry per checkpoint tensor."""
    cfg = {**manifests.QWEN3_30B_A3B, "num_hidden_layers": layers}
    return [TensorEntry(name=n, layout=lay, dtype=d, shape=shape)
            for n, lay, d, shape in manifests.qwen3_moe_nvfp4_manifest(cfg)]


def test_whole_qwen3_30b_a3b_plans_to_hundreds_of_entries():
    manifest = qwen3_30b_a3b_manifest()
    t0 = time.perf_counter()
    plan = TransferPlan.build(manifest)
    seconds = time.perf_counter() - t0
    tensors_before = sum(3 if e.layout == "nvfp4" else 1 for e in manifest)
    print(f"\nQwen3-30B-A3B NVFP4 update: {len(manifest)} entries / {tensors_before} tensors -> {len(plan.entries)} "
          f"planned entries / {plan.tensor_count()} tensors in {len(plan.buckets)} buckets of <= 512 MiB "
          f"({plan.nbytes / 1e9:.2f} GB), planned in {seconds:.2f} s")
    assert len(manifest) == 18867 and tensors_before == 56115
    assert len(plan.entries) == 48 * 9 + 3 <= 600 and plan.tensor_count() == 48 * 17 + 3
    assert all(b.nbytes <= 512 << 20 or len(b.entries) == 1 for b in plan.buckets)   # embeddings: 622 MB alone
