"""The sidecar with the embedded engine, as a real process on 127.0.0.1: every route, the update
transaction and its faults, consistency under concurrent reads, auth and bind rules."""
from __future__ import annotations

import contextlib
import random
import socket
import subprocess
import sys
import threading
import time

import httpx
import openai
import pytest
import torch

from nvfp4_sampler.server.client import SamplerClient, SidecarError
from nvfp4_sampler.server.process import sidecar
from nvfp4_sampler.server.protocol import FRAMES_CONTENT_TYPE, WEIGHT_VERSION_HEADER
from nvfp4_sampler.server.settings import Settings
from nvfp4_sampler.server.wire import encode_frame, iter_entries
from tests.server_fixtures import PROMPT_LENS, SEQS, TOKEN, build_models, lp, reads_during_pushes, tensors

pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return build_models(tmp_path_factory.mktemp("models"))


@pytest.fixture(scope="module")
def server(models, tmp_path_factory):
    env = {"NVFP4_SAMPLER_UPDATE_IDLE_TIMEOUT_S": "3"}
    with sidecar(models["a"], engine="embedded", log=tmp_path_factory.mktemp("log") / "sidecar.log",
                 env=env, extra=["--token", TOKEN]) as srv:
        yield srv


@pytest.fixture(scope="module")
def reference_logprobs(models, tmp_path_factory):
    """Log-probs of SEQS from fresh servers loaded with the pushed weights (B as a sampler checkpoint)."""
    out = {}
    for key in ("a", "b_nvfp4"):
        with sidecar(models[key], engine="embedded", log=tmp_path_factory.mktemp("log") / f"{key}.log") as srv:
            with SamplerClient(srv.url) as c:
                out[key] = [r.logprobs for r in c.logprobs(SEQS, PROMPT_LENS, top_k=3).results]
    return out


@pytest.fixture()
def client(server):
    with SamplerClient(server.url, token=TOKEN, retries=0) as c:
        yield c


def test_read_routes(server, client, models):
    h = client.health()
    assert h["status"] == "ok" and h["engine"] == "embedded" and h["model"] == str(models["a"])
    v = client.version()
    assert v.engine == "embedded" and v.update is None and v.weight_version == h["weight_version"]
    metrics = httpx.get(f"{server.url}/metrics").text
    assert "nvfp4_sampler_weight_version" in metrics and "nvfp4_sampler_queue_depth" in metrics
    models_list = httpx.get(f"{server.url}/v1/models").json()
    assert models_list["data"][0]["id"] == str(models["a"])


def test_logprobs_json_binary_topk(client):
    js = client.logprobs(SEQS, PROMPT_LENS, top_k=4)
    bi = client.logprobs(SEQS, PROMPT_LENS, top_k=4, format="binary")
    assert [len(r.logprobs) for r in js.results] == [5, 3]
    for a, b in zip(js.results, bi.results):
        assert a.top_ids == b.top_ids
        assert torch.allclose(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=0, rtol=1e-6)
        lp = torch.tensor(a.top_logprobs)
        assert (lp[:, :-1] >= lp[:, 1:]).all() and (lp <= 0).all()
        # the realised token's log-prob can never beat the best one
        assert all(x <= top[0] + 1e-6 for x, top in zip(a.logprobs, a.top_logprobs))
    # batching does not change a sequence's result (per-token activation scales)
    alone = client.logprobs([SEQS[1]], [PROMPT_LENS[1]]).results[0].logprobs
    assert alone == js.results[1].logprobs


def test_logprobs_bad_requests(server):
    r = httpx.post(f"{server.url}/v1/logprobs", json={"sequences": [[1, 2]], "prompt_lens": [2]})
    assert r.status_code == 422 and "prompt_len must be in [1, 1]" in r.json()["detail"]
    r = httpx.post(f"{server.url}/v1/logprobs", json={"sequences": [[1, 99999]], "prompt_lens": [1]})
    assert r.status_code == 422 and "token id >= vocab size 512" in r.json()["detail"]


