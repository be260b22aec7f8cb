"""Tensors handed between processes of one host without files: flat uint8 buffers shared by handle
and a table of (name, dtype, shape, buffer, offset).

The sidecar (`server.ipc`, `server.engines.vllm`) shares its buffers with torch storage sharing:
CPU buffers as segments of torch's shared-memory manager (`UntypedStorage._share_filename_cpu_`),
CUDA buffers as CUDA IPC handles of their caching-allocator block (`UntypedStorage._share_cuda_`).
A handle is a dict with the fields of `server.protocol.IpcHandle` (byte strings base64). This module
opens them (torch only, so vLLM's workers and the sidecar share one implementation) and turns a
table into views of the opened buffers: no copy, no file.
"""
from __future__ import annotations

import base64
from collections.abc import Mapping, Sequence

import torch

# the dtypes a table may name (torch attribute names)
DTYPES = {name: getattr(torch, name) for name in ("bfloat16", "float16", "float32", "uint8", "float8_e4m3fn")}


def _unb64(s: str) -> bytes:
    return base64.b64decode(s.encode())


def open_buffer(h: Mapping) -> torch.Tensor:
    """The flat uint8 [nbytes] buffer a handle (an `IpcHandle` dict) names, opened in this process."""
    nbytes, offset, size = int(h["nbytes"]), int(h.get("offset", 0)), int(h["storage_size_bytes"])
    if offset + nbytes > size:
        raise ValueError(f"buffer [{offset}, {offset + nbytes}) exceeds its storage of {size} bytes")
    if h["kind"] == "cuda":
        if not torch.cuda.is_available():
            raise ValueError("a CUDA IPC handle was sent to a process without CUDA")
        from torch.multiprocessing.reductions import rebuild_cuda_tensor
        return rebuild_cuda_tensor(torch.Tensor, (nbytes,), (1,), offset, torch.UntypedStorage, torch.uint8,
                                   int(h.get("device", 0)), _unb64(h["handle"]), size,
                                   int(h.get("storage_offset_bytes", 0)), False,
                                   _unb64(h.get("ref_counter_handle", "")), int(h.get("ref_counter_offset", 0)),
                                   _unb64(h.get("event_handle", "")) or None, bool(h.get("event_sync_required")))
    if h["kind"] != "cpu":
        raise ValueError(f"unknown buffer kind {h['kind']!r}")
    storage = torch.UntypedStorage._new_shared_filename_cpu(_unb64(h["manager_handle"]), _unb64(h["handle"]), size)
    return torch.empty(0, dtype=torch.uint8).set_(storage, offset, (nbytes,))


def views(buffers: Sequence[torch.Tensor], table: Sequence[Sequence]) -> dict[str, torch.Tensor]:
    """name -> tensor view for each table row [name, dtype, shape, buffer index, byte offset]."""
    out = {}
    for name, dtype, shape, b, offset in table:
        dt = DTYPES.get(dtype)
        if dt is None:
            raise ValueError(f"{name}: unknown dtype {dtype!r}")
        n = dt.itemsize
        for s in shape:
            n *= int(s)
        flat = buffers[int(b)]
        if offset < 0 or offset % dt.itemsize or offset + n > flat.numel():
            raise ValueError(f"{name}: [{offset}, {offset + n}) is not an aligned range of its "
                             f"{flat.numel()}-byte buffer")
        out[name] = flat[offset:offset + n].view(dt).view([int(s) for s in shape])
    return out
