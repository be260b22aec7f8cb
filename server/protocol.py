"""Request/response models shared by the sidecar app and its client (docs/PROTOCOL.md).

Only pydantic and the standard library: the client needs nothing else to speak the protocol.
"""
from __future__ import annotations

import struct
from array import array
from typing import Literal

from pydantic import BaseModel, Field, model_validator

WEIGHT_VERSION_HEADER = "X-Weight-Version"
FRAMES_CONTENT_TYPE = "application/x-nvfp4-frames"
BINARY_LOGPROBS_CONTENT_TYPE = "application/x-nvfp4-logprobs"

# dtype names on the wire (torch names without the "torch." prefix)
DENSE_DTYPES = ("bfloat16", "float16", "float32")
NVFP4_DTYPE = "nvfp4"
Layout = Literal["dense", "nvfp4"]


class TensorEntry(BaseModel):
    """One logical tensor of an update, by checkpoint name.

    layout "dense": one tensor `name` of `dtype` (bfloat16 | float16 | float32) and `shape`.
    layout "nvfp4": `name` is `P.weight` of logical shape [N, K] (K % 16 == 0), dtype "nvfp4"; it
      carries the checkpoint triplet P.weight uint8 [N, K/2], P.weight_scale float8_e4m3fn [N, K/16],
      P.weight_scale_2 float32 [] (decode scale).
    """

    name: str = Field(min_length=1, max_length=1024)
    layout: Layout
    dtype: str
    shape: list[int]

    @model_validator(mode="after")
    def _check(self) -> "TensorEntry":
        if any(d < 0 for d in self.shape):
            raise ValueError(f"{self.name}: negative dimension in shape {self.shape}")
        if self.layout == "dense" and self.dtype not in DENSE_DTYPES:
            raise ValueError(f"{self.name}: dense dtype must be one of {DENSE_DTYPES}, got {self.dtype!r}")
        if self.layout == "nvfp4":
            if self.dtype != NVFP4_DTYPE:
                raise ValueError(f"{self.name}: nvfp4 layout needs dtype {NVFP4_DTYPE!r}, got {self.dtype!r}")
            if not self.name.endswith(".weight") or len(self.shape) != 2 or self.shape[1] % 16:
                raise ValueError(f"{self.name}: nvfp4 layout needs a 'P.weight' of shape [N, K] with K % 16 == 0, "
                                 f"got shape {self.shape}")
        return self


class BeginRequest(BaseModel):
    """Open an update transaction towards `target_version` (> the engine's current version)."""

    target_version: int = Field(ge=1)
    manifest: list[TensorEntry] = Field(default_factory=list)
    # planned update (IPC buckets by index, `server.plan`): bucket_bytes builds the plan of
    # `manifest`; plan_id (from an earlier UpdateStatus) reuses a plan the sidecar holds, manifest empty
    bucket_bytes: int | None = Field(default=None, ge=1)
    plan_id: str | None = None

    @model_validator(mode="after")
    def _unique(self) -> "BeginRequest":
        if not self.manifest and self.plan_id is None:
            raise ValueError("a manifest (or the plan_id of a plan the sidecar holds) is required")
        if self.manifest and self.plan_id is not None:
            raise ValueError("send either a manifest or a plan_id, not both")
        names = [e.name for e in self.manifest]
        if len(set(names)) != len(names):
            dup = sorted({n for n in names if names.count(n) > 1})
            raise ValueError(f"manifest names must be unique; repeated: {dup[:5]}")
        return self


class UpdateStatus(BaseModel):
    """missing: the manifest's names not staged yet, or None where the answer does not list them (a
    planned update's begin and bucket answers, whose sender holds the plan: `GET` the update to list
    them); missing_count: how many, always. data_port: the sidecar's data-plane port on the same host
    (PUT the body there to have the socket write payloads straight into the staging area;
    docs/PROTOCOL.md), None if disabled."""

    update_id: str
    target_version: int
    state: Literal["open", "committed", "aborted"]
    missing: list[str] | None
    missing_count: int
    received: int
    bytes_received: int
    data_port: int | None = None
    plan_id: str | None = None                       # a planned update: IPC buckets by index


