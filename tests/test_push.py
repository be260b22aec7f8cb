"""Trainer-side pushes against a real sidecar (embedded engine, 127.0.0.1): the `push` CLI and the
streaming pipeline's bounded host memory (RSS of a real push of a ~230 MB state dict). Resumes of a
streamed push: tests/test_server.py (cutting proxy)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from nvfp4_sampler.server.client import SamplerClient
from nvfp4_sampler.server.process import sidecar
from nvfp4_sampler.testing.models import tiny_qwen3
from tests.server_fixtures import PROMPT_LENS, SEQS, TOKEN

pytestmark = pytest.mark.timeout(600)
REPO = Path(__file__).resolve().parents[1]
# ~230 MB of BF16 linears (5 layers of 4 x 64-dim heads, hidden 1024, MLP 7168): NVFP4 output ~66 MB
BIG = dict(hidden_size=1024, intermediate_size=7168, num_hidden_layers=5)
BUCKET = 8 << 20


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("push-models")
    return {"big": tiny_qwen3(root / "big", seed=0, **BIG)}


@pytest.fixture(scope="module")
def server(models, tmp_path_factory):
    with sidecar(models["big"], engine="embedded", log=tmp_path_factory.mktemp("log") / "sidecar.log",
                 extra=["--token", TOKEN]) as srv:
        yield srv


def test_cli_push_bf16_prints_the_result_and_exits_0(server, models):
    """Issue 14 defect: `push DIR --layout bf16` committed, then exited 1 (PushResult has no model_dump_json)."""
    with SamplerClient(server.url) as c:
        before = c.version().weight_version
    r = subprocess.run([sys.executable, "-m", "nvfp4_sampler.server.cli", "push", str(models["big"]), "--layout", "bf16",
                        "--url", server.url, "--token", TOKEN], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    out = json.loads(r.stdout)
    assert out["weight_version"] == before + 1 and out["tensors"] > 0
    assert out["payload_bytes"] == out["bytes"] and out["total_seconds"] > 0
    with SamplerClient(server.url) as c:
        assert c.version().weight_version == before + 1


_MEASURED_PUSH = """
import json, re, sys, torch
from pathlib import Path
from safetensors.torch import load_file
from nvfp4_sampler.server.client import SamplerClient

folder, url, token, bucket = Path(sys.argv[1]), sys.argv[2], sys.argv[3], int(sys.argv[4])
def status(key):
    return int(re.search(key + r":\\s+(\\d+)", Path("/proc/self/status").read_text())[1]) * 1024
state = {k: v.clone() for f in sorted(folder.glob("*.safetensors")) for k, v in load_file(f).items()}
config = json.loads((folder / "config.json").read_text())
with SamplerClient(url, token=token) as c:
    c.push(state, layout="nvfp4", config=config, bucket_bytes=bucket, progress=False)   # warm-up (imports, pools)
    base = status("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")                                       # reset the peak (VmHWM)
    res = c.push(state, layout="nvfp4", config=config, bucket_bytes=bucket, progress=False)
    peak = status("VmHWM")
print(json.dumps({"base": base, "peak": peak, "payload": res.payload_bytes, "version": res.weight_version,
                  "state": sum(t.numel() * t.element_size() for t in state.values())}))
