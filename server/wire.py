"""Frame format for streaming tensors in one HTTP body (docs/PROTOCOL.md), encoder and parser.

A frame is
    magic   4 bytes   b"NVF1"
    hlen    uint32 little-endian, length of the header (<= MAX_HEADER_BYTES)
    hcrc    uint32 little-endian, zlib.crc32 of the header bytes
    header  hlen bytes of UTF-8 JSON: TensorEntry fields (name, layout, dtype, shape) + nbytes + crc32
    payload nbytes raw little-endian bytes: the entry's parts (`parts`) back to back, C order;
            crc32 (in the header) is zlib.crc32 of the payload
A body is frames back to back; it ends after a complete frame. The parser holds at most one frame.
"""
from __future__ import annotations

import dataclasses
import json
import math
import struct
import zlib
from collections.abc import Iterable, Iterator, Mapping

import numpy as np
import torch
from pydantic import ValidationError

from .protocol import TensorEntry

MAGIC = b"NVF1"
PREFIX = struct.Struct("<4sII")
MAX_HEADER_BYTES = 64 * 1024

TORCH_DTYPES: dict[str, torch.dtype] = {
    "bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32,
    "uint8": torch.uint8, "float8_e4m3fn": torch.float8_e4m3fn,
}
WIRE_DTYPES = {v: k for k, v in TORCH_DTYPES.items()}


class WireError(ValueError):
    """A malformed, corrupt, truncated or oversize frame; `status` is the HTTP status to answer."""

    def __init__(self, message: str, *, status: int = 400):
        super().__init__(message)
        self.status = status


@dataclasses.dataclass(frozen=True)
class Part:
    name: str            # checkpoint tensor name
    dtype: str           # wire dtype name
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * TORCH_DTYPES[self.dtype].itemsize