class IpcHandle(BaseModel):
    """A flat uint8 buffer of `nbytes` shared by a process on the same host (torch storage sharing).

    kind "cuda": a CUDA IPC handle of the caching-allocator block (`UntypedStorage._share_cuda_()`:
      device, handle, storage_size_bytes, storage_offset_bytes, ref_counter_handle,
      ref_counter_offset, event_handle, event_sync_required); the sidecar opens it on that device.
    kind "cpu": a shared-memory file (`UntypedStorage._share_filename_cpu_()`: manager_handle,
      handle, storage_size_bytes).
    offset: where the buffer starts in the storage, in bytes. Byte strings are base64.
    """

    kind: Literal["cuda", "cpu"]
    nbytes: int = Field(ge=0)
    offset: int = Field(default=0, ge=0)
    handle: str
    storage_size_bytes: int = Field(ge=0)
    device: int = 0
    storage_offset_bytes: int = 0
    ref_counter_handle: str = ""
    ref_counter_offset: int = 0
    event_handle: str = ""
    event_sync_required: bool = False
    manager_handle: str = ""


class IpcTensor(BaseModel):
    """One manifest entry inside a bucket: its payload (the frame payload layout of `server.wire`:
    parts back to back) starts at byte `offset` of the bucket buffer (a multiple of 16)."""

    entry: TensorEntry
    offset: int = Field(ge=0)


class IpcBucket(BaseModel):
    """`POST /v1/weights/updates/{id}/ipc`: stage these entries from a shared buffer (colocated
    trainer). The sidecar copies them into its staging area before it answers; the sender may
    reuse the buffer afterwards."""

    buffer: IpcHandle
    tensors: list[IpcTensor] = Field(default_factory=list)
    bucket: int | None = Field(default=None, ge=0)   # planned update: bucket index, offsets from the plan

    @model_validator(mode="after")
    def _one_form(self) -> "IpcBucket":
        if (self.bucket is None) == (not self.tensors):
            raise ValueError("an IPC bucket lists its tensors or names a planned bucket, not both")
        return self


class CommitResult(BaseModel):
    weight_version: int
    tensors: int
    bytes: int
    stage_seconds: float
    apply_seconds: float
    engine: dict


class VersionInfo(BaseModel):
    weight_version: int
    model: str
    engine: str
    update: UpdateStatus | None = None


class LogprobsRequest(BaseModel):
    """Teacher-forced log-probs of `sequences[i][prompt_lens[i]:]` given everything before them."""

    sequences: list[list[int]] = Field(min_length=1)
    prompt_lens: list[int]
    top_k: int = Field(default=0, ge=0, le=64)
    format: Literal["json", "binary"] = "json"

    @model_validator(mode="after")
    def _check(self) -> "LogprobsRequest":
        if len(self.prompt_lens) != len(self.sequences):
            raise ValueError(f"prompt_lens has {len(self.prompt_lens)} entries for {len(self.sequences)} sequences")
        for i, (seq, p) in enumerate(zip(self.sequences, self.prompt_lens)):
            if not 1 <= p < len(seq):
                raise ValueError(f"sequence {i}: prompt_len must be in [1, {len(seq) - 1}] "
                                 f"(len {len(seq)}), got {p}")
            if min(seq) < 0:
                raise ValueError(f"sequence {i}: negative token id")
        return self


class SequenceLogprobs(BaseModel):
    """Per response token t: logprobs[t]; with top_k, top_ids[t] / top_logprobs[t] (k each, best first)."""

    logprobs: list[float]
    top_ids: list[list[int]] | None = None
    top_logprobs: list[list[float]] | None = None


class LogprobsResponse(BaseModel):
    model: str
    weight_version: int
    results: list[SequenceLogprobs]


class DiagnosticsParams(BaseModel):
    """Parameters of the mismatch weights (`diagnostics.report.Params`; docs/NUMERICS.md)."""

    tis_cap: float = Field(default=2.0, gt=0)
    icepop_low: float = Field(default=0.5, ge=0)
    icepop_high: float = Field(default=5.0, gt=0)
    opsm_delta: float = 0.03
    risk_segment: int = Field(default=64, ge=1)
    risk_depth: float = Field(default=1.0, ge=0)
    gate_floor: float = Field(default=0.0, ge=0, le=1)
    repair_segment: int = Field(default=128, ge=1)
    repair_bound: float = Field(default=0.6931471805599453, ge=0)
    flip_margin: float = Field(default=0.1, ge=0)


