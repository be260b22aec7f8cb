"""Colocated weight handover: a bucket of update tensors packed into one buffer shared by handle.

The trainer packs a bucket (checkpoint-named tensors on one device) into one flat uint8 buffer in
the frame payload layout of `server.wire` (each entry's parts back to back, entries 64-byte
aligned) and sends the buffer's handle; the sidecar opens it and copies the entries into its
staging area (`transactions.UpdateManager.stage_ipc`), so nothing crosses the host on a GPU.

CUDA buffers travel as CUDA IPC handles of their caching-allocator block (torch storage sharing:
`UntypedStorage._share_cuda_` / `torch.multiprocessing.reductions.rebuild_cuda_tensor`, which
waits on the producer's event); CPU buffers as shared-memory files (`_share_filename_cpu_` /
`_new_shared_filename_cpu`), the route CPU-only machines and CI exercise. Same host only.
"""
from __future__ import annotations

import base64
from collections.abc import Mapping

import torch

from nvfp4_sampler.sampler_plugin import shared_buffers

from .protocol import IpcBucket, IpcHandle, IpcTensor
from .wire import WIRE_DTYPES, entry_for, iter_entries, parts, payload_nbytes

ALIGN = 64


def _b64(b: bytes) -> str:
    return base64.b64encode(b).decode()


def shared_cpu_buffer(nbytes: int) -> torch.Tensor:
    """A flat uint8 [nbytes] CPU buffer in shared memory (torch's file_system strategy: a segment
    of the shared-memory manager, not a file anyone writes), shareable with `share`."""
    return torch.empty(0, dtype=torch.uint8).set_(torch.UntypedStorage._new_using_filename_cpu(max(nbytes, 1)), 0,
                                                  (nbytes,))


def pack(tensors: Mapping[str, torch.Tensor], names: list[str] | None = None) -> tuple[torch.Tensor, list[IpcTensor]]:
    """One flat uint8 buffer on the tensors' device holding the entries `names` (default: all
    entries of `tensors`, NVFP4 triplets grouped as in `wire.iter_entries`), and their offsets.
    A CPU buffer is allocated in shared memory."""
    entries = [entry_for(n, tensors) for n in names] if names is not None else list(iter_entries(tensors))
    offsets, total = [], 0
    for e in entries:
        offsets.append(total)
        total += -(-payload_nbytes(e) // ALIGN) * ALIGN
    device = tensors[entries[0].name].device
    if device.type == "cpu":
        flat = shared_cpu_buffer(total)
    else:
        flat = torch.empty(total, dtype=torch.uint8, device=device)
    for e, off in zip(entries, offsets):
        for p in parts(e):
            t = tensors[p.name]
            if WIRE_DTYPES.get(t.dtype) != p.dtype or tuple(t.shape) != p.shape or t.device != device:
                raise ValueError(f"{p.name}: expected {p.dtype} {list(p.shape)} on {device}, got {t.dtype} "
                                 f"{list(t.shape)} on {t.device}")
            flat[off:off + p.nbytes].copy_(t.detach().contiguous().reshape(-1).view(torch.uint8))
            off += p.nbytes
    return flat, [IpcTensor(entry=e, offset=o) for e, o in zip(entries, offsets)]


def share(flat: torch.Tensor) -> IpcHandle:
    """The handle of a flat uint8 buffer from `pack` (keep `flat` alive until the sidecar answered)."""
    storage = flat.untyped_storage()
    offset = flat.storage_offset()
    if flat.device.type == "cuda":
        (device, handle, size, storage_offset, ref_handle, ref_offset, event_handle,
         event_sync) = storage._share_cuda_()
        return IpcHandle(kind="cuda", nbytes=flat.numel(), offset=offset, handle=_b64(handle),
                         storage_size_bytes=size, device=device, storage_offset_bytes=storage_offset,
                         ref_counter_handle=_b64(ref_handle), ref_counter_offset=ref_offset,
                         event_handle=_b64(event_handle or b""), event_sync_required=event_sync)
    if flat.device.type != "cpu":
        raise ValueError(f"cannot share a buffer on {flat.device}: CUDA or CPU only")
    manager, handle, size = storage._share_filename_cpu_()
    return IpcHandle(kind="cpu", nbytes=flat.numel(), offset=offset, handle=_b64(handle), storage_size_bytes=size,
                     manager_handle=_b64(manager))


def bucket(tensors: Mapping[str, torch.Tensor], names: list[str] | None = None) -> tuple[torch.Tensor, IpcBucket]:
    """pack + share: (the buffer to keep alive until the answer, the request body)."""
    flat, items = pack(tensors, names)
    return flat, IpcBucket(buffer=share(flat), tensors=items)


def open_buffer(h: IpcHandle) -> torch.Tensor:
    """The flat uint8 [nbytes] buffer a handle names, opened in this process (same host)."""
    return shared_buffers.open_buffer(h.model_dump())
