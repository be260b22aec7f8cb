"""NVFP4 format constants and the quantized tensor container.

Conventions (docs/FORMAT.md):
  codes         uint8 [..., K/2]   two E2M1 codes per byte, even element in the low nibble
  block_scales  float8_e4m3fn [..., K/16]   one scale per 16 consecutive elements along K (linear layout)
  global_scale  float32, decode direction (S_dec = 1 / S_enc, S_enc = 2688 / amax); its shape is a
                prefix of codes.shape[:-1] and broadcasts over the remaining row dims:
                [] per tensor, [E] per expert of an [E, N, K] weight, [..., M] per row (per token)
  layout        where codes and block scales sit in their tensors (same shapes and dtypes either way):
                "modelopt" as above (checkpoints, the wire, every converter); "mma_tiled" the engine-side
                order of `kernels.cuda_mma.tile_weight` (2-D weights; each 16-row block of rows stays in
                the byte range of those rows)
"""
from __future__ import annotations

import dataclasses

import torch

BLOCK = 16                      # elements per E4M3 block scale
E2M1_MAX = 6.0
E4M3_MAX = 448.0
GLOBAL_ENCODE_NUMERATOR = E4M3_MAX * E2M1_MAX   # 2688: S_enc = 2688 / amax
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)   # magnitude by code bits [2:0]
SWIZZLE_ROWS, SWIZZLE_COLS = 128, 4                    # tile of the 128x4 scale layout
LAYOUTS = ("modelopt", "mma_tiled")


@dataclasses.dataclass(frozen=True)
class NVFP4Tensor:
    """A tensor of logical shape [..., K] in NVFP4 with linear-layout block scales."""

    codes: torch.Tensor          # uint8 [..., K/2]
    block_scales: torch.Tensor   # float8_e4m3fn [..., K/16]
    global_scale: torch.Tensor   # float32, a prefix of codes.shape[:-1] ([] per tensor), decode direction
    layout: str = "modelopt"     # one of LAYOUTS

    def __post_init__(self):
        if self.layout not in LAYOUTS:
            raise ValueError(f"layout must be one of {LAYOUTS}, got {self.layout!r}")
        if self.codes.dtype != torch.uint8:
            raise TypeError(f"codes must be uint8, got {self.codes.dtype}")
        if self.block_scales.dtype != torch.float8_e4m3fn:
            raise TypeError(f"block_scales must be float8_e4m3fn, got {self.block_scales.dtype}")
        if self.global_scale.dtype != torch.float32:
            raise TypeError(f"global_scale must be float32, got {self.global_scale.dtype}")
        k = self.codes.shape[-1] * 2
        if self.block_scales.shape != (*self.codes.shape[:-1], k // BLOCK):
            raise ValueError(f"block_scales shape {tuple(self.block_scales.shape)} does not match "
                             f"codes shape {tuple(self.codes.shape)} (expected [..., {k // BLOCK}])")
        rows = self.codes.shape[:-1]
        if self.global_scale.shape != rows[:self.global_scale.dim()]:
            raise ValueError(f"global_scale shape {tuple(self.global_scale.shape)} must be a prefix "
                             f"of the row shape {tuple(rows)}")

    @property
    def shape(self) -> torch.Size:
        """Logical (unpacked) shape [..., K]."""
        return torch.Size((*self.codes.shape[:-1], self.codes.shape[-1] * 2))

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.codes, self.block_scales, self.global_scale))

    def row_global_scale(self) -> torch.Tensor:
        """global_scale broadcast to the row shape codes.shape[:-1] (float32)."""
        rows = self.codes.shape[:-1]
        gs = self.global_scale.reshape(*self.global_scale.shape, *([1] * (len(rows) - self.global_scale.dim())))
        return gs.expand(rows)

    def replace(self, **changes) -> "NVFP4Tensor":
        return dataclasses.replace(self, **changes)

    def to(self, device) -> "NVFP4Tensor":
        return NVFP4Tensor(self.codes.to(device), self.block_scales.to(device), self.global_scale.to(device),
                           self.layout)
