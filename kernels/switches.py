"""Environment switches, read once at import: kernel variants and load-time steps that a benchmark runs
whole engines on (vLLM's engine-core process reads them too). Not user settings: their defaults follow
the measurements in docs/BENCHMARKS.md. A value out of range stops the import naming the variable."""
from __future__ import annotations

import os


def choice(name: str, choices: tuple[str, ...]) -> str:
    """The environment's value of `name`, one of `choices`; choices[0] when unset."""
    value = os.environ.get(name, choices[0])
    if value not in choices:
        raise ValueError(f"{name} must be one of {list(choices)}, got {value!r}")
    return value


def count(name: str, default: int, maximum: int) -> int:
    """The environment's token count 0..maximum for `name`; default when unset."""
    value = os.environ.get(name, str(default))
    if not value.isdigit() or int(value) > maximum:
        raise ValueError(f"{name} must be a token count 0..{maximum}, got {value!r}")
    return int(value)