def test_openai_client_chat_and_completions(server, models):
    oa = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused")
    raw = oa.chat.completions.with_raw_response.create(
        model=str(models["a"]), messages=[{"role": "user", "content": "The capital of France"}],
        max_tokens=6, temperature=0, logprobs=True, top_logprobs=2)
    chat = raw.parse()
    assert raw.headers[WEIGHT_VERSION_HEADER].isdigit()
    content = chat.choices[0].logprobs.content
    assert 1 <= len(content) <= 6 and all(len(t.top_logprobs) == 2 for t in content)
    assert all(t.logprob <= t.top_logprobs[0].logprob + 1e-6 for t in content)
    comp = oa.completions.create(model=str(models["a"]), prompt="The quick brown", max_tokens=5, temperature=0,
                                 logprobs=1)
    again = oa.completions.create(model=str(models["a"]), prompt="The quick brown", max_tokens=5, temperature=0)
    assert comp.choices[0].text == again.choices[0].text            # greedy is deterministic
    assert len(comp.choices[0].logprobs.token_logprobs) == 5
    with pytest.raises(openai.NotFoundError):
        oa.completions.create(model="nope", prompt="x", max_tokens=1)


def test_auth_required_for_mutations(server, models):
    manifest = [e.model_dump() for e in iter_entries(tensors(models["b"]))]
    body = {"target_version": 1000, "manifest": manifest}
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": TOKEN}):
        r = httpx.post(f"{server.url}/v1/weights/updates", json=body, headers=headers)
        assert r.status_code == 401 and "bearer token" in r.json()["detail"]
    assert httpx.post(f"{server.url}/v1/weights/updates/x/commit").status_code == 401


def test_bind_rules(models):
    with pytest.raises(ValueError, match="refusing to bind 0.0.0.0: a non-loopback bind needs a token"):
        Settings(model=str(models["a"]), engine="embedded", host="0.0.0.0")
    assert Settings(model=str(models["a"]), engine="embedded", host="0.0.0.0", token="t").host == "0.0.0.0"
    assert Settings(model=str(models["a"]), engine="embedded", host="::1").token is None
    p = subprocess.run([sys.executable, "-m", "nvfp4_sampler.server.cli", "serve", str(models["a"]), "--engine", "embedded",
                        "--host", "0.0.0.0"], capture_output=True, text=True, timeout=120)
    assert p.returncode != 0 and "a non-loopback bind needs a token" in p.stderr


def test_push_equals_fresh_engine_and_faults_keep_old_version(client, models, reference_logprobs):
    """Pushes of B (NVFP4 converted here, and BF16 quantized by the sampler) give exactly the log-probs
    of a fresh engine loaded with B; then 60 broken bodies each leave that version serving."""
    v0, lp0 = lp(client)
    assert lp0 == reference_logprobs["a"]
    res = client.push(models["b"], layout="nvfp4", progress=False)
    assert res.weight_version == v0 + 1
    v1, lp1 = lp(client)
    assert v1 == v0 + 1 and lp1 == reference_logprobs["b_nvfp4"] and lp1 != lp0
    res = client.push(models["b"], layout="bf16", progress=False)
    v2, lp2 = lp(client)
    assert v2 == v0 + 2 and lp2 == reference_logprobs["b_nvfp4"]    # sampler-side = trainer-side quantization

    # fault injection: truncate or corrupt the body at random offsets, >= 50 cases
    a = tensors(models["a"])
    entries = list(iter_entries(a))
    body = b"".join(bytes(b) for e in entries for b in encode_frame(e, a))
    rng = random.Random(1234)
    for case in range(60):
        st = client.begin(v2 + 1, entries)
        cut = rng.randrange(1, len(body))
        if case % 2:
            broken = body[:cut]
        else:
            broken = bytearray(body)
            broken[cut] ^= rng.randrange(1, 256)
            broken = bytes(broken)
        r = httpx.put(f"{client.http.base_url}/v1/weights/updates/{st.update_id}/body", content=broken,
                      headers={"Authorization": f"Bearer {TOKEN}", "Content-Type": FRAMES_CONTENT_TYPE})
        assert r.status_code in (400, 413, 422), (case, r.status_code, r.text)
        detail = r.json()["detail"]
        assert any(w in detail for w in ("truncated", "checksum", "header", "magic", "nbytes", "NaN", "manifest",
                                         "scale", "exceeds")), detail
        status = client.status(st.update_id)
        assert status.missing, case
        with pytest.raises(SidecarError, match="not received yet") as e:
            client.commit(st.update_id)
        assert e.value.status == 409
        client.abort(st.update_id)
        assert lp(client) == (v2, lp2), case


