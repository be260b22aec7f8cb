"""SGLang nvfp4_sampler under tensor parallelism 2 (two CPU ranks, one core each) on tiny random Qwen3 (dense)
and Qwen3-MoE models: each rank holds its shard of every linear (column and row parallel; a row-parallel layer's
per-token activation amax all-reduced over the ranks) and its part of every expert's intermediate size.

  * online quantization of a BF16 checkpoint: log-probs equal the torch reference of the W4A4 model within TOL
    (the ranks' partial sums are added in another order than one rank's);
  * a whole BF16 update through update_weights_from_tensor equals a fresh TP = 2 engine loaded with the new
    weights, bit for bit; the pre-quantized triplets of the first seed restore the loaded log-probs exactly;
  * an update one rank refuses (SGLang hands each rank its own payload: rank 1's carries a NaN, rank 0's is
    good) is refused on both ranks, nothing written on either.
Run in the SGLang venv (see tests/sglang_helpers.py).
"""
from __future__ import annotations

import os
from unittest import mock

import pytest
import torch

pytest.importorskip("sglang")

from nvfp4_sampler.converters.convert import convert  # noqa: E402
from nvfp4_sampler.testing import models  # noqa: E402
from tests.sglang_helpers import bucket_payloads, make_engine, prompt_logprobs, update  # noqa: E402
from tests.sglang_helpers import checkpoint_tensors as tensors  # noqa: E402
from tests.vllm_helpers import reference_logprobs, reference_model, token_ids  # noqa: E402

pytestmark = pytest.mark.engine
TOL = 1e-3                                   # as tests/test_sglang_engine.py (float32 engines)
TP = dict(tp_size=2, dtype="float32")
BUILD = {"dense": models.tiny_qwen3, "moe": models.tiny_qwen3_moe}
NAN_IN = {"dense": "model.layers.1.mlp.down_proj.weight", "moe": "model.layers.1.mlp.experts.3.down_proj.weight"}


@pytest.fixture(scope="module", autouse=True)
def one_core_a_rank():
    """SGLang's CPU ranks bind one NUMA node each unless told their cores; this machine has one node."""
    with mock.patch.dict(os.environ, {"SGLANG_CPU_OMP_THREADS_BIND": "0|1"}):
        yield


@pytest.fixture(scope="module", params=sorted(BUILD))
def kind(request):
    return request.param


@pytest.fixture(scope="module")
def ckpts(kind, tmp_path_factory):
    d = tmp_path_factory.mktemp(f"sglang_tp_{kind}")
    paths = {s: BUILD[kind](d / f"bf16_{s}", seed=s) for s in (0, 1)}
    convert(paths[0], d / "pq_0")
    return {**paths, "pq_0": d / "pq_0"}


@pytest.fixture(scope="module")
def ids(ckpts):
    return token_ids(ckpts[0])


@pytest.fixture(scope="module")
def fresh_1(ckpts, ids):
    """Log-probs of a TP = 2 engine loaded from the BF16 checkpoint of seed 1 (then shut down)."""
    engine = make_engine(ckpts[1], quantization="nvfp4_sampler", **TP)
    try:
        return prompt_logprobs(engine, ids)
    finally:
        engine.shutdown()


@pytest.fixture(scope="module")
def engine(ckpts, fresh_1):
    engine = make_engine(ckpts[0], quantization="nvfp4_sampler", **TP)
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def base(engine, ids):
    return prompt_logprobs(engine, ids)


def test_sharded_logprobs_equal_torch_reference(ckpts, ids, base):
    assert (base - reference_logprobs(reference_model(ckpts[0]), ids)).abs().max().item() < TOL


def test_update_equals_fresh_sharded_engine_and_restores(ckpts, ids, engine, base, fresh_1):
    update(engine, tensors(ckpts[1]))
    updated = prompt_logprobs(engine, ids)
    assert (updated - base).abs().max().item() > 20 * TOL
    assert torch.equal(updated, fresh_1)
    update(engine, tensors(ckpts["pq_0"]))
    assert torch.equal(prompt_logprobs(engine, ids), base)


def test_update_one_rank_refuses_is_refused_on_both(kind, ckpts, ids, engine, base):
    update(engine, tensors(ckpts["pq_0"]))
    good = tensors(ckpts[1])
    bad = dict(good)
    bad[NAN_IN[kind]] = good[NAN_IN[kind]].clone()
    bad[NAN_IN[kind]].view(-1)[0] = float("nan")
    assert engine.begin_weight_update()[0]
    ok, message = engine.update_weights_from_tensor(bucket_payloads(good) + bucket_payloads(bad),
                                                    load_format="flattened_bucket")
    assert engine.end_weight_update()[0]
    assert not ok and "another tensor-parallel rank refused it" in message, message
    assert torch.equal(prompt_logprobs(engine, ids), base)
