"""Output side of a conversion: buckets of tensors and the checkpoint folder they are written to.

    Bucket(limit, track)      collects groups of tensors up to `limit` bytes; `add` hands back a full bucket
    split_ranks(group, tp)    a group's per-rank pieces (split along `schema.tp_dim`, replicated otherwise)
    FolderWriter(folder)      safetensors shards part-1, part-2, ...; `finish` names them
                              (`schema.shard_file`) and writes the index, config.json and extra files
"""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any, Callable

import torch
from safetensors.torch import save_file

from . import schema


def nbytes(tensors: dict[str, torch.Tensor]) -> int:
    """Bytes of the tensors' elements."""
    return sum(t.numel() * t.element_size() for t in tensors.values())


class Bucket:
    """Collects groups of tensors up to `limit` bytes; `add` returns the full bucket to flush."""

    def __init__(self, limit: int, track: Callable[[int], None]):
        self.limit, self.track = limit, track
        self.tensors: dict[str, torch.Tensor] = {}
        self.bytes = 0

    def add(self, group: dict[str, torch.Tensor]) -> dict[str, torch.Tensor] | None:
        size = nbytes(group)
        full = self.take() if self.tensors and self.bytes + size > self.limit else None
        self.tensors.update(group)
        self.bytes += size
        self.track(size)
        return full

    def take(self) -> dict[str, torch.Tensor] | None:
        full, self.tensors = self.tensors, {}
        self.track(-self.bytes)
        self.bytes = 0
        return full or None


def split_ranks(group: dict[str, torch.Tensor], tp: int) -> list[dict[str, torch.Tensor]]:
    """Per-rank pieces of a group: split along schema.tp_dim, replicated otherwise."""
    ranks: list[dict[str, torch.Tensor]] = [{} for _ in range(tp)]
    for name, t in group.items():
        dim = schema.tp_dim(name)
        pieces = t.chunk(tp, dim) if dim is not None and dim < t.dim() else [t] * tp
        for r, piece in enumerate(pieces):
            ranks[r][name] = piece
    return ranks


class FolderWriter:
    """Writes buckets as numbered shards into `folder`; `finish` names them and writes the index."""

    def __init__(self, folder: Path):
        self.folder = folder
        folder.mkdir(parents=True)
        self.shards: list[list[str]] = []
        self.total = 0

    def write(self, tensors: dict[str, torch.Tensor]) -> int:
        cpu = {n: t.detach().to("cpu").contiguous() for n, t in tensors.items()}
        save_file(cpu, self.folder / f"part-{len(self.shards) + 1}", metadata=schema.SHARD_METADATA)
        self.shards.append(list(cpu))
        size = nbytes(cpu)
        self.total += size
        return size

    def finish(self, config_json: dict[str, Any], extra_files: list[Path]) -> None:
        weight_map = {}
        for i, names in enumerate(self.shards, start=1):
            file = schema.shard_file(i, len(self.shards))
            os.rename(self.folder / f"part-{i}", self.folder / file)
            weight_map.update(dict.fromkeys(names, file))
        index = {"metadata": {"total_size": self.total}, "weight_map": dict(sorted(weight_map.items()))}
        (self.folder / schema.INDEX_FILE).write_text(json.dumps(index, indent=2))
        (self.folder / schema.CONFIG_FILE).write_text(json.dumps(config_json, indent=2))
        for f in extra_files:
            shutil.copy2(f, self.folder / f.name)
