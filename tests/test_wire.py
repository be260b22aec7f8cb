"""Frame format: round trips through arbitrary chunkings, and every truncation / corruption is caught."""
from __future__ import annotations

import json
import struct
import zlib

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from nvfp4_sampler.kernels import reference
from nvfp4_sampler.server.protocol import (LogprobsResponse, SequenceLogprobs, TensorEntry, decode_logprobs_binary,
                             encode_logprobs_binary)
from nvfp4_sampler.server.wire import MAGIC, PREFIX, FrameParser, WireError, encode, iter_entries, parse


def _state(seed: int, n_dense: int, n_q: int) -> dict[str, torch.Tensor]:
    """Checkpoint-named tensors: dense bf16/f16/f32 of random shapes and NVFP4 triplets."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    dtypes = (torch.bfloat16, torch.float16, torch.float32)
    for i in range(n_dense):
        shape = tuple(int(d) for d in torch.randint(0, 9, (int(torch.randint(0, 3, (1,), generator=g)),), generator=g))
        out[f"dense.{i}.weight"] = torch.randn(shape, generator=g).to(dtypes[i % 3])
    for i in range(n_q):
        n, k = int(torch.randint(1, 5, (1,), generator=g)), 16 * int(torch.randint(1, 4, (1,), generator=g))
        q = reference.quantize_weight(torch.randn(n, k, generator=g).to(torch.bfloat16))
        out |= {f"q.{i}.weight": q.codes, f"q.{i}.weight_scale": q.block_scales, f"q.{i}.weight_scale_2": q.global_scale}
    return out


def _body(tensors) -> bytes:
    return b"".join(bytes(b) for b in encode(tensors))


def _chunks(data: bytes, cuts: list[int]):
    edges = [0, *sorted(c % (len(data) + 1) for c in cuts), len(data)]
    return [data[a:b] for a, b in zip(edges, edges[1:])]


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(torch.uint8) if a.dim() else
                                                                     a.reshape(1).view(torch.uint8),
                                                                     b.view(torch.uint8) if b.dim() else
                                                                     b.reshape(1).view(torch.uint8))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 10_000), n_dense=st.integers(0, 4), n_q=st.integers(0, 3),
       cuts=st.lists(st.integers(0, 1 << 20), max_size=12))
def test_round_trip_any_chunking(seed, n_dense, n_q, cuts):
    tensors = _state(seed, n_dense, n_q)
    data = _body(tensors)
    got = {}
    for frame in parse(_chunks(data, cuts)):
        got |= frame.tensors
    assert got.keys() == tensors.keys()
    assert all(_same(got[k], tensors[k]) for k in tensors)


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 10_000), cut=st.integers(0, 1 << 20))
def test_truncation_is_detected(seed, cut):
    tensors = _state(seed, 3, 2)
    data = _body(tensors)
    cut %= len(data)
    boundaries, off = {0}, 0          # a cut exactly between frames is a valid, shorter body
    while off < len(data):
        _, hlen, _ = PREFIX.unpack_from(data, off)
        off += PREFIX.size + hlen + json.loads(data[off + PREFIX.size:off + PREFIX.size + hlen])["nbytes"]
        boundaries.add(off)
    if cut in boundaries:
        assert sum(1 for _ in parse([data[:cut]])) == sorted(boundaries).index(cut)
    else:
        with pytest.raises(WireError, match="truncated"):
            list(parse([data[:cut]]))


@settings(max_examples=80, deadline=None)
@given(seed=st.integers(0, 10_000), pos=st.integers(0, 1 << 20), flip=st.integers(1, 255))
def test_any_corrupt_byte_is_detected(seed, pos, flip):
    data = bytearray(_body(_state(seed, 3, 2)))
    pos %= len(data)
    data[pos] ^= flip
    with pytest.raises(WireError):
        list(parse([bytes(data)]))


@settings(max_examples=100, deadline=None)
@given(junk=st.binary(max_size=300), prefix_ok=st.booleans())
def test_garbage_raises_only_wire_errors(junk, prefix_ok):
    """Random bytes are never a stream: empty input is no entries, anything else a WireError (no other
    exception, no silently accepted prefix)."""
    data = (MAGIC + junk) if prefix_ok else junk
    if not data:
        assert list(parse([data], max_frame_bytes=1 << 16)) == []
        return
    with pytest.raises(WireError):
        list(parse([data], max_frame_bytes=1 << 16))


def test_oversize_frame_refused_from_its_header():
    t = {"big.weight": torch.zeros(64, 64, dtype=torch.bfloat16)}
    header = _body(t)[:200]          # header only: the parser must refuse before any payload arrives
    p = FrameParser(max_frame_bytes=1000)
    with pytest.raises(WireError, match="exceeds the limit") as e:
        list(p.feed(header))
    assert e.value.status == 413


def test_nan_and_bad_scales_refused():
    t = torch.ones(4, 16, dtype=torch.bfloat16)
    t[1, 3] = float("nan")
    with pytest.raises(WireError, match="bad.weight: payload holds NaN") as e:
        list(parse([_body({"bad.weight": t})]))
    assert e.value.status == 422
    q = reference.quantize_weight(torch.randn(4, 32).to(torch.bfloat16))
    trip = {"q.weight": q.codes, "q.weight_scale": q.block_scales, "q.weight_scale_2": torch.tensor(-1.0)}
    with pytest.raises(WireError, match="q.weight_scale_2: global decode scale must be > 0"):
        list(parse([_body(trip)]))


def test_header_must_match_payload_size():
    entry = TensorEntry(name="x.weight", layout="dense", dtype="float32", shape=[2, 2])
    header = json.dumps({**entry.model_dump(), "nbytes": 12, "xxh3": 0}).encode()
    data = PREFIX.pack(MAGIC, len(header), zlib.crc32(header)) + header + b"\0" * 12
    with pytest.raises(WireError, match="nbytes 12 does not match dense float32 \\[2, 2\\] \\(16 bytes\\)"):
        list(parse([data]))


def test_entries_group_nvfp4_triplets():
    entries = list(iter_entries(_state(0, 2, 2)))
    assert [(e.layout, e.dtype) for e in entries] == [("dense", "bfloat16"), ("dense", "float16"),
                                                      ("nvfp4", "nvfp4"), ("nvfp4", "nvfp4")]


def test_binary_logprobs_round_trip():
    resp = LogprobsResponse(model="m", weight_version=7, results=[
        SequenceLogprobs(logprobs=[-0.5, -1.25], top_ids=[[1, 2], [3, 4]], top_logprobs=[[-0.5, -2.0], [-1.0, -1.25]]),
        SequenceLogprobs(logprobs=[-3.0], top_ids=[[5, 6]], top_logprobs=[[-0.75, -3.0]])])
    back = decode_logprobs_binary(encode_logprobs_binary(resp, top_k=2), model="m")
    assert back == resp
    assert struct.unpack_from("<4s", encode_logprobs_binary(resp, top_k=2))[0] == b"NVLP"


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 10_000), reads=st.lists(st.integers(1, 1 << 12), min_size=1, max_size=40))
def test_buffered_reads_land_in_the_slots(seed, reads):
    """The BufferedProtocol form (what the data-plane socket does): bytes written into get_buffer()
    in reads of any size; payloads end up in the caller's slots, not in parser buffers."""
    tensors = _state(seed, 3, 3)
    data = memoryview(_body(tensors))
    slots = {}

    def slot(entry, nbytes):
        slots[entry.name] = torch.empty(nbytes, dtype=torch.uint8)
        return slots[entry.name]

    parser, got, pos, i = FrameParser(max_frame_bytes=1 << 20, slot=slot), {}, 0, 0
    while pos < len(data):
        buf = parser.get_buffer()
        n = min(len(buf), reads[i % len(reads)], len(data) - pos)
        buf[:n] = data[pos:pos + n]
        pos, i = pos + n, i + 1
        for frame in parser.advance(n):
            assert all(t.untyped_storage().data_ptr() == slots[frame.entry.name].untyped_storage().data_ptr()
                       for t in frame.tensors.values())
            got |= frame.tensors
    parser.finish()
    assert got.keys() == tensors.keys() and all(_same(got[k], tensors[k]) for k in tensors)


def test_frames_before_a_bad_frame_are_yielded_first():
    """One chunk holding good frames and then a corrupt one: the good frames come out before the
    error (the issue-14 defect: they were lost with the chunk)."""
    tensors = _state(3, 4, 2)
    frames = [b"".join(bytes(b) for b in encode({k: v})) for k, v in tensors.items() if k.startswith("dense")]
    bad = bytearray(frames[-1])
    bad[-1] ^= 1
    parser, seen = FrameParser(max_frame_bytes=1 << 20), []
    with pytest.raises(WireError, match="checksum mismatch"):
        for frame in parser.feed(b"".join(frames[:-1]) + bytes(bad)):
            seen.append(frame.entry.name)
    assert len(seen) == len(frames) - 1
