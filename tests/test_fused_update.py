"""The fused commit (`commit.apply_fused`): a whole planned entry (every expert's w13 / w2, a fused
qkv) checked in one pass per tensor kind and written with one copy per kind, against the per-tensor
path (`commit.apply_update`) on CPU: the same engine state bit for bit, the same all-or-nothing rule."""
from __future__ import annotations

import pytest
import torch

from nvfp4_sampler.sampler_plugin import commit, layers
from nvfp4_sampler.sampler_format import SamplerConfig
from nvfp4_sampler.server.plan import RankTensors, TransferPlan, rank_manifest
from nvfp4_sampler.server.wire import iter_entries
from tests.test_plan import NKV, NQ, E, H, I, V, moe_update

CFG = SamplerConfig()


def engine_targets(layers_n: int = 2, *, fused_qkv: bool = True, tp: tuple[int, int] = (0, 1)):
    """Targets laid out as vLLM holds the tiny MoE of `moe_update`: qkv fused (or q/k/v apart, as the
    embedded engine holds them), experts stacked; `tp` = (rank, size) shards the experts' rows and, as a
    vocab-parallel embedding, the embedding's rows (its part first, then padding rows)."""
    rank, size = tp
    part = V // size
    embed = (commit.Target(param=torch.zeros(V, H, dtype=torch.bfloat16)) if size == 1 else
             commit.Target(param=torch.zeros(part + 14, H, dtype=torch.bfloat16),
                           rows=slice(rank * part, (rank + 1) * part), shape=(V, H)))
    t: dict[str, commit.Target] = {"model.embed_tokens.weight": embed,
                                   "model.norm.weight": commit.Target(param=torch.zeros(H))}
    for L in range(layers_n):
        p = f"model.layers.{L}"
        if fused_qkv:
            w = layers.create_weight(NQ + 2 * NKV, H)
            for i, (s, r0, n) in enumerate((("q", 0, NQ), ("k", NQ, NKV), ("v", NQ + NKV, NKV))):
                t[f"{p}.self_attn.{s}_proj"] = commit.Target(w, layers.Shard(f"{p}.self_attn.{s}_proj", (n, H),
                                                                             slice(r0, r0 + n)))
        else:
            for s, n in (("q", NQ), ("k", NKV), ("v", NKV)):
                t[f"{p}.self_attn.{s}_proj"] = commit.Target(layers.create_weight(n, H),
                                                             layers.Shard(f"{p}.self_attn.{s}_proj", (n, H),
                                                                          slice(0, n)))
        t[f"{p}.self_attn.o_proj"] = commit.Target(layers.create_weight(H, NQ),
                                                   layers.Shard(f"{p}.self_attn.o_proj", (H, NQ), slice(0, H)))
        t[f"{p}.self_attn.q_norm.weight"] = commit.Target(param=torch.zeros(16, dtype=torch.bfloat16))
        t[f"{p}.input_layernorm.weight"] = commit.Target(param=torch.zeros(H, dtype=torch.bfloat16))
        t[f"{p}.mlp.gate.weight"] = commit.Target(param=torch.zeros(E, H, dtype=torch.bfloat16))
        inter = I // size
        w13 = layers.create_weight(2 * inter, H, experts=E)
        w2 = layers.create_weight(H, inter, experts=E, global_per_row=False)
        for e in range(E):
            for sid, sh in layers.expert_shards(f"{p}.mlp.experts", e, hidden=H, inter=inter, tp_rank=rank,
                                                tp_size=size).items():
                t[sh.name] = commit.Target(w2 if sid == "w2" else w13, sh)
    return t


def state(targets) -> dict[str, torch.Tensor]:
    """Every storage tensor of the targets, as bytes (NaN-safe comparison)."""
    out, seen = {}, set()
    for name, t in sorted(targets.items()):
        tensors = [t.param] if t.param is not None else [t.weight.codes, t.weight.block_scales, t.weight.global_scale]
        for i, x in enumerate(tensors):
            if x.data_ptr() not in seen:
                seen.add(x.data_ptr())
                out[f"{name}#{i}"] = x.reshape(-1).view(torch.uint8).clone()
    return out