def test_resume_sends_only_missing(client, models, reference_logprobs):
    """A body cut after some frames keeps them; the client re-sends only the missing ones."""
    client.push(models["a"], layout="nvfp4", progress=False)            # start from A again
    v, _ = lp(client)
    b = tensors(models["b_nvfp4"])
    entries = list(iter_entries(b))
    st = client.begin(v + 1, entries)
    first = [bytes(x) for e in entries[:10] for x in encode_frame(e, b)]
    partial = b"".join(first) + bytes(encode_frame(entries[10], b)[0])[:7]
    r = httpx.put(f"{client.http.base_url}/v1/weights/updates/{st.update_id}/body", content=partial,
                  headers={"Authorization": f"Bearer {TOKEN}"})
    assert r.status_code == 400 and "truncated inside frame 11" in r.json()["detail"]
    st = client.status(st.update_id)
    assert st.missing == [e.name for e in entries[10:]] and st.received == 10
    st = client.send(st.update_id, [x for e in entries if e.name in st.missing for x in encode_frame(e, b)])
    assert st.missing == []
    assert client.commit(st.update_id).weight_version == v + 1
    assert lp(client) == (v + 1, reference_logprobs["b_nvfp4"])


@pytest.mark.parametrize("port", ["main", "data"])
def test_frames_before_a_bad_frame_stay_staged(client, models, reference_logprobs, port):
    """Issue 14 defect: frames completed in the same chunk as a later bad frame were not staged, so a
    resume re-sent them. Ten good frames and a corrupt one in one small body: the ten stay."""
    client.push(models["a"], layout="nvfp4", progress=False)
    v, _ = lp(client)
    b = tensors(models["b_nvfp4"])
    entries = list(iter_entries(b))
    st = client.begin(v + 1, entries)
    good = b"".join(bytes(x) for e in entries[:10] for x in encode_frame(e, b))
    bad = bytearray(b"".join(bytes(x) for x in encode_frame(entries[10], b)))
    bad[-1] ^= 0x01                                          # last payload byte: checksum mismatch
    base = client.http.base_url if port == "main" else client.http.base_url.copy_with(port=st.data_port)
    r = httpx.put(f"{str(base).rstrip('/')}/v1/weights/updates/{st.update_id}/body", content=good + bytes(bad),
                  headers={"Authorization": f"Bearer {TOKEN}", "Content-Type": FRAMES_CONTENT_TYPE})
    assert r.status_code == 400 and f"{entries[10].name}: checksum mismatch" in r.json()["detail"], r.text
    st = client.status(st.update_id)
    assert st.received == 10 and st.missing == [e.name for e in entries[10:]]
    st = client.send(st.update_id, [x for e in entries if e.name in st.missing for x in encode_frame(e, b)])
    assert client.commit(st.update_id).weight_version == v + 1
    assert lp(client) == (v + 1, reference_logprobs["b_nvfp4"])


def test_bad_updates_are_refused_with_named_problems(client, models):
    v, before = lp(client)
    b = tensors(models["b"])
    entries = list(iter_entries(b))
    bad = entries[0].model_copy(update={"name": "model.layers.9.mlp.nope.weight"})
    with pytest.raises(SidecarError, match="model.layers.9.mlp.nope.weight: unknown tensor name"):
        client.begin(v + 1, [bad])
    wrong = entries[1].model_copy(update={"shape": [3, 3]})
    with pytest.raises(SidecarError, match=rf"{entries[1].name}: shape \[3, 3\] does not match"):
        client.begin(v + 1, [wrong])
    norm = next(e for e in entries if "norm" in e.name)
    nv = norm.model_copy(update={"layout": "nvfp4", "dtype": "nvfp4", "name": "model.embed_tokens.weight",
                                 "shape": [512, 128]})
    with pytest.raises(SidecarError, match="model.embed_tokens.weight: this tensor is not quantized"):
        client.begin(v + 1, [nv])
    with pytest.raises(SidecarError, match="must be greater than the current version") as e:
        client.begin(v, entries)
    assert e.value.status == 409
    st = client.begin(v + 1, entries)
    with pytest.raises(SidecarError, match="is in progress") as e:
        client.begin(v + 2, entries)
    assert e.value.status == 409
    # a frame not in the manifest, and NaN in a BF16 payload
    other = {"lm_head.weight": b["lm_head.weight"]}
    nan = dict(b)
    nan["model.norm.weight"] = nan["model.norm.weight"].clone()
    nan["model.norm.weight"][3] = float("inf")
    norm_entry = next(e for e in entries if e.name == "model.norm.weight")
    with pytest.raises(SidecarError, match="model.norm.weight: payload holds NaN or Inf") as e:
        client.send(st.update_id, encode_frame(norm_entry, nan))
    assert e.value.status == 422
    client.abort(st.update_id)
    st = client.begin(v + 1, [norm_entry])
    with pytest.raises(SidecarError, match="lm_head.weight: not in the update's manifest"):
        client.send(st.update_id, encode_frame(next(e for e in entries if e.name == "lm_head.weight"), other))
    client.abort(st.update_id)
    assert lp(client) == (v, before)