def parts(entry: TensorEntry) -> list[Part]:
    """The checkpoint tensors a logical entry carries, in payload order (nvfp4: P.weight_scale_2
    float32 [], P.weight uint8 [N, K/2], P.weight_scale float8_e4m3fn [N, K/16])."""
    if entry.layout == "dense":
        return [Part(entry.name, entry.dtype, tuple(entry.shape))]
    n, k = entry.shape
    p = entry.name.removesuffix(".weight")
    return [Part(f"{p}.weight_scale_2", "float32", ()),          # first: keeps the float32 aligned
            Part(f"{p}.weight", "uint8", (n, k // 2)),
            Part(f"{p}.weight_scale", "float8_e4m3fn", (n, k // 16))]


def payload_nbytes(entry: TensorEntry) -> int:
    return sum(p.nbytes for p in parts(entry))


@dataclasses.dataclass(frozen=True)
class Frame:
    entry: TensorEntry
    tensors: dict[str, torch.Tensor]   # checkpoint name -> tensor (views of one frame buffer)
    nbytes: int


# ---------------------------------------------------------------------------------------- encoder
def _raw(t: torch.Tensor) -> memoryview:
    """The bytes of a CPU tensor in C order (no copy when already contiguous)."""
    return memoryview(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy())


def entry_for(name: str, tensors: Mapping[str, torch.Tensor]) -> TensorEntry:
    """The TensorEntry of `name`: nvfp4 if `tensors` holds its triplet (P.weight uint8 + scales), else dense."""
    t = tensors[name]
    if t.dtype == torch.uint8:
        p = name.removesuffix(".weight")
        if f"{p}.weight_scale" not in tensors or f"{p}.weight_scale_2" not in tensors:
            raise ValueError(f"{name}: uint8 weight without {p}.weight_scale / {p}.weight_scale_2")
        return TensorEntry(name=name, layout="nvfp4", dtype="nvfp4", shape=[t.shape[0], t.shape[1] * 2])
    if t.dtype not in WIRE_DTYPES or t.dtype in (torch.uint8, torch.float8_e4m3fn):
        raise ValueError(f"{name}: dtype {t.dtype} cannot be sent as a dense tensor")
    return TensorEntry(name=name, layout="dense", dtype=WIRE_DTYPES[t.dtype], shape=list(t.shape))


def encode_frame(entry: TensorEntry, tensors: Mapping[str, torch.Tensor]) -> list[memoryview | bytes]:
    """Frame of `entry` from its checkpoint tensors, as buffers to send in order (payload not copied)."""
    payload = []
    for p in parts(entry):
        t = tensors[p.name]
        if WIRE_DTYPES.get(t.dtype) != p.dtype or tuple(t.shape) != p.shape:
            raise ValueError(f"{p.name}: expected {p.dtype} {list(p.shape)}, got {t.dtype} {list(t.shape)}")
        payload.append(_raw(t))
    crc = 0
    for b in payload:
        crc = zlib.crc32(b, crc)
    header = json.dumps({**entry.model_dump(), "nbytes": sum(b.nbytes for b in payload), "crc32": crc},
                        separators=(",", ":")).encode()
    return [PREFIX.pack(MAGIC, len(header), zlib.crc32(header)) + header, *payload]


def iter_entries(tensors: Mapping[str, torch.Tensor]) -> Iterator[TensorEntry]:
    """Entries of a checkpoint-named dict: nvfp4 triplets grouped, everything else dense."""
    scale_names = set()
    for name, t in tensors.items():
        if t.dtype == torch.uint8:
            p = name.removesuffix(".weight")
            scale_names |= {f"{p}.weight_scale", f"{p}.weight_scale_2"}
    for name in tensors:
        if name not in scale_names:
            yield entry_for(name, tensors)


def encode(tensors: Mapping[str, torch.Tensor]) -> Iterator[memoryview | bytes]:
    """A whole body for a checkpoint-named dict (see `iter_entries`)."""
    for entry in iter_entries(tensors):
        yield from encode_frame(entry, tensors)


# ----------------------------------------------------------------------------------------- parser
def _parse_header(raw: bytes, max_frame_bytes: int) -> tuple[TensorEntry, int, int]:
    try:
        h = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise WireError(f"frame header is not UTF-8 JSON: {e}") from e
    if not isinstance(h, dict):
        raise WireError("frame header must be a JSON object")
    nbytes, crc = h.pop("nbytes", None), h.pop("crc32", None)
    try:
        entry = TensorEntry.model_validate(h)
    except ValidationError as e:
        raise WireError(f"bad frame header for {h.get('name')!r}: {e.errors()[0]['msg']}") from e
    if not isinstance(nbytes, int) or not isinstance(crc, int):
        raise WireError(f"{entry.name}: frame header needs integer nbytes and crc32")
    expected = payload_nbytes(entry)
    if nbytes != expected:
        raise WireError(f"{entry.name}: nbytes {nbytes} does not match {entry.layout} {entry.dtype} "
                        f"{entry.shape} ({expected} bytes)")
    if nbytes > max_frame_bytes:
        raise WireError(f"{entry.name}: frame of {nbytes} bytes exceeds the limit of {max_frame_bytes}", status=413)
    return entry, nbytes, crc


# (integer view, exponent mask, all-ones value: NaN or Inf); float8_e4m3fn has no Inf, NaN is S.1111.111
_NONFINITE = {torch.bfloat16: (np.int16, 0x7F80, 0x7F80), torch.float16: (np.int16, 0x7C00, 0x7C00),
              torch.float32: (np.int32, 0x7F800000, 0x7F800000), torch.float8_e4m3fn: (np.uint8, 0x7F, 0x7F)}


def _nonfinite(t: torch.Tensor) -> bool:
    """True if a float tensor holds NaN/Inf (exponent bits all ones; numpy on the raw bits, ~GB/s)."""
    if t.dtype not in _NONFINITE or not t.numel():
        return False
    int_type, mask, value = _NONFINITE[t.dtype]
    bits = t.reshape(-1).view(torch.uint8).numpy().view(int_type)
    return bool(((bits & int_type(mask)) == int_type(value)).any())


def decode_payload(entry: TensorEntry, buf: bytearray) -> dict[str, torch.Tensor]:
    """Checkpoint tensors viewing `buf`; raises WireError on NaN/Inf values or non-positive global scales."""
    flat = torch.frombuffer(buf, dtype=torch.uint8) if len(buf) else torch.empty(0, dtype=torch.uint8)
    out, off = {}, 0
    for p in parts(entry):
        t = flat[off:off + p.nbytes].view(TORCH_DTYPES[p.dtype]).reshape(p.shape)
        off += p.nbytes
        if _nonfinite(t):
            raise WireError(f"{p.name}: payload holds NaN or Inf", status=422)
        out[p.name] = t
    if entry.layout == "nvfp4" and not float(out[parts(entry)[0].name]) > 0:
        raise WireError(f"{parts(entry)[0].name}: global decode scale must be > 0", status=422)
    return out


class FrameParser:
    """Incremental parser: `feed(bytes)` returns the frames completed by that chunk.

    Holds at most one frame's payload (preallocated from its header) plus a small header buffer.
    `finish()` raises WireError if the stream stopped inside a frame.
    """

    def __init__(self, *, max_frame_bytes: int):
        self.max_frame_bytes = max_frame_bytes
        self._head = bytearray()          # prefix + header bytes of the current frame
        self._entry: TensorEntry | None = None
        self._crc = 0
        self._payload: bytearray | None = None
        self._filled = 0
        self.frames = 0

    @property
    def in_frame(self) -> bool:
        return bool(self._head) or self._entry is not None

    def feed(self, data: bytes | memoryview) -> list[Frame]:
        done, view, pos = [], memoryview(data), 0
        while pos < len(view):
            if self._entry is None:
                pos = self._feed_head(view, pos)
                if self._entry is not None and self._payload is not None and not len(self._payload):
                    done.append(self._complete())
                continue
            n = min(len(view) - pos, len(self._payload) - self._filled)
            self._payload[self._filled:self._filled + n] = view[pos:pos + n]
            self._filled += n
            pos += n
            if self._filled == len(self._payload):
                done.append(self._complete())
        return done

    def _feed_head(self, view: memoryview, pos: int) -> int:
        need = PREFIX.size - len(self._head)
        if need > 0:
            take = min(need, len(view) - pos)
            self._head += view[pos:pos + take]
            pos += take
            if len(self._head) < PREFIX.size:
                return pos
            magic, hlen, _ = PREFIX.unpack(bytes(self._head))
            if magic != MAGIC:
                raise WireError(f"bad frame magic {magic!r} after {self.frames} complete frame(s)")
            if hlen > MAX_HEADER_BYTES:
                raise WireError(f"frame header of {hlen} bytes exceeds {MAX_HEADER_BYTES}", status=413)
        _, hlen, hcrc = PREFIX.unpack(bytes(self._head[:PREFIX.size]))
        take = min(PREFIX.size + hlen - len(self._head), len(view) - pos)
        self._head += view[pos:pos + take]
        pos += take
        if len(self._head) == PREFIX.size + hlen:
            header = bytes(self._head[PREFIX.size:])
            if zlib.crc32(header) != hcrc:
                raise WireError(f"frame {self.frames + 1}: header checksum mismatch")
            self._entry, nbytes, self._crc = _parse_header(header, self.max_frame_bytes)
            self._payload, self._filled = bytearray(nbytes), 0
        return pos

    def _complete(self) -> Frame:
        entry, buf = self._entry, self._payload
        self._head, self._entry, self._payload, self._filled = bytearray(), None, None, 0
        if zlib.crc32(buf) != self._crc:
            raise WireError(f"{entry.name}: checksum mismatch (crc32 {zlib.crc32(buf)} != header {self._crc})")
        self.frames += 1
        return Frame(entry, decode_payload(entry, buf), len(buf))

    def finish(self) -> None:
        if self.in_frame:
            name = self._entry.name if self._entry is not None else "<header>"
            got = self._filled if self._entry is not None else len(self._head)
            raise WireError(f"stream truncated inside frame {self.frames + 1} ({name}) after {got} bytes")


def parse(chunks: Iterable[bytes], *, max_frame_bytes: int = 1 << 40) -> Iterator[Frame]:
    """All frames of a complete body given as chunks (raises WireError on any defect)."""
    parser = FrameParser(max_frame_bytes=max_frame_bytes)
    for chunk in chunks:
        yield from parser.feed(chunk)
    parser.finish()