def assert_same(a, b):
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


def fused_entries(t, bucket_bytes=1 << 30):
    plan = TransferPlan.build(iter_entries(t), bucket_bytes=bucket_bytes)
    out = []
    for b in range(len(plan.buckets)):
        out += plan.fused_entries(b, plan.pack(b, t, plan.new_buffer(b)))
    return plan, out


def count_fast(targets, entries):
    return sum(commit._fused_plan(targets, e) is not None for e in entries)


@pytest.mark.parametrize("fused_qkv,tp", [(True, (0, 1)), (False, (0, 1)), (True, (1, 2))])
def test_fused_commit_equals_the_per_tensor_path(fused_qkv, tp):
    t = moe_update()
    ref, got = engine_targets(fused_qkv=fused_qkv, tp=tp), engine_targets(fused_qkv=fused_qkv, tp=tp)
    names = commit.apply_update(ref, t, config=CFG)
    plan, entries = fused_entries(t, bucket_bytes=1 << 14)
    assert len(plan.buckets) > 1
    assert commit.apply_fused(got, entries, config=CFG) == names
    assert_same(state(ref), state(got))
    fast = count_fast(got, entries)
    nv = [e for e in entries if e.layout == "nvfp4"]
    if tp[1] > 1:
        assert fast == sum(1 for e in nv if "experts" not in e.name)        # qkv and o_proj only
    else:                                         # qkv, o_proj, w13, w2 per layer; qkv held apart (the embedded
        assert fast == len(nv) == 2 * 4           # engine's q / k / v): a storage per slot
    if not fused_qkv:
        qkv = next(e for e in entries if e.name.endswith("qkv_proj.weight"))
        parts, _ = commit._fused_plan(got, qkv)
        assert [p.rows for p in parts] == [(s.row0, s.row1) for s in qkv.slots] and len({id(p.storage) for p in parts}) == 3