def test_killed_client_leaves_old_version(client, models, server):
    """A pushing process killed mid-body: old version serves; the stale update expires (3 s here)."""
    v, before = lp(client)
    script = (
        "import time, sys, httpx\n"
        "from safetensors.torch import load_file\n"
        "from server.client import SamplerClient\n"
        "from server.wire import iter_entries, encode_frame\n"
        f"t = load_file({str(models['b'] / 'model.safetensors')!r})\n"
        "entries = list(iter_entries(t))\n"
        f"c = SamplerClient({server.url!r}, token={TOKEN!r})\n"
        f"st = c.begin({v + 1}, entries)\n"
        "print(st.update_id, flush=True)\n"
        "def body():\n"
        "    for i, e in enumerate(entries):\n"
        "        yield from (bytes(b) for b in encode_frame(e, t))\n"
        "        if i == 5: time.sleep(60)\n"
        "c.http.put(f'/v1/weights/updates/{st.update_id}/body', content=body())\n")   # unbuffered frames
    p = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    update_id = p.stdout.readline().strip()
    deadline = time.monotonic() + 30
    while client.status(update_id).received < 6 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert client.status(update_id).received == 6
    p.kill()
    p.wait()
    assert lp(client) == (v, before)
    entries = list(iter_entries(tensors(models["b"])))
    time.sleep(4)
    st = client.begin(v + 1, entries)                   # the dead client's update expired
    assert st.update_id != update_id and st.received == 0
    client.abort(st.update_id)
    assert lp(client) == (v, before)


def test_concurrent_logprobs_during_updates_see_one_version(client, models):
    """Readers hammer /v1/logprobs while two updates commit: every answer is exactly the log-probs of
    the version it reports."""
    seen = reads_during_pushes(client, str(client.http.base_url), models, readers=4)
    versions = {s[0] for s in seen}
    assert len(seen) >= 8 and len(versions) >= 2, (len(seen), versions)


class CuttingProxy:
    """A TCP proxy on 127.0.0.1 that drops the first connection carrying a PUT after `cut` bytes:
    a real dropped connection mid-body, for the client's resume path."""

    def __init__(self, upstream_port: int, cut: int):
        self.upstream_port, self.cut, self.cuts = upstream_port, cut, 0
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen()
        self.port = self.sock.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            up = socket.create_connection(("127.0.0.1", self.upstream_port))
            threading.Thread(target=self._pump, args=(conn, up, True), daemon=True).start()
            threading.Thread(target=self._pump, args=(up, conn, False), daemon=True).start()

    def _pump(self, src, dst, upstream: bool):
        sent, cutting = 0, False          # bytes since the PUT began (keep-alive: any request start)
        try:
            while data := src.recv(1 << 16):
                if upstream and data.startswith(b"PUT ") and self.cuts == 0:
                    cutting, self.cuts, sent = True, 1, 0
                if cutting and sent + len(data) > self.cut:
                    dst.sendall(data[: self.cut - sent])
                    break
                dst.sendall(data)
                sent += len(data)
        except OSError:
            pass
        for s in (src, dst):
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
            s.close()


class _ViaProxy(SamplerClient):
    """A client whose bodies go to the data-plane port through `proxy_port` (a real TCP hop)."""

    proxy_port = 0

    def begin(self, target_version, manifest):
        st = super().begin(target_version, manifest)
        self._data_ports[st.update_id] = self.proxy_port
        return st


def test_client_resumes_after_a_dropped_connection(client, server, models, reference_logprobs):
    client.push(models["a"], layout="nvfp4", progress=False)
    v, _ = lp(client)
    proxy = CuttingProxy(client.health()["data_port"], cut=200_000)
    with _ViaProxy(server.url, token=TOKEN, retries=3) as c:
        c.proxy_port = proxy.port
        res = c.push(models["b"], layout="nvfp4", progress=False)
    assert proxy.cuts == 1
    assert res.weight_version == v + 1 and res.payload_bytes > 200_000
    assert res.commit.bytes == res.payload_bytes         # every frame arrived once: only the missing were re-sent
    assert lp(client) == (v + 1, reference_logprobs["b_nvfp4"])