class DiagnosticsRequest(BaseModel):
    """Per sequence: the sampler's and the learner's log-prob of each response token (same lengths),
    optionally advantages (one per sequence, or one per token) and masks (True = counted)."""

    logp_sampler: list[list[float]] = Field(min_length=1)
    logp_learner: list[list[float]]
    advantages: list[float] | list[list[float]] | None = None
    masks: list[list[bool]] | None = None
    params: DiagnosticsParams = Field(default_factory=DiagnosticsParams)

    @model_validator(mode="after")
    def _check(self) -> "DiagnosticsRequest":
        lengths = [len(r) for r in self.logp_sampler]
        for name in ("logp_learner", "advantages", "masks"):
            rows = getattr(self, name)
            if rows is None or (name == "advantages" and rows and not isinstance(rows[0], list)):
                if rows is not None and len(rows) != len(lengths):
                    raise ValueError(f"{name}: {len(rows)} values for {len(lengths)} sequences")
                continue
            if [len(r) for r in rows] != lengths:
                raise ValueError(f"{name}: per-sequence lengths {[len(r) for r in rows][:8]} differ from "
                                 f"logp_sampler's {lengths[:8]}")
        return self


class DiagnosticsResponse(BaseModel):
    """`diagnostics.report.mismatch_report`: metrics, segment tails, update-direction shares (with
    advantages), per-token weights per scheme (per sequence) and their means / zeroed shares."""

    metrics: dict[str, float]
    tail: dict[str, float]
    directions: dict[str, float] | None = None
    weights: dict[str, list[list[float]]]
    weight_summary: dict[str, dict[str, float]]


# --------------------------------------------------------------------------- binary log-probs
# little-endian: magic b"NVLP", uint32 n_seqs, uint32 top_k, int64 weight_version, uint32 T[n_seqs],
# float32 logprobs[sum T], then if top_k: int32 top_ids[sum T * top_k], float32 top_logprobs[sum T * top_k]
_LP_MAGIC = b"NVLP"
_LP_HEAD = struct.Struct("<4sIIq")


def encode_logprobs_binary(resp: LogprobsResponse, *, top_k: int) -> bytes:
    lens = [len(r.logprobs) for r in resp.results]
    out = [_LP_HEAD.pack(_LP_MAGIC, len(lens), top_k, resp.weight_version), array("I", lens).tobytes(),
           array("f", [x for r in resp.results for x in r.logprobs]).tobytes()]
    if top_k:
        out.append(array("i", [j for r in resp.results for row in r.top_ids for j in row]).tobytes())
        out.append(array("f", [x for r in resp.results for row in r.top_logprobs for x in row]).tobytes())
    return b"".join(out)


def decode_logprobs_binary(data: bytes, *, model: str) -> LogprobsResponse:
    magic, n, k, version = _LP_HEAD.unpack_from(data)
    if magic != _LP_MAGIC:
        raise ValueError(f"not a binary log-prob response (magic {magic!r})")
    off = _LP_HEAD.size
    lens = array("I", data[off:off + 4 * n]).tolist()
    off += 4 * n
    total = sum(lens)
    lps = array("f", data[off:off + 4 * total]).tolist()
    off += 4 * total
    ids = array("i", data[off:off + 4 * total * k]).tolist()
    tops = array("f", data[off + 4 * total * k:off + 8 * total * k]).tolist()
    results, t = [], 0
    for m in lens:
        r = SequenceLogprobs(logprobs=lps[t:t + m])
        if k:
            r.top_ids = [ids[(t + i) * k:(t + i + 1) * k] for i in range(m)]
            r.top_logprobs = [tops[(t + i) * k:(t + i + 1) * k] for i in range(m)]
        results.append(r)
        t += m
    return LogprobsResponse(model=model, weight_version=version, results=results)