"""


def test_push_of_a_state_dict_holds_about_two_buckets_of_host_memory(server, models):
    """Peak RSS of a real NVFP4 push (VmHWM reset before it) minus the RSS before it: at most two
    8 MiB buckets + 16 MiB margin (quantizer chunk buffers, frame coalescing, HTTP), half of the
    ~66 MB the converted model takes (collecting it, as the client did, fails this)."""
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": str(1 << 20)}     # freed buffers go back to the OS
    r = subprocess.run([sys.executable, "-c", _MEASURED_PUSH, str(models["big"]), server.url, TOKEN, str(BUCKET)],
                       cwd=REPO, capture_output=True, text=True, timeout=400, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    m = json.loads(r.stdout.strip().splitlines()[-1])
    extra = m["peak"] - m["base"]
    print(f"state {m['state'] / 1e6:.0f} MB, payload {m['payload'] / 1e6:.0f} MB, peak extra {extra / 1e6:.1f} MB")
    assert m["payload"] > 6 * BUCKET                                   # the bound below is not the whole model
    assert extra <= 2 * BUCKET + (16 << 20), extra
    with SamplerClient(server.url) as c:
        assert c.version().weight_version == m["version"]
        assert len(c.logprobs(SEQS, PROMPT_LENS).results) == 2


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["nvfp4", "bf16"])
def test_gpu_state_dict_converts_on_its_device_into_pinned_buckets(layout):
    """A CUDA state dict (fused transformers-5 experts) is converted on the GPU and staged in pinned
    host buffers; the host buckets equal the CPU conversion of the same tensors byte for byte."""
    import torch

    from nvfp4_sampler.server import push
    from tests.test_converters import CONFIG

    moe = {**CONFIG, "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "num_experts": 4,
           "moe_intermediate_size": 48}
    g = torch.Generator().manual_seed(0)
    h, i = moe["hidden_size"], moe["moe_intermediate_size"]
    cpu = {"model.layers.0.self_attn.q_proj.weight": torch.randn(96, h, generator=g),
           "model.layers.0.mlp.experts.gate_up_proj": torch.randn(4, 2 * i, h, generator=g),
           "model.layers.0.mlp.experts.down_proj": torch.randn(4, h, i, generator=g),
           "model.norm.weight": torch.ones(h)}
    cpu = {n: t.to(torch.bfloat16) for n, t in cpu.items()}
    gpu = {n: t.cuda() for n, t in cpu.items()}

    def host(state) -> tuple[dict[str, torch.Tensor], set[bool]]:
        out, pinned = {}, set()
        with push.Pipeline(push.plan(state, layout=layout, config=moe, bucket_bytes=20_000)) as buckets:
            for b in buckets:
                pinned |= {t.is_pinned() for t in b.values()}
                out |= {n: t.clone() for n, t in b.items()}
        return out, pinned

    (want, _), (got, pinned) = host(cpu), host(gpu)
    assert pinned == {True}
    assert want.keys() == got.keys() and len(want) > 12
    for n in want:
        assert got[n].device.type == "cpu" and got[n].dtype == want[n].dtype
        assert torch.equal(got[n].reshape(-1).view(torch.uint8), want[n].reshape(-1).view(torch.uint8)), n


def test_push_pipeline_converts_with_the_learner_recipe():
    """push(..., recipe=Recipe(op_order="te"), shared_group_scale=True) streams what `convert` writes
    with the same options: TE's op order and one shared scale for q/k/v and for gate/up."""
    import torch

    from nvfp4_sampler.converters.convert import ConvertOptions, StateDictSource, iter_buckets
    from nvfp4_sampler.sampler_format import Recipe
    from nvfp4_sampler.server import push
    from tests.test_converters import CONFIG, _weights

    weights = _weights(seed=6)
    plan = push.plan(weights, layout="nvfp4", config=CONFIG, recipe=Recipe(op_order="te"), shared_group_scale=True)
    with push.Pipeline(plan) as buckets:
        got = {n: t.clone() for b in buckets for n, t in b.items()}
    options = ConvertOptions(recipe=Recipe(op_order="te"), shared_group_scale=True)
    want = {n: t for b in iter_buckets(StateDictSource(weights, config=CONFIG), options) for n, t in b.items()}
    assert got.keys() == want.keys()
    for n in want:
        assert torch.equal(got[n].reshape(-1).view(torch.uint8), want[n].reshape(-1).view(torch.uint8)), n
    assert len({got[f"model.layers.0.self_attn.{m}.weight_scale_2"].item() for m in ("q_proj", "k_proj", "v_proj")}) == 1
