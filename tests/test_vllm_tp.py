"""vLLM nvfp4_sampler with tensor parallelism 2 on the CPU (two worker processes, gloo): the tiny random
Qwen3-MoE, whose experts, q / k / v, o_proj and vocab-parallel embedding and head are split over the ranks.

Sharded log-probs equal the torch reference of the W4A4 model within TOL (the row-parallel inputs' and the
experts' SwiGLU rows' amax all-reduced). Engines (float32, one at a time): a fresh one on seed 1's BF16 checkpoint (its per-rank state and log-probs
are the expected results), then one on seed 0 that takes the updates. Updates of the whole model equal the
fresh engine bit for bit on every rank: through `nvfp4_apply_update` (a BF16 file, the embedding and head
cut to each rank's vocabulary rows) and from a trainer through a weight group, each worker sent only its
shard (`server.broadcast.BroadcastWorkerExtension`); restoring seed 0 restores its log-probs exactly.
Run: flock /tmp/nvfp4-engine.lock .venv/bin/python -m pytest -q tests/test_vllm_tp.py
"""
from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from unittest import mock

import pytest
import torch
from safetensors.torch import load_file

from nvfp4_sampler.server.process import free_port
from nvfp4_sampler.testing import models
from tests.vllm_helpers import group_trainer, make_llm, prompt_logprobs, reference_logprobs, reference_model
from tests.vllm_helpers import seed_checkpoints, shutdown, token_ids

pytestmark = pytest.mark.engine
EXTENSION = "nvfp4_sampler.server.broadcast.BroadcastWorkerExtension"
TOL = 1e-3                                   # float32 engine against the float32 torch forward (test_vllm_moe)


def tp2_llm(model):
    """A TP = 2 CPU engine (one core a worker) with the weight-group extension."""
    with mock.patch.dict(os.environ, VLLM_CPU_OMP_THREADS_BIND="0|1"):   # the workers inherit it when they start
        return make_llm(model, quantization="nvfp4_sampler", dtype="float32", tensor_parallel_size=2,
                        distributed_executor_backend="mp", worker_extension_cls=EXTENSION)


def rank_states(llm, path) -> list[dict[str, torch.Tensor]]:
    """Each worker's state (`nvfp4_save_state`: its part of every tensor), by rank, as bytes."""
    llm.collective_rpc("nvfp4_save_state", args=(str(path / "state_{rank}.safetensors"),))
    return [{n: t.reshape(-1).view(torch.uint8) for n, t in load_file(path / f"state_{r}.safetensors").items()}
            for r in range(2)]


def assert_states_equal(a, b):
    for ra, rb in zip(a, b, strict=True):
        assert ra.keys() == rb.keys()
        for n in ra:
            assert torch.equal(ra[n], rb[n]), n


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    return seed_checkpoints(tmp_path_factory.mktemp("tp"), models.tiny_qwen3_moe)


@pytest.fixture(scope="module")
def ids(ckpts):
    return token_ids(ckpts["bf16_0"])


@pytest.fixture(scope="module")
def fresh_1(ckpts, ids):
    """What the updated engine must hold: a fresh TP = 2 engine on seed 1."""
    llm = tp2_llm(ckpts["bf16_1"])
    (ckpts["dir"] / "fresh_1").mkdir()
    out = {"logprobs": prompt_logprobs(llm, ids), "states": rank_states(llm, ckpts["dir"] / "fresh_1")}
    shutdown(llm)
    return out


@pytest.fixture(scope="module")
def engine(ckpts, fresh_1):
    llm = tp2_llm(ckpts["bf16_0"])
    yield llm
    shutdown(llm)


@pytest.fixture(scope="module")
def base(engine, ids):
    return prompt_logprobs(engine, ids)


def test_sharded_logprobs_equal_torch_reference(ckpts, ids, base):
    """Each rank quantizes its part of every row-parallel input (o_proj, every expert's down projection) with the
    whole row's scale (the amax all-reduced): the W4A4 model's torch reference within TOL (the ranks' partial sums
    are added in another order). Per-rank SwiGLU amaxes (before the experts' all-reduce) missed it by 0.42."""
    assert (base - reference_logprobs(reference_model(ckpts["bf16_0"]), ids)).abs().max().item() < TOL


def test_whole_bf16_update_with_vocab_parallel_embeddings(engine, ckpts, ids, fresh_1, base, tmp_path):
    for v, key in ((1, "bf16_1"), (2, "bf16_0")):
        reports = engine.collective_rpc("nvfp4_apply_update", args=(str(ckpts[key] / "model.safetensors"), v))
        assert [r["version"] for r in reports] == [v, v]
        if v == 1:
            assert_states_equal(rank_states(engine, tmp_path), fresh_1["states"])
            assert torch.equal(prompt_logprobs(engine, ids), fresh_1["logprobs"])
    assert torch.equal(prompt_logprobs(engine, ids), base)


def test_per_rank_update_through_a_weight_group(engine, ckpts, ids, fresh_1, base, tmp_path):
    """Seed 1's pre-quantized checkpoint (NVFP4 triplets, BF16 embeddings, norms, routers) sent by a trainer
    thread to both workers, each its own rows and K ranges: every rank's state equals the fresh engine's,
    then seed 0's restores the log-probs bit for bit."""
    new, old = (load_file(ckpts[k] / "model.safetensors") for k in ("pq_1", "pq_0"))
    port = free_port()
    with ThreadPoolExecutor(1) as pool:
        trainer = pool.submit(group_trainer, port, 3, [new, old])
        assert engine.collective_rpc("nvfp4_join_weight_group", args=("127.0.0.1", port, 1, 3, "gloo", 120)) == [1, 2]
        plans = engine.collective_rpc("nvfp4_share_rank_plans")
        engine.collective_rpc("nvfp4_receive_rank_update", args=(11,))
        states = rank_states(engine, tmp_path)
        lp = prompt_logprobs(engine, ids)
        engine.collective_rpc("nvfp4_receive_rank_update", args=(12,))
        nbytes, sent = trainer.result(timeout=120)
    assert sent == [True, True] and [p["bytes"] for p in plans] == [nbytes[1], nbytes[2]]
    assert nbytes[1] + nbytes[2] < 2 * nbytes[0] and max(nbytes[1], nbytes[2]) < nbytes[0]   # each its shard only
    assert_states_equal(states, fresh_1["states"])
    assert torch.equal(lp, fresh_1["logprobs"])
    assert torch.equal(prompt_logprobs(engine, ids), base)
