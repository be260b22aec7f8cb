"""The /v1/diagnostics route and `nvfp4-sampler diagnose` against real sidecars: the embedded engine
and the vLLM CPU engine (nvfp4_sampler), each a process on 127.0.0.1 serving a tiny random Qwen3.
The live CLI samples through the official openai client (the sampler's decode log-probs) and
recomputes them teacher-forced with a local per-token W4A4 learner of the same BF16 weights."""
from __future__ import annotations

import importlib.util
import json

import httpx
import pytest
import torch

from diagnostics.report import mismatch_report
from server.cli import main
from server.process import sidecar
from tests.models import tiny_qwen3

pytestmark = [pytest.mark.engine, pytest.mark.timeout(900)]
ENGINES = ["embedded", pytest.param("vllm", marks=pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                                                                      reason="vLLM not installed"))]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tiny_qwen3(tmp_path_factory.mktemp("tiny") / "qwen3")


@pytest.fixture(scope="module", params=ENGINES)
def srv(request, model_dir, tmp_path_factory):
    extra = ["--vllm-arg=--enforce-eager", "--vllm-arg=--max-model-len=512"] if request.param == "vllm" else []
    with sidecar(model_dir, engine=request.param, log=tmp_path_factory.mktemp("log") / "sidecar.log",
                 extra=extra) as s:
        yield s


def test_route_matches_the_library_and_rejects_ragged_input(srv):
    g = torch.Generator().manual_seed(0)
    mu = [(-torch.rand(n, generator=g) * 3).tolist() for n in (70, 130)]
    pi = [[x + float(d) for x, d in zip(row, torch.randn(len(row), generator=g) * 0.2)] for row in mu]
    body = {"logp_sampler": mu, "logp_learner": pi, "advantages": [1.0, -1.0]}
    r = httpx.post(f"{srv.url}/v1/diagnostics", json=body, timeout=60)
    assert r.status_code == 200, r.text
    got, want = r.json(), mismatch_report(mu, pi, advantages=[1.0, -1.0])
    assert got["metrics"] == pytest.approx(want["metrics"]) and got["directions"] == pytest.approx(want["directions"])
    assert set(got["weights"]) == {"tis", "icepop", "opsm", "triage"}
    assert [len(w) for w in got["weights"]["triage"]] == [70, 130]
    bad = httpx.post(f"{srv.url}/v1/diagnostics", json={**body, "logp_learner": [pi[0], pi[1][:-1]]}, timeout=60)
    assert bad.status_code == 422 and "logp_learner" in bad.json()["detail"]


def test_cli_live_against_the_sampler(srv, model_dir, tmp_path, request):
    if request.node.callspec.params["srv"] == "vllm":
        # measured in CI: vLLM CPU sidecar mean |gap| 0.18, max 0.51 over 48 tokens vs the teacher-forced
        # learner; likely vLLM's and transformers' different BF16 kernels amplified by per-token codes
        # (docs/NUMERICS.md section 3 and its end), not isolated per operator
        request.applymarker(pytest.mark.xfail(strict=True, reason="vLLM CPU sidecar decode gap 0.18 > 0.1"))
    out = tmp_path / "diag"
    rc = main(["diagnose", "--url", srv.url, "--model", str(model_dir), "--out", str(out), "--prompts", "2",
               "--max-tokens", "24", "--synthetic-advantages", "--operators"])
    assert rc == 0
    report = json.loads((out / "report.json").read_text())
    m = report["metrics"]
    assert m["tokens"] >= 2 and report["directions"]["tokens"] == m["tokens"]
    # the same weights on both sides, per-token W4A4: decode vs teacher-forced differ by execution only
    assert m["mean_abs_gap"] < 0.1, m
    assert all((out / f).stat().st_size > 5000 for f in ("gap_hist.png", "tail_depth.png", "directions.png"))
    ops = json.loads((out / "operators.json").read_text())
    first = ops["model.layers.0.self_attn.q_proj"]
    assert all(r["act_code_mismatch"] == 0 and r["input_rel_err"] == 0 for r in first)


def test_cli_offline_file(tmp_path):
    body = {"logp_sampler": [[-1.0, -2.0, -0.5]], "logp_learner": [[-1.1, -1.0, -3.0]], "advantages": [-1.0]}
    (tmp_path / "run.json").write_text(json.dumps(body))
    assert main(["diagnose", "--input", str(tmp_path / "run.json"), "--out", str(tmp_path / "o")]) == 0
    report = json.loads((tmp_path / "o" / "report.json").read_text())
    assert report["metrics"]["max_abs_gap"] == pytest.approx(2.5)
    assert report["weights"]["triage"][0][2] == pytest.approx(torch.tensor(-2.5).exp().item())   # gated (A<0, -2.5 deep)
