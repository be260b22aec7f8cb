"""Frame format for streaming tensors in one HTTP body (docs/PROTOCOL.md), encoder and parser.

A frame is
    magic   4 bytes   b"NVF2"
    hlen    uint32 little-endian, length of the header (<= MAX_HEADER_BYTES)
    hcrc    uint32 little-endian, zlib.crc32 of the header bytes
    header  hlen bytes of UTF-8 JSON: TensorEntry fields (name, layout, dtype, shape) + nbytes + xxh3
    payload nbytes raw little-endian bytes: the entry's parts (`parts`) back to back, C order;
            xxh3 (in the header) is the 64-bit XXH3 hash of the payload (xxhash, ~15 GB/s on one core)
A body is frames back to back; it ends after a complete frame. The parser writes each payload
straight into a buffer the caller provides (its staging slot), so it holds no frame of its own.
"""
from __future__ import annotations

import dataclasses
import json
import math
import struct
import zlib
from collections.abc import Callable, Iterable, Iterator, Mapping

import numpy as np
import torch
import xxhash
from pydantic import ValidationError

from nvfp4_sampler.sampler_format import SCALE, SCALE_2, TRIPLET_DTYPES, WEIGHT, triplet_names, triplet_shapes

from .protocol import TensorEntry

MAGIC = b"NVF2"
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
    names, shapes = triplet_names(entry.name.removesuffix(f".{WEIGHT}")), triplet_shapes(*entry.shape)
    return [Part(names[kind], TRIPLET_DTYPES[kind], shapes[kind])       # weight_scale_2 first: keeps it aligned
            for kind in (SCALE_2, WEIGHT, SCALE)]


def payload_nbytes(entry: TensorEntry) -> int:
    return sum(p.nbytes for p in parts(entry))


