"""The sidecar in front of a real vLLM CPU engine (nvfp4_sampler + reload worker extension), all as
processes on 127.0.0.1: `sidecar --engine-url` mode, so the sidecar can be killed and restarted while
the engine keeps serving. Run under `flock /tmp/nvfp4-engine.lock`."""
from __future__ import annotations

import random
import signal
from pathlib import Path

import httpx
import openai
import pytest

from nvfp4_sampler.server.client import SamplerClient, SidecarError
from nvfp4_sampler.server.engines.vllm import vllm_server
from nvfp4_sampler.server.ipc import shared_cpu_buffer
from nvfp4_sampler.server.plan import TransferPlan
from nvfp4_sampler.server.process import ChildServer, free_port, remote_sidecar, sidecar
from nvfp4_sampler.server.protocol import FRAMES_CONTENT_TYPE, WEIGHT_VERSION_HEADER
from nvfp4_sampler.server.wire import encode_frame, iter_entries
from tests.server_fixtures import PROMPT_LENS, SEQS, TOKEN, build_models, lp, reads_during_pushes, tensors

pytest.importorskip("vllm")
pytestmark = [pytest.mark.engine, pytest.mark.timeout(1800)]
VLLM_ARGS = ["--enforce-eager", "--max-model-len", "512", "--seed", "0", "--no-enable-prefix-caching"]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return build_models(tmp_path_factory.mktemp("models"))


@pytest.fixture(scope="module")
def logs(tmp_path_factory):
    return tmp_path_factory.mktemp("logs")


@pytest.fixture(scope="module")
def fresh_b(models, logs):
    """Log-probs of SEQS from a fresh vLLM engine loaded with B (sampler checkpoint), via its own sidecar."""
    extra = [f"--vllm-arg={a}" for a in VLLM_ARGS]
    with sidecar(models["b_nvfp4"], engine="vllm", log=logs / "fresh.log", extra=extra) as srv:
        with SamplerClient(srv.url) as c:
            return lp(c)[1]


@pytest.fixture(scope="module")
def engine(models, logs, fresh_b):
    with vllm_server(models["a"], port=free_port(), log=logs / "vllm.log", extra=VLLM_ARGS) as srv:
        yield srv


def _sidecar_proc(engine_url: str, port: int, log) -> ChildServer:
    """The sidecar cannot write files: its staging dir is under a regular file (mkdir / open fail,
    root included) and its TMPDIR is an empty folder that `test_commit_hands_over_without_files`
    checks; commits must reach the workers through shared memory."""
    blocker = Path(log).parent / "not-a-dir"
    blocker.touch()
    tmp = Path(log).parent / "sidecar-tmp"
    tmp.mkdir(exist_ok=True)
    return remote_sidecar(engine_url, port=port, log=log, env={"TMPDIR": str(tmp)},
                          extra=["--token", TOKEN, "--staging-dir", str(blocker / "staging")])


@pytest.fixture(scope="module")
def side(engine, logs):
    port = free_port()
    holder = {"proc": _sidecar_proc(engine.url, port, logs / "sidecar.log").start(), "port": port}
    yield holder
    holder["proc"].stop()


@pytest.fixture()
def client(side):
    with SamplerClient(side["proc"].url, token=TOKEN, retries=0) as c:
        yield c


def test_routes_and_openai_client(side, client, models):
    h = client.health()
    assert h["engine"] == "vllm" and h["weight_version"] == 0
    assert client.version().weight_version == 0
    url = side["proc"].url
    oa = openai.OpenAI(base_url=f"{url}/v1", api_key="unused")
    model = oa.models.list().data[0].id
    raw = oa.chat.completions.with_raw_response.create(
        model=model, messages=[{"role": "user", "content": "The capital of France"}], max_tokens=5,
        temperature=0, logprobs=True, top_logprobs=2)
    assert raw.headers[WEIGHT_VERSION_HEADER] == "0"
    content = raw.parse().choices[0].logprobs.content
    assert 1 <= len(content) <= 5 and all(t.logprob <= t.top_logprobs[0].logprob + 1e-6 for t in content)
    comp = oa.completions.create(model=model, prompt=SEQS[0], max_tokens=4, temperature=0, logprobs=1)
    assert len(comp.choices[0].logprobs.token_logprobs) == 4
    assert "nvfp4_sampler_weight_version 0.0" in httpx.get(f"{url}/metrics").text


def test_streaming_passes_vllm_events_through(side, models):
    """`stream: true` through the sidecar: vLLM's own events, joined, equal the non-streamed greedy
    answer; the stream carries the weight version."""
    oa = openai.OpenAI(base_url=f"{side['proc'].url}/v1", api_key="unused")
    model = oa.models.list().data[0].id
    msgs = [{"role": "user", "content": "The capital of France"}]
    full = oa.chat.completions.create(model=model, messages=msgs, max_tokens=6, temperature=0)
    raw = oa.chat.completions.with_raw_response.create(model=model, messages=msgs, max_tokens=6, temperature=0,
                                                       stream=True)
    assert raw.headers[WEIGHT_VERSION_HEADER].isdigit()
    chunks = [c for c in raw.parse() if c.choices]
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == full.choices[0].message.content
    comp = oa.completions.create(model=model, prompt=SEQS[0], max_tokens=4, temperature=0)
    streamed = [c.choices[0].text for c in oa.completions.create(model=model, prompt=SEQS[0], max_tokens=4,
                                                                 temperature=0, stream=True) if c.choices]
    assert len(streamed) >= 2 and "".join(streamed) == comp.choices[0].text