@pytest.mark.parametrize("rank", [0, 1])
def test_a_rank_plan_carries_its_shard_only_and_commits_it_whole(rank):
    """A tensor-parallel rank's plan (`TransferPlan.for_rank` of `commit.held_regions`) holds its rows of
    w13 and its K range of w2, packed from the full update's slices (`RankTensors`); written into the
    rank's `local_targets` every NVFP4 entry takes the batched path, and the state equals the per-tensor
    apply of the full update."""
    t = moe_update()
    full = TransferPlan.build(iter_entries(t), bucket_bytes=1 << 14)
    ref, got = engine_targets(tp=(rank, 2)), engine_targets(tp=(rank, 2))
    names = commit.apply_update(ref, t, config=CFG)
    held = commit.held_regions(got)
    plan = full.for_rank(held)
    entries = []
    for b in range(len(plan.buckets)):
        entries += plan.fused_entries(b, plan.pack(b, RankTensors(t, held), plan.new_buffer(b)))
    local = commit.local_targets(got)
    assert commit.apply_fused(local, entries, config=CFG) == names
    assert_same(state(ref), state(got))
    assert count_fast(local, entries) == sum(e.layout == "nvfp4" for e in entries) == 2 * 4
    shapes = {e.name.rsplit(".", 1)[-1]: dict((p.kind, p.shape) for p in e.parts) for e in plan.entries}
    assert shapes["w13_weight"]["weight"] == (E, I, H // 2) and shapes["w2_weight"]["weight"] == (E, H, I // 4)
    embed = got["model.embed_tokens.weight"].param
    assert next(e for e in plan.entries if e.name == "model.embed_tokens.weight").parts[0].shape == (V // 2, H)
    assert torch.equal(embed[:V // 2], t["model.embed_tokens.weight"][rank * V // 2:(rank + 1) * V // 2])
    assert not embed[V // 2:].any()                                     # the padding rows stay
    def expert_bytes(p):                               # codes and block scales of the experts
        return sum(x.nbytes for e in p.entries if ".experts." in e.name for x in e.parts if x.kind != "weight_scale_2")
    assert expert_bytes(plan) * 2 == expert_bytes(full) and plan.nbytes < full.nbytes


def test_a_rank_plan_takes_what_the_rank_holds():
    """Names a rank does not hold leave its plan; a float weight of a layer it holds part of is refused
    (quantizing a slice would not use the whole tensor's amax)."""
    t = moe_update()
    held = commit.held_regions(engine_targets(tp=(1, 2)))
    del held["model.layers.1.mlp.experts.3.down_proj.weight"]
    manifest = list(iter_entries(t))
    names = [e.name for e in rank_manifest(manifest, held)]
    assert "model.layers.1.mlp.experts.3.down_proj.weight" not in names and len(names) == len(manifest) - 1
    p = "model.layers.0.mlp.experts.1.up_proj"
    del t[f"{p}.weight_scale"], t[f"{p}.weight_scale_2"]
    t[f"{p}.weight"] = torch.randn(I, H, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="experts.1.up_proj.weight: a rank holds part of it"):
        rank_manifest(list(iter_entries(t)), held)


@pytest.mark.parametrize("name,poison", [
    ("model.layers.1.mlp.experts.2.up_proj.weight_scale", "nan8"),
    ("model.layers.0.mlp.experts.3.down_proj.weight_scale_2", float("inf")),
    ("model.layers.0.self_attn.k_proj.weight_scale_2", float("nan")),
    ("model.layers.1.input_layernorm.weight", float("nan")),
])
@pytest.mark.parametrize("fused_qkv", [True, False])
def test_a_bad_tensor_in_a_fused_entry_writes_nothing(name, poison, fused_qkv):
    t = moe_update()
    targets = engine_targets(fused_qkv=fused_qkv)
    commit.apply_fused(targets, fused_entries(t)[1], config=CFG)
    before = state(targets)
    u = moe_update(seed=1)
    x = u[name].clone()
    if poison == "nan8":
        x.view(torch.uint8).view(-1)[3] = 0xFF
    else:
        x.view(-1)[0] = poison
    u[name] = x
    with pytest.raises(ValueError, match=name.replace(".", r"\.")):
        commit.apply_fused(targets, fused_entries(u)[1], config=CFG)
    assert_same(before, state(targets))
    # and the next good update goes through
    commit.apply_fused(targets, fused_entries(moe_update(seed=1))[1], config=CFG)
    ref = engine_targets(fused_qkv=fused_qkv)
    commit.apply_update(ref, moe_update(seed=1), config=CFG)
    assert_same(state(ref), state(targets))


def test_unknown_or_misshapen_entries_write_nothing():
    targets = engine_targets()
    commit.apply_fused(targets, fused_entries(moe_update())[1], config=CFG)
    before = state(targets)
    u = moe_update(seed=2)
    u["model.layers.0.extra.weight"] = torch.ones(3, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="model.layers.0.extra.weight: no such tensor"):
        commit.apply_fused(targets, fused_entries(u)[1], config=CFG)
    assert_same(before, state(targets))
    small = engine_targets(layers_n=1)                   # a model with one layer: layer 1 is unknown
    before_small = state(small)
    with pytest.raises(ValueError, match="model.layers.1"):
        commit.apply_fused(small, fused_entries(moe_update(seed=2))[1], config=CFG)
    assert_same(before_small, state(small))


def test_partial_update_fuses_what_is_complete():
    t = moe_update()
    targets, ref = engine_targets(), engine_targets()
    for x in (targets, ref):
        commit.apply_update(x, t, config=CFG)
    u = {k: v for k, v in moe_update(seed=3).items() if ".experts.1." not in k and "v_proj" not in k}
    commit.apply_update(ref, u, config=CFG)
    plan, entries = fused_entries(u)
    assert "model.layers.0.mlp.experts.w13_weight" not in {e.name for e in entries}
    commit.apply_fused(targets, entries, config=CFG)
    assert_same(state(ref), state(targets))


class _Recorder:
    """An engine stand-in for the sidecar's update manager: records what the commit hands over."""

    def __init__(self, specs, targets):
        from nvfp4_sampler.server.engines.base import Engine
        self.specs, self.targets, self.calls = specs, targets, []
        self.staging_buffer = lambda n: Engine.staging_buffer(self, n)

    async def apply_fused(self, entries, version):
        self.calls.append(("fused", len(entries)))
        return {"tensors": len(commit.apply_fused(self.targets, entries, config=CFG))}

    async def apply_update(self, tensors, version):
        self.calls.append(("tensors", len(tensors)))
        return {"tensors": len(commit.apply_update(self.targets, tensors, config=CFG))}


def test_the_sidecar_commits_a_planned_update_as_fused_entries():
    """`UpdateManager`: planned buckets are staged as bucket bytes (no per-tensor views) and the commit
    hands the engine one fused entry per plan entry; the result equals the per-tensor path, and a bad
    bucket stages nothing."""
    import asyncio

    from nvfp4_sampler.server.engines.base import TensorSpec
    from nvfp4_sampler.server.protocol import BeginRequest
    from nvfp4_sampler.server.transactions import RWLock, UpdateError, UpdateManager

    t = moe_update()
    manifest = list(iter_entries(t))
    specs = {e.name: TensorSpec(e.name, tuple(e.shape), e.layout == "nvfp4") for e in manifest}
    engine = _Recorder(specs, engine_targets())
    mgr = UpdateManager(engine, max_frame_bytes=1 << 30, idle_timeout_s=60, lock=RWLock())
    st = mgr.begin(BeginRequest(target_version=1, manifest=manifest, bucket_bytes=1 << 14))
    plan = mgr.plans[st.plan_id]
    u = mgr.get(st.update_id)
    flat = plan.new_buffer()
    bad = dict(t)
    bad["model.layers.0.mlp.experts.1.gate_proj.weight_scale_2"] = torch.tensor(float("nan"))
    b_bad = next(pe.bucket for pe in plan.entries if pe.name == "model.layers.0.mlp.experts.w13_weight")
    with pytest.raises(UpdateError, match="experts.1.gate_proj.weight_scale_2"):
        mgr._stage_planned(u, b_bad, plan.pack(b_bad, bad, flat))
    assert mgr.status(u).received == 0
    for b in range(len(plan.buckets)):
        mgr._stage_planned(u, b, plan.pack(b, t, flat))
    st = mgr.status(u)
    assert st.missing == [] and st.received == len(manifest)
    res = asyncio.run(mgr.commit(st.update_id))
    assert engine.calls == [("fused", len(plan.entries))] and res.weight_version == 1
    ref = engine_targets()
    commit.apply_update(ref, t, config=CFG)
    assert_same(state(ref), state(engine.targets))
    print(f"\nplanned commit: {len(manifest)} manifest entries -> {len(plan.entries)} fused entries")


def test_cached_plans_follow_fresh_storage():
    """A plan cache kept across updates (the engines keep one) writes into the storage the targets name
    now: after an engine puts fresh parameters in place, the next commit lands there, not in the old."""
    t = moe_update()
    _, entries = fused_entries(t)
    cache: dict = {}
    old = engine_targets()
    commit.apply_fused(old, entries, config=CFG, cache=cache)
    fresh, ref = engine_targets(), engine_targets()
    before = state(old)
    commit.apply_fused(fresh, entries, config=CFG, cache=cache)
    commit.apply_fused(ref, entries, config=CFG)
    assert_same(state(fresh), state(ref))
    assert_same(state(old), before)