def test_openai_streaming_matches_non_streaming(server, models):
    """`stream: true` through the sidecar with the official client: the chunks join to the greedy
    non-streamed answer, the stream carries X-Weight-Version, and errors come before the stream."""
    oa = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused")
    msgs = [{"role": "user", "content": "The capital of France"}]
    full = oa.chat.completions.create(model=str(models["a"]), messages=msgs, max_tokens=8, temperature=0)
    raw = oa.chat.completions.with_raw_response.create(model=str(models["a"]), messages=msgs, max_tokens=8,
                                                       temperature=0, stream=True)
    assert raw.headers[WEIGHT_VERSION_HEADER].isdigit()
    chunks = list(raw.parse())
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == full.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == full.choices[0].finish_reason
    comp = oa.completions.create(model=str(models["a"]), prompt="The quick brown", max_tokens=6, temperature=0)
    pieces = list(oa.completions.create(model=str(models["a"]), prompt="The quick brown", max_tokens=6,
                                        temperature=0, stream=True))
    assert len(pieces) >= 2 and "".join(p.choices[0].text for p in pieces) == comp.choices[0].text
    with pytest.raises(openai.NotFoundError):
        oa.completions.create(model="nope", prompt="x", max_tokens=1, stream=True)


def test_a_push_waits_for_a_running_stream(client, server, models):
    """A stream pins its weight version: a commit started mid-stream lands after it, so every token of the
    stream is the old version's (the same text as a plain completion before the push, which the new
    version's differs from). Checked on the text, not on client-side clocks: the push thread may stamp its
    end before the main thread stamps the stream's (both after the server released the stream)."""
    oa = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused")
    client.push(models["a"], layout="nvfp4", progress=False)            # A's weights, whatever ran before
    v, _ = lp(client)
    request = dict(model=str(models["a"]), prompt="Once upon a time", max_tokens=48, temperature=0)
    before = oa.completions.create(**request).choices[0].text
    raw = oa.completions.with_raw_response.create(**request, stream=True)
    stream = iter(raw.parse())
    pieces = [next(stream).choices[0].text]                 # the stream is running
    done = {}

    def push():
        with SamplerClient(server.url, token=TOKEN) as c:
            done["result"] = c.push(models["b"], layout="nvfp4", progress=False)

    t = threading.Thread(target=push)
    t.start()
    pieces += [c.choices[0].text for c in stream]
    t.join()
    after = oa.completions.create(**request).choices[0].text
    assert int(raw.headers[WEIGHT_VERSION_HEADER]) == v and done["result"].weight_version == v + 1
    assert "".join(pieces) == before != after


def test_ipc_buckets_update_equals_fresh_engine(client, models, reference_logprobs):
    """The colocated route on CPU (shared-memory files, the same transaction code as CUDA IPC): two
    buckets, commit, log-probs of a fresh engine; a bucket with NaN is refused whole, naming it."""
    client.push(models["a"], layout="nvfp4", progress=False)
    v, before = lp(client)
    b = tensors(models["b_nvfp4"])
    names = [e.name for e in iter_entries(b)]
    st = client.begin(v + 1, list(iter_entries(b)))
    bad = dict(b)
    scale = next(n for n in names if n.endswith("q_proj.weight")).removesuffix(".weight") + ".weight_scale"
    bad[scale] = b[scale].clone()
    bad[scale].view(torch.uint8)[0, 0] = 0x7F                 # float8_e4m3fn NaN
    with pytest.raises(SidecarError, match=f"{scale}: payload holds NaN or Inf") as e:
        client.send_ipc(st.update_id, bad, names[:20])
    assert e.value.status == 422 and client.status(st.update_id).received == 0
    qname = next(n for n in names if n.endswith("q_proj.weight"))
    with pytest.raises(SidecarError, match=f"{qname}: frame is dense bfloat16 .* manifest says nvfp4") as e:
        client.send_ipc(st.update_id, tensors(models["a"]), [qname])         # BF16 where the manifest said NVFP4
    assert e.value.status == 422
    client.send_ipc(st.update_id, b, names[:20])
    st = client.send_ipc(st.update_id, b, names[20:])
    assert st.missing == [] and st.received == len(names)
    assert client.commit(st.update_id).weight_version == v + 1
    assert lp(client) == (v + 1, reference_logprobs["b_nvfp4"])


