"""SGLang's own HTTP server (`python -m sglang.launch_server`, a child on 127.0.0.1) with
`--quantization nvfp4_sampler`: the plugin loads through the entry point on the CLI path and
/generate returns the W4A4 prompt log-probs of the torch reference. (Weight updates are tested on
the in-process Engine, tests/test_sglang_engine.py, which calls the same tokenizer-manager methods
as the HTTP routes.)
Run in the SGLang venv (see tests/sglang_helpers.py)."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("sglang")

import httpx  # noqa: E402

from server.process import ChildServer, free_port  # noqa: E402
from tests import models  # noqa: E402
from tests.sglang_helpers import GREEDY_ONE, logprobs_from_outputs, server_command  # noqa: E402
from tests.vllm_helpers import reference_logprobs, reference_model, token_ids  # noqa: E402

pytestmark = pytest.mark.engine
TOL = 1e-3       # as tests/test_sglang_engine.py: float32 server vs float32 torch forward


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return models.tiny_qwen3(tmp_path_factory.mktemp("sglang_server") / "bf16", seed=0)


@pytest.fixture(scope="module")
def url(model, tmp_path_factory):
    port = free_port()
    cmd = server_command(model, port=port, quantization="nvfp4_sampler", dtype="float32")
    with ChildServer(cmd, url=f"http://127.0.0.1:{port}", log=tmp_path_factory.mktemp("logs") / "sglang.log") as child:
        yield child.url


def http_logprobs(url: str, ids: list[list[int]]) -> torch.Tensor:
    r = httpx.post(f"{url}/generate", json={"input_ids": ids, "sampling_params": GREEDY_ONE, "return_logprob": True,
                                            "logprob_start_len": 0}, timeout=120)
    r.raise_for_status()
    return logprobs_from_outputs(r.json(), ids)


def test_http_generate_logprobs_equal_torch_reference(url, model):
    ids = token_ids(model)
    lp = http_logprobs(url, ids)
    assert (lp - reference_logprobs(reference_model(model), ids)).abs().max().item() < TOL
