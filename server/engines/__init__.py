"""Engine adapters behind the sidecar: embedded (transformers), vLLM (child process or remote)."""
from __future__ import annotations

from ..settings import Settings
from .base import Engine


def make_engine(settings: Settings) -> Engine:
    """The adapter named by settings.engine; engine packages are imported only here, lazily."""
    if settings.engine == "embedded":
        from .embedded import EmbeddedEngine
        return EmbeddedEngine(settings.model, max_batch_tokens=settings.logprob_max_batch_tokens,
                              device=settings.device, profile_commits=settings.profile_commits)
    from .vllm import VLLMEngine
    return VLLMEngine(settings)
