"""Colocated weight handover on one GPU: a trainer process sends CUDA IPC handles of NVFP4 buckets
to a sidecar whose embedded engine runs on the same GPU (no host round trip), as verl / TRL
colocate / NeMo-RL hand weights over. After the commit the served log-probs equal those of a fresh
sidecar loaded with the same checkpoint, exactly.

    pytest -m gpu tests/test_gpu_sync.py      (H200; the sidecar needs fastapi/uvicorn/pydantic/xxhash)
"""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from nvfp4_sampler.server.client import SamplerClient
from nvfp4_sampler.server.process import sidecar
from tests.server_fixtures import PROMPT_LENS, SEQS, TOKEN, build_models, lp

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(900),
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

# The trainer: its own process, tensors on the GPU, two buckets through CUDA IPC, then commit.
TRAINER = """
import json, pathlib, sys, time, torch
from safetensors.torch import load_file
from nvfp4_sampler.server.client import SamplerClient
from nvfp4_sampler.server import ipc
from nvfp4_sampler.server.wire import iter_entries
url, token, folder = sys.argv[1:4]
tensors = {k: v.cuda() for f in sorted(pathlib.Path(folder).glob("*.safetensors")) for k, v in load_file(f).items()}
entries = list(iter_entries(tensors))
names = [e.name for e in entries]
_, probe = ipc.bucket(tensors, names[:1])
with SamplerClient(url, token=token) as c:
    st = c.begin(c.version().weight_version + 1, entries)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for part in (names[:len(names) // 2], names[len(names) // 2:]):
        st = c.send_ipc(st.update_id, tensors, part)
    t1 = time.perf_counter()
    res = c.commit(st.update_id)
    print(json.dumps({"kind": probe.buffer.kind, "missing": st.missing, "version": res.weight_version,
                      "send_s": t1 - t0, "commit_s": time.perf_counter() - t1,
                      "bytes": sum(t.numel() * t.element_size() for t in tensors.values())}))
"""


def test_cuda_ipc_buckets_from_a_trainer_process(tmp_path):
    models = build_models(tmp_path / "models")
    env = {"NVFP4_SAMPLER_DEVICE": "cuda"}
    with sidecar(models["b_nvfp4"], engine="embedded", env=env, log=tmp_path / "fresh.log") as fresh:
        with SamplerClient(fresh.url) as c:
            expected = lp(c)[1]
    with sidecar(models["a"], engine="embedded", env=env, log=tmp_path / "sidecar.log",
                 extra=["--token", TOKEN]) as srv, SamplerClient(srv.url, token=TOKEN) as c:
        v0, before = lp(c)
        assert before != expected
        out = subprocess.run([sys.executable, "-c", TRAINER, srv.url, TOKEN,
                              str(models["b_nvfp4"])],
                             capture_output=True, text=True, timeout=600)
        assert out.returncode == 0, out.stderr[-3000:]
        report = json.loads(out.stdout.strip().splitlines()[-1])
        print("cuda ipc:", report)
        assert report["kind"] == "cuda" and report["missing"] == [] and report["version"] == v0 + 1
        assert lp(c) == (v0 + 1, expected)
        assert c.logprobs(SEQS, PROMPT_LENS).weight_version == v0 + 1