@dataclasses.dataclass(frozen=True)
class Frame:
    entry: TensorEntry
    tensors: dict[str, torch.Tensor]   # checkpoint name -> tensor (views of the frame's slot)
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
    h = xxhash.xxh3_64()
    for b in payload:
        h.update(b)
    header = json.dumps({**entry.model_dump(), "nbytes": sum(b.nbytes for b in payload), "xxh3": h.intdigest()},
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
Slot = Callable[[TensorEntry, int], torch.Tensor]
"""slot(entry, nbytes) -> a CPU uint8 tensor [nbytes] (16-byte aligned) that receives the frame's payload."""


def new_slot(entry: TensorEntry, nbytes: int) -> torch.Tensor:
    return torch.empty(nbytes, dtype=torch.uint8)


def _parse_header(raw: bytes, max_frame_bytes: int) -> tuple[TensorEntry, int, int]:
    try:
        h = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise WireError(f"frame header is not UTF-8 JSON: {e}") from e
    if not isinstance(h, dict):
        raise WireError("frame header must be a JSON object")
    nbytes, digest = h.pop("nbytes", None), h.pop("xxh3", None)
    try:
        entry = TensorEntry.model_validate(h)
    except ValidationError as e:
        raise WireError(f"bad frame header for {h.get('name')!r}: {e.errors()[0]['msg']}") from e
    if not isinstance(nbytes, int) or not isinstance(digest, int):
        raise WireError(f"{entry.name}: frame header needs integer nbytes and xxh3")
    expected = payload_nbytes(entry)
    if nbytes != expected:
        raise WireError(f"{entry.name}: nbytes {nbytes} does not match {entry.layout} {entry.dtype} "
                        f"{entry.shape} ({expected} bytes)")
    if nbytes > max_frame_bytes:
        raise WireError(f"{entry.name}: frame of {nbytes} bytes exceeds the limit of {max_frame_bytes}", status=413)
    return entry, nbytes, digest


# (integer view, exponent mask, all-ones value: NaN or Inf); float8_e4m3fn has no Inf, NaN is S.1111.111
_NONFINITE = {torch.bfloat16: (np.int16, 0x7F80, 0x7F80), torch.float16: (np.int16, 0x7C00, 0x7C00),
              torch.float32: (np.int32, 0x7F800000, 0x7F800000), torch.float8_e4m3fn: (np.uint8, 0x7F, 0x7F)}


def _nonfinite(t: torch.Tensor) -> bool | torch.Tensor:
    """Whether a float tensor holds NaN/Inf (exponent bits all ones): a bool from numpy on the raw
    bits for CPU tensors (~GB/s, 20x torch.isfinite on BF16), a 0-dim bool tensor on other devices."""
    if t.dtype not in _NONFINITE or not t.numel():
        return False
    int_type, mask, value = _NONFINITE[t.dtype]
    if t.device.type == "cpu":
        bits = t.reshape(-1).view(torch.uint8).numpy().view(int_type)
        return bool(((bits & int_type(mask)) == int_type(value)).any())
    bits = t.reshape(-1).view(getattr(torch, np.dtype(int_type).name))
    return ((bits & mask) == value).any()


def _invalid(name: str, t: torch.Tensor) -> bool | torch.Tensor:
    bad = _nonfinite(t)
    if name.endswith(".weight_scale_2"):                     # NVFP4 global decode scale
        positive = (t > 0).all()
        bad = bad | ~positive if isinstance(bad, torch.Tensor) else bad or not bool(positive)
    return bad


def invalid_tensor(tensors: Mapping[str, torch.Tensor]) -> str | None:
    """A message naming the first tensor with NaN/Inf or a non-positive global scale
    (`*.weight_scale_2`), else None. This is the one NaN/Inf check of an update on the sidecar.
    Tensors on a GPU are checked with one host synchronisation for all of them."""
    flags = {name: _invalid(name, t) for name, t in tensors.items()}
    lazy = [name for name, f in flags.items() if isinstance(f, torch.Tensor)]
    if lazy:
        flags.update(zip(lazy, torch.stack([flags[n] for n in lazy]).tolist()))
    first = next((name for name, f in flags.items() if f), None)
    if first is None:
        return None
    if bool(_nonfinite(tensors[first])):
        return f"{first}: payload holds NaN or Inf"
    return f"{first}: global decode scale must be > 0"


def decode_payload(entry: TensorEntry, flat: torch.Tensor, *, check: bool = True) -> dict[str, torch.Tensor]:
    """Checkpoint tensors viewing the uint8 payload `flat` (any device); with `check`, raises
    WireError (422) naming a tensor with NaN/Inf or a non-positive global scale (`invalid_tensor`)."""
    out, off = {}, 0
    for p in parts(entry):
        out[p.name] = flat[off:off + p.nbytes].view(TORCH_DTYPES[p.dtype]).reshape(p.shape)
        off += p.nbytes
    if check:
        bad = invalid_tensor(out)
        if bad:
            raise WireError(bad, status=422)
    return out


class FrameParser:
    """Incremental parser with the shape of `asyncio.BufferedProtocol`.

    `get_buffer()` is where the next bytes of the body go and `advance(n)` says that n bytes were
    written there; it yields every frame they complete, one at a time, so the caller stages each
    frame before the next one is checked. Payloads are written straight into `slot(entry, nbytes)`
    (the caller's staging buffer: a socket can `recv_into` it, no copy in Python); headers and
    small frames pass through a 64 KiB scratch buffer. `feed(data)` is the copy-in form for bodies
    that arrive as bytes chunks. `finish()` raises WireError if the body stopped inside a frame.
    """

    def __init__(self, *, max_frame_bytes: int, slot: Slot = new_slot, scratch_bytes: int = 1 << 16):
        self.max_frame_bytes = max_frame_bytes
        self.slot = slot
        self._scratch = memoryview(bytearray(scratch_bytes))
        self._head = bytearray()          # prefix + header bytes of the current frame
        self._entry: TensorEntry | None = None
        self._digest = 0
        self._payload: torch.Tensor | None = None    # the slot, uint8 [nbytes]
        self._view: memoryview | None = None         # writable bytes of the slot
        self._filled = 0
        self._direct = False                          # the last get_buffer() was the slot itself
        self.frames = 0

    @property
    def in_frame(self) -> bool:
        return bool(self._head) or self._entry is not None

    def get_buffer(self) -> memoryview:
        self._direct = self._entry is not None
        return self._view[self._filled:] if self._direct else self._scratch

    def advance(self, n: int) -> Iterator[Frame]:
        if not self._direct:
            yield from self.feed(self._scratch[:n])
            return
        self._filled += n
        if self._filled == len(self._view):
            yield self._complete()

    def feed(self, data: bytes | memoryview) -> Iterator[Frame]:
        view, pos = memoryview(data).cast("B"), 0
        while pos < len(view):
            if self._entry is None:
                pos = self._feed_head(view, pos)
                if self._entry is not None and not len(self._view):
                    yield self._complete()
                continue
            n = min(len(view) - pos, len(self._view) - self._filled)
            self._view[self._filled:self._filled + n] = view[pos:pos + n]
            self._filled += n
            pos += n
            if self._filled == len(self._view):
                yield self._complete()

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
            entry, nbytes, self._digest = _parse_header(header, self.max_frame_bytes)
            payload = self.slot(entry, nbytes)
            if payload.dtype != torch.uint8 or payload.shape != (nbytes,) or payload.device.type != "cpu":
                raise WireError(f"{entry.name}: no staging slot of {nbytes} bytes", status=500)
            self._entry, self._payload, self._filled = entry, payload, 0
            self._view = memoryview(payload.numpy()).cast("B") if nbytes else memoryview(b"")
        return pos

    def _complete(self) -> Frame:
        entry, payload, view = self._entry, self._payload, self._view
        self._head, self._entry, self._payload, self._view, self._filled = bytearray(), None, None, None, 0
        digest = xxhash.xxh3_64_intdigest(view)
        if digest != self._digest:
            raise WireError(f"{entry.name}: checksum mismatch (xxh3 {digest:#x} != header {self._digest:#x})")
        self.frames += 1
        return Frame(entry, decode_payload(entry, payload), len(view))

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
