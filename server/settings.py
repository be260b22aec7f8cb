"""Sidecar settings: where the sidecar reads its environment variables (NVFP4_SAMPLER_*) and flags (the
kernels' switches: `kernels/switches.py`).

Flags override environment variables, which override defaults. A non-loopback bind without a token
is refused: mutating routes would be open to the network.
"""
from __future__ import annotations

import dataclasses
import importlib.util
import ipaddress
import os
import socket
import tempfile
from pathlib import Path

ENV_PREFIX = "NVFP4_SAMPLER_"
TOKEN_ENV = ENV_PREFIX + "TOKEN"


@dataclasses.dataclass(frozen=True)
class Settings:
    """engine: "vllm" (start the vLLM OpenAI server), "embedded" (transformers in-process), "remote"
    (an already running vLLM server at engine_url), or "auto" (vllm when installed, else embedded).
    host/port: the sidecar's bind address. token: bearer token for mutating routes (None: loopback only).
    staging_dir: where the vLLM engine's commits write the update file (tmpfs by default when present).
    data_port: the data-plane port for update bodies (0: a free one, announced in UpdateStatus;
    None: off, bodies go through the main port only). max_frame_bytes: largest accepted frame payload. update_idle_timeout_s: an open update with no
    activity for this long is aborted when another begins. logprob_max_batch_tokens: batching limit.
    device: where the embedded engine runs ("auto": cuda when available, else cpu).
    strict: start the vLLM engine in strict mode (`quantization_config.strict`, batch-invariant NVFP4
    kernels; on CUDA with VLLM_BATCH_INVARIANT=1); engine "vllm" only.
    profile_commits: a folder where the embedded engine writes each commit's torch-profiler table (operators
    and kernels by time, `commit-<version>.txt`): where a commit's time goes (`bench_sync.py --profile-commits`
    sets it).
    """

    model: str | None = None
    engine: str = "auto"
    engine_url: str | None = None
    host: str = "127.0.0.1"
    port: int = 8000
    token: str | None = None
    staging_dir: Path = dataclasses.field(default_factory=lambda: _default_staging())
    data_port: int | None = 0
    max_frame_bytes: int = 4 << 30
    update_idle_timeout_s: float = 300.0
    logprob_max_batch_tokens: int = 16384
    engine_start_timeout_s: float = 600.0
    vllm_args: tuple[str, ...] = ()
    device: str = "auto"
    strict: bool = False
    profile_commits: Path | None = None

    def __post_init__(self):
        if self.device == "auto":
            object.__setattr__(self, "device", "cuda" if _cuda_available() else "cpu")
        if self.engine == "auto":
            object.__setattr__(self, "engine", "vllm" if importlib.util.find_spec("vllm") else "embedded")
        if self.engine not in ("vllm", "embedded", "remote"):
            raise ValueError(f"engine must be 'auto', 'vllm', 'embedded' or 'remote', got {self.engine!r}")
        if self.engine == "remote" and not self.engine_url:
            raise ValueError("engine 'remote' needs engine_url (--engine-url)")
        if self.engine != "remote" and not self.model:
            raise ValueError(f"engine {self.engine!r} needs a model folder")
        if self.strict and self.engine != "vllm":
            raise ValueError(f"strict is a mode of the vllm engine this sidecar starts, got engine {self.engine!r} "
                             f"(a running vLLM server: start it with quantization_config strict: true)")
        if not is_loopback(self.host) and not self.token:
            raise ValueError(f"refusing to bind {self.host}: a non-loopback bind needs a token "
                             f"(--token or {TOKEN_ENV})")

    @classmethod
    def from_env(cls, **flags) -> "Settings":
        """Settings from NVFP4_SAMPLER_<FIELD> environment variables, then `flags` (None = not given)."""
        values = {}
        for f in dataclasses.fields(cls):
            raw = os.environ.get(ENV_PREFIX + f.name.upper())
            if raw is not None and f.name != "vllm_args":
                values[f.name] = _coerce(f.type, raw)
        values.update({k: v for k, v in flags.items() if v is not None})
        for name in ("staging_dir", "profile_commits"):
            if values.get(name) is not None:
                values[name] = Path(values[name])
        return cls(**values)


def client_token(token: str | None = None) -> str | None:
    """The bearer token a client sends: the given one, else NVFP4_SAMPLER_TOKEN."""
    return token if token is not None else os.environ.get(TOKEN_ENV)


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return all(ipaddress.ip_address(a[4][0]).is_loopback for a in socket.getaddrinfo(host, None))


def _coerce(type_name: str, raw: str):
    if "None" in type_name and raw.lower() in ("", "none", "off"):
        return None
    if type_name == "bool":
        return raw.lower() in ("1", "true", "yes", "on")
    if "int" in type_name and "float" not in type_name:
        return int(raw)
    if "float" in type_name:
        return float(raw)
    return raw


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def _default_staging() -> Path:
    shm = Path("/dev/shm")
    return (shm if shm.is_dir() and os.access(shm, os.W_OK) else Path(tempfile.gettempdir())) / "nvfp4-sampler-staging"
