"""The trainer side of a planned update (`server.planned`): buckets quantized straight into send
buffers equal, byte for byte, the converter's output packed at the plan's offsets; NaN/Inf in a
source flags its bucket, which is never sent; sends alternate over the reused buffers. CPU tensors."""
from __future__ import annotations

import pytest
import torch

from bench.bench_sync import model_tensors
from nvfp4_sampler.converters.convert import iter_buckets
from nvfp4_sampler.sampler_format import Recipe
from nvfp4_sampler.server import push
from nvfp4_sampler.server.planned import InvalidSource, PlannedSender
from nvfp4_sampler.testing import manifests

CFG = {**manifests.QWEN3_30B_A3B, "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
       "head_dim": 16, "moe_intermediate_size": 32, "num_experts": 4, "num_hidden_layers": 2, "vocab_size": 96}


def _sender(state, *, bucket_bytes=40_000, **kw) -> tuple[PlannedSender, push.Plan]:
    return PlannedSender.of(state, config=CFG, bucket_bytes=bucket_bytes, **kw), push.plan(state, config=CFG, **kw)


@pytest.mark.parametrize("kw", [{}, {"recipe": Recipe(weight="2d", op_order="te"), "shared_group_scale": True}],
                         ids=["1d", "2d-te-shared"])
def test_filled_buckets_equal_the_converter_packed(kw):
    state = model_tensors(CFG, "cpu")
    sender, pp = _sender(state, **kw)
    plan = sender.plan
    assert len(plan.buckets) > 1
    stacked = [j for jobs in sender.jobs for j in jobs if j.split is not None]
    assert len(stacked) == 2 * CFG["num_hidden_layers"]           # w13 and w2: one job (one launch) per layer
    _assert_fills_are_the_converters(sender, pp)


def test_aliased_trainer_layers_fill_every_layer_of_the_plan():
    """bench_sync's `--distinct-layers` (the whole model's update on an 80 GB GPU): layers past the distinct
    ones hold those layers' storage under their own names, and the planned buckets of all layers are still the
    converter's bytes."""
    cfg = {**CFG, "num_hidden_layers": 3}
    state, full = model_tensors(cfg, "cpu", distinct=1), model_tensors(cfg, "cpu")
    assert state.keys() == full.keys()
    for name, t in state.items():
        if name.startswith("model.layers.2."):
            twin = state[name.replace("layers.2.", "layers.0.", 1)]
            assert t.data_ptr() == twin.data_ptr() and torch.equal(t, full[name.replace("layers.2.", "layers.0.", 1)])
    sender = PlannedSender.of(state, config=cfg, bucket_bytes=40_000)
    _assert_fills_are_the_converters(sender, push.plan(state, config=cfg))


def _assert_fills_are_the_converters(sender: PlannedSender, pp: push.Plan) -> None:
    """Every bucket the sender fills equals, byte for byte, the converter's output packed by the plan."""
    plan, direct = sender.plan, {}
    for bucket in iter_buckets(pp.source, pp.options):
        direct |= bucket
    for b in range(len(plan.buckets)):
        got = plan.new_buffer(b)
        assert sender.fill(b, got).wait() is False
        assert torch.equal(got, plan.pack(b, direct, plan.new_buffer(b))), f"bucket {b}"


def _per_expert(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The same weights under a checkpoint's per-expert names (`experts.{e}.gate_proj.weight`, ...)."""
    from nvfp4_sampler.converters import name_map
    return {m.name: (t if m.index is None else t[m.index]).contiguous()
            for n, t in state.items() for m in name_map.expand(n, tuple(t.shape))}


@pytest.mark.parametrize("kw", [{}, {"recipe": Recipe(weight="2d", op_order="te"), "shared_group_scale": True}],
                         ids=["1d", "2d-te-shared"])
def test_per_expert_sources_are_stacked_and_equal_the_converter_packed(kw, monkeypatch):
    """Per-expert source tensors (as HF checkpoints and FSDP trainers hold them) fill a stacked entry in
    chunks of stacked experts (STACK_BYTES), not one launch set per expert; the bytes are the converter's."""
    import nvfp4_sampler.server.planned as planned

    state = _per_expert(model_tensors(CFG, "cpu"))
    per_expert = 2 * CFG["moe_intermediate_size"] * CFG["hidden_size"] * 2
    monkeypatch.setattr(planned, "STACK_BYTES", 3 * per_expert)   # w13: chunks of 3 and 1 experts; w2 (half): one
    sender, pp = _sender(state, **kw)
    plan = sender.plan
    stacked = [j for jobs in sender.jobs for j in jobs if j.stack]
    assert sorted(len(j.stack) for j in stacked) == sorted([2, 4, 6] * CFG["num_hidden_layers"])  # experts x parts
    _assert_fills_are_the_converters(sender, pp)
    name = "model.layers.1.mlp.experts.2.up_proj.weight"
    state[name][5, 7] = float("nan")
    flagged = [b for b in range(len(plan.buckets)) if sender.fill(b, plan.new_buffer(b)).wait()]
    assert len(flagged) == 1 and sender.find_invalid(flagged[0]) == f"{name}: contains NaN or Inf"


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_a_non_finite_source_flags_its_bucket_only(bad):
    state = model_tensors(CFG, "cpu")
    state["model.layers.1.mlp.experts.gate_up_proj"][2, 5, 7] = bad
    sender, _ = _sender(state)
    flagged = [b for b in range(len(sender.plan.buckets)) if sender.fill(b, sender.plan.new_buffer(b)).wait()]
    assert len(flagged) == 1
    assert sender.find_invalid(flagged[0]) == "model.layers.1.mlp.experts.gate_up_proj: contains NaN or Inf"


class _Client:
    """Records what a sidecar would receive."""

    def __init__(self):
        self.sent, self.aborted = [], []

    def send_bucket(self, update_id, b, flat, *, ready=None):
        self.sent.append((b, flat.data_ptr()))

    def abort(self, update_id):
        self.aborted.append(update_id)


def test_push_alternates_buffers_and_aborts_on_a_flagged_bucket():
    state = model_tensors(CFG, "cpu")
    sender, _ = _sender(state)
    buffers = sender.new_buffers("cpu")
    client, times = _Client(), {}
    sender.push(client, "u", buffers, times=times)
    n = len(sender.plan.buckets)
    assert [b for b, _ in client.sent] == list(range(n)) and not client.aborted
    assert [p for _, p in client.sent] == [buffers[b % 2].data_ptr() for b in range(n)]
    assert set(times) == {"convert", "wait", "send", "buffer_wait"}
    state["model.layers.0.self_attn.k_proj.weight"][0, 0] = float("nan")
    client = _Client()
    with pytest.raises(InvalidSource, match="k_proj.weight: contains NaN"):
        sender.push(client, "u2", buffers)
    assert client.aborted == ["u2"] and 0 not in [b for b, _ in client.sent]