def test_logprobs_equal_the_engine_called_directly(engine, client):
    """The sidecar's recompute is vLLM's prompt log-probs, number for number (JSON and binary)."""
    body = {"model": client.version().model, "prompt": SEQS, "max_tokens": 1, "prompt_logprobs": 0}
    choices = httpx.post(f"{engine.url}/v1/completions", json=body, timeout=120).json()["choices"]
    direct = [[c["prompt_logprobs"][t][str(s[t])]["logprob"] for t in range(p, len(s))]
              for c, s, p in zip(choices, SEQS, PROMPT_LENS)]
    assert lp(client)[1] == direct
    top = client.logprobs(SEQS, PROMPT_LENS, top_k=3, format="binary").results
    assert all(len(row) == 3 for r in top for row in r.top_ids)
    assert all(abs(a - b) < 1e-6 for r, d in zip(top, direct) for a, b in zip(r.logprobs, d))


def test_push_equals_fresh_engine(client, models, fresh_b):
    v0, lp0 = lp(client)
    assert client.push(models["b"], layout="nvfp4", progress=False).weight_version == v0 + 1
    v1, lp1 = lp(client)
    assert v1 == v0 + 1 and lp1 == fresh_b and lp1 != lp0
    client.push(models["a"], layout="nvfp4", progress=False)
    assert lp(client) == (v0 + 2, lp0)                                    # back to A exactly
    client.push(models["b"], layout="bf16", progress=False)              # quantized inside vLLM
    assert lp(client) == (v0 + 3, fresh_b)


def test_commit_hands_over_without_files(client, models, fresh_b, logs):
    """No file between the sidecar and vLLM's workers: the staging dir cannot be created (see
    `_sidecar_proc`), no regular file appears in TMPDIR; HTTP frames and IPC buckets (plain and planned) reach the
    workers as the shared staging area itself (no copy), and every result equals a fresh engine
    bitwise."""
    v0 = client.version().weight_version
    assert client.push(models["a"], layout="nvfp4", progress=False).weight_version == v0 + 1
    va, lpa = lp(client)
    assert va == v0 + 1 and lpa != fresh_b
    a, b = tensors(models["a"]), tensors(models["b"])
    entries = list(iter_entries(b))
    st = client.begin(v0 + 2, entries)
    client.send(st.update_id, [bytes(x) for e in entries for x in encode_frame(e, b)])
    assert client.commit(st.update_id).engine["copied_bytes"] == 0
    assert lp(client) == (v0 + 2, fresh_b)
    st = client.begin(v0 + 3, entries)
    client.send_ipc(st.update_id, a)                      # a shared-memory bucket, copied into staging
    assert client.commit(st.update_id).engine["copied_bytes"] == 0
    assert lp(client) == (v0 + 3, lpa)
    plan = TransferPlan.build(entries, bucket_bytes=1 << 20)
    st = client.begin(v0 + 4, entries, bucket_bytes=1 << 20)
    assert st.plan_id == plan.plan_id and len(plan.entries) < len(entries)
    flat = shared_cpu_buffer(plan.new_buffer().numel())
    for i in range(len(plan.buckets)):
        client.send_bucket(st.update_id, i, plan.pack(i, b, flat))
    assert client.commit(st.update_id).engine["copied_bytes"] == 0
    assert lp(client) == (v0 + 4, fresh_b)
    # torch's shared-memory manager keeps its Unix socket in a torch-shm-dir-* folder there: no regular file
    assert [f for f in (logs / "sidecar-tmp").rglob("*") if f.is_file()] == []


def test_faults_leave_old_version(client, models):
    v, before = lp(client)
    a = tensors(models["a"])
    entries = list(iter_entries(a))
    body = b"".join(bytes(b) for e in entries for b in encode_frame(e, a))
    rng = random.Random(7)
    for case in range(12):
        st = client.begin(v + 1, entries)
        cut = rng.randrange(1, len(body))
        broken = body[:cut] if case % 2 else body[:cut] + bytes([body[cut] ^ 0x5A]) + body[cut + 1:]
        r = httpx.put(f"{client.http.base_url}/v1/weights/updates/{st.update_id}/body", content=broken,
                      headers={"Authorization": f"Bearer {TOKEN}", "Content-Type": FRAMES_CONTENT_TYPE})
        assert 400 <= r.status_code < 500, r.text
        with pytest.raises(SidecarError, match="not received yet"):
            client.commit(st.update_id)
        client.abort(st.update_id)
    assert lp(client) == (v, before)


def test_sidecar_killed_mid_update_restarts_on_last_committed(side, engine, client, models, logs):
    v, before = lp(client)
    b = tensors(models["b"])
    entries = list(iter_entries(b))
    st = client.begin(v + 1, entries)
    half = b"".join(bytes(x) for e in entries[: len(entries) // 2] for x in encode_frame(e, b))
    client.send(st.update_id, [half])
    assert client.status(st.update_id).received == len(entries) // 2
    side["proc"].stop(sig=signal.SIGKILL)
    side["proc"] = _sidecar_proc(engine.url, side["port"], logs / "sidecar2.log").start()
    with SamplerClient(side["proc"].url, token=TOKEN) as c:
        assert c.version().weight_version == v and c.version().update is None
        assert lp(c) == (v, before)
        with pytest.raises(SidecarError) as e:
            c.status(st.update_id)
        assert e.value.status == 404


def test_concurrent_logprobs_during_updates_see_one_version(side, models):
    with SamplerClient(side["proc"].url, token=TOKEN) as c:
        seen = reads_during_pushes(c, side["proc"].url, models, readers=3)
    assert len({s[0] for s in seen}) >= 2, [s[0] for s in seen]