def test_planned_update_opens_a_reused_send_buffer_once():
    """A planned update holds each distinct shared buffer open (one open per buffer, not per bucket),
    and sees the sender's later writes through it."""
    from nvfp4_sampler.server import ipc
    from nvfp4_sampler.server.transactions import Update

    u = Update(id="u", target_version=1, manifest={}, slots={}, buffer=None)
    flat, other = ipc.shared_cpu_buffer(256), ipc.shared_cpu_buffer(256)
    first = u.open_buffer(ipc.share(flat))
    flat.fill_(7)                                                        # the next bucket, same buffer
    again = u.open_buffer(ipc.share(flat))
    assert again is first and bool((again == 7).all())
    assert u.open_buffer(ipc.share(other)) is not first and len(u.opened) == 2


def test_planned_buckets_update_equals_fresh_engine(client, models, reference_logprobs):
    """A planned update (`server.plan`): the trainer and the sidecar build the same plan from the
    manifest; each bucket travels as a handle and an index (fused q/k/v and gate/up, fixed offsets);
    a bucket with NaN is refused whole in one validation pass, naming the tensor, and leaves its
    entries missing; the plan is reused by id; the commit equals a fresh engine."""
    from nvfp4_sampler.server.ipc import shared_cpu_buffer
    from nvfp4_sampler.server.plan import TransferPlan

    client.push(models["a"], layout="nvfp4", progress=False)
    v, before = lp(client)
    b = tensors(models["b_nvfp4"])
    entries = list(iter_entries(b))
    plan = TransferPlan.build(entries, bucket_bytes=128 << 10)
    assert len(plan.buckets) > 1 and len(plan.entries) < len(entries)
    collections = _full_collections(client)
    st = client.begin(v + 1, entries, bucket_bytes=128 << 10)
    assert st.plan_id == plan.plan_id
    assert _full_collections(client) >= collections + 1      # a new plan: one full collection (then frozen), timed
    flat = shared_cpu_buffer(plan.new_buffer().numel())
    with pytest.raises(SidecarError, match="frames") as e:              # a planned update takes buckets only
        client.send(st.update_id, [bytes(x) for x in encode_frame(entries[0], b)])
    assert e.value.status == 409
    bad = dict(b)
    k, member = next((pe.bucket, m) for pe in plan.entries for m in pe.members
                     if m.entry.layout == "nvfp4" and len(pe.members) > 1)          # a fused entry's member
    scale = member.entry.name.removesuffix(".weight") + ".weight_scale"
    bad[scale] = b[scale].clone()
    bad[scale].view(torch.uint8)[0, 0] = 0x7F                            # float8_e4m3fn NaN
    with pytest.raises(SidecarError, match=f"{scale}: NaN") as e:
        client.send_bucket(st.update_id, k, plan.pack(k, bad, flat))
    assert e.value.status == 422 and client.status(st.update_id).received == 0
    handled = _bucket_count(client)
    steps = {s: _bucket_count(client, s) for s in ("queue", "open", "copy", "status")}
    for i in range(len(plan.buckets)):
        st = client.send_bucket(st.update_id, i, plan.pack(i, b, flat))
        left = sum(len(plan.entries[e].members) for j in range(i + 1, len(plan.buckets)) for e in plan.buckets[j].entries)
        assert st.missing is None and st.missing_count == left     # counted, not listed: O(1) a bucket
    assert st.missing_count == 0 and st.received == len(entries)
    assert client.status(st.update_id).missing == []                    # GET lists them
    assert _bucket_count(client) == handled + len(plan.buckets)          # /metrics times every bucket
    for s, n in steps.items():                                           # and each of its steps
        assert _bucket_count(client, s) == n + len(plan.buckets), s
    assert client.commit(st.update_id).weight_version == v + 1
    assert lp(client) == (v + 1, reference_logprobs["b_nvfp4"])
    st = client.begin(v + 2, plan_id=plan.plan_id)                       # the plan is reused: only its id travels
    assert st.plan_id == plan.plan_id and st.missing is None and st.missing_count == len(entries)
    assert client.status(st.update_id).missing == [e.name for e in entries]
    client.abort(st.update_id)
    assert lp(client) == (v + 1, reference_logprobs["b_nvfp4"])


def _full_collections(client) -> float:
    """Full collections the sidecar's garbage collector has run (nvfp4_sampler_gc_pause_seconds{generation="2"})."""
    head = 'nvfp4_sampler_gc_pause_seconds_count{generation="2"}'
    return next((float(x.split()[-1]) for x in client.metrics().splitlines() if x.startswith(head)), 0.0)


def _bucket_count(client, step: str | None = None) -> float:
    """IPC buckets the sidecar has handled (its nvfp4_sampler_ipc_bucket_seconds histogram), or, given
    a step, timed in that step (nvfp4_sampler_ipc_bucket_step_seconds{step=...}; 0 before the first)."""
    head = "nvfp4_sampler_ipc_bucket_seconds_count" if step is None else \
        f'nvfp4_sampler_ipc_bucket_step_seconds_count{{step="{step}"}}'
    return next((float(x.split()[-1]) for x in client.metrics().splitlines() if x.startswith(head)), 0.0)


def test_planned_update_takes_a_host_buffer_only_when_a_host_bucket_arrives(models):
    """A planned update allocates no staging buffer at begin (its buckets may stay on their GPU: in front
    of vLLM that buffer is a shared-memory file of the model's size); the first host bucket takes one."""
    from nvfp4_sampler.server.engines.embedded import EmbeddedEngine
    from nvfp4_sampler.server.ipc import shared_cpu_buffer
    from nvfp4_sampler.server.plan import TransferPlan
    from nvfp4_sampler.server.protocol import BeginRequest
    from nvfp4_sampler.server.transactions import RWLock, UpdateManager

    b = tensors(models["b_nvfp4"])
    entries = list(iter_entries(b))
    manager = UpdateManager(EmbeddedEngine(models["a"]), max_frame_bytes=1 << 30, idle_timeout_s=60, lock=RWLock())
    st = manager.begin(BeginRequest(target_version=1, manifest=entries, bucket_bytes=128 << 10))
    plan, u = manager.plans[st.plan_id], manager.current
    assert u.buffer is None
    flat = shared_cpu_buffer(plan.new_buffer().numel())
    manager._stage_planned(u, 0, plan.pack(0, b, flat))
    assert u.buffer is not None and u.buffer.numel() >= sum(bk.nbytes for bk in plan.buckets)
    manager.abort(u.id)


def test_the_embedded_engine_computes_the_quantized_transformers_model(models, tmp_path):
    """The embedded engine builds its model without initialization and writes the checkpoint into NVFP4
    storage only: its logits equal, bitwise, those of transformers' model of the same checkpoint quantized
    in place (`quantize_model`), for a BF16 checkpoint (a), a converted one (b_nvfp4, against b), one with
    tied embeddings and one with attention biases (plain tensors beside the NVFP4 weights); a checkpoint
    that leaves a quantized module unwritten is refused, naming the module."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    from nvfp4_sampler.sampler_format import SamplerConfig
    from nvfp4_sampler.sampler_plugin.torch_modules import quantize_model
    from nvfp4_sampler.server.engines.base import EngineError
    from nvfp4_sampler.server.engines.embedded import EmbeddedEngine
    from nvfp4_sampler.testing.models import tiny_qwen3

    ids, tied = torch.tensor([SEQS[0]]), tiny_qwen3(tmp_path / "tied", seed=2, tie_word_embeddings=True)
    biased = tiny_qwen3(tmp_path / "biased", seed=3, attention_bias=True)
    for served, source in ((models["a"], models["a"]), (models["b_nvfp4"], models["b"]), (tied, tied),
                           (biased, biased)):
        engine = EmbeddedEngine(served)
        engine._load()
        want = AutoModelForCausalLM.from_pretrained(source, dtype=torch.bfloat16).eval()
        quantize_model(want, SamplerConfig())
        with torch.no_grad():
            assert torch.equal(engine.model(ids).logits, want(ids).logits), served
    folder = tmp_path / "partial"
    folder.mkdir()
    for f in models["a"].iterdir():
        if f.suffix != ".safetensors":
            (folder / f.name).write_bytes(f.read_bytes())
    save_file({k: v for k, v in tensors(models["a"]).items() if "layers.0.mlp.down_proj" not in k},
              folder / "model.safetensors")
    with pytest.raises(EngineError, match="unwritten.*layers.0.mlp.down_proj"):
        EmbeddedEngine(folder)._load()
