"""The one weight-update check for engines that load an update through the model's own `load_weights`.

`check_update` dry-runs a whole `model.load_weights(weights)` call with every parameter's loader
swapped for a check (NVFP4 parameters: `layers.validate` against the shard the layer core's loader
would write; other parameters: their own loader into scratch memory), then checks every NVFP4
triplet complete and every name taken; `checked_loads` makes every `load_weights` call of a block
run it before it writes. A refused call raises `UpdateRejected` naming the first bad tensor, with
nothing written (docs/ARCHITECTURE.md, "Weight updates: one rule"). Engine-agnostic: the SGLang
adapter (`sglang/updates.py`) wraps SGLang's update paths with it.
"""
from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator

import torch

from . import commit, layers
from .core import shard_of

_MISSING = object()


class UpdateRejected(ValueError):
    """A weight update refused before any tensor of it was written."""


def _loader_attr(param: torch.Tensor) -> str:
    """The attribute that holds a parameter's loader (SGLang's BasevLLMParameter reads `_weight_loader`)."""
    return "_weight_loader" if isinstance(getattr(type(param), "weight_loader", None), property) else "weight_loader"


def _scratch(param: torch.Tensor, loader) -> torch.Tensor:
    """A parameter of param's type and attributes over fresh memory, for a loader's dry run."""
    scratch = torch.Tensor._make_subclass(type(param), torch.empty_like(param.data), False)
    scratch.__dict__.update(param.__dict__)
    setattr(scratch, _loader_attr(param), loader)
    return scratch


def _check_finite(name: str, tensor: torch.Tensor) -> None:
    if not commit.is_finite(tensor):
        raise UpdateRejected(f"nvfp4_sampler: weight update refused, no tensor written: {name}: "
                             f"contains NaN or Inf")


class _DryRun:
    """Every parameter's loader replaced by a check: NVFP4 parameters validate the checkpoint tensor
    against their shard (`layers.validate`); other parameters run their own loader into scratch memory."""

    def __init__(self, model: torch.nn.Module, default_loader):
        self.params = list(model.parameters())
        self.default_loader = default_loader
        self.current: str | None = None                   # checkpoint name being mapped by the model
        self.reached: set[str] = set()
        self.groups: dict[str, dict[str, torch.Tensor]] = {}

    @contextlib.contextmanager
    def swapped(self) -> Iterator[None]:
        saved = [(p, _loader_attr(p), p.__dict__.get(_loader_attr(p), _MISSING)) for p in self.params]
        try:
            for p, attr, loader in saved:
                setattr(p, attr, self._check(self.default_loader if loader is _MISSING else loader))
            yield
        finally:
            for p, attr, loader in saved:
                if loader is _MISSING:
                    delattr(p, attr)
                else:
                    setattr(p, attr, loader)

    def _check(self, loader):
        def check(p: torch.Tensor, tensor: torch.Tensor, *args, **kwargs) -> None:
            self.reached.add(self.current)
            kind = getattr(p, "nvfp4_kind", None)
            if kind is not None:
                shard = shard_of(loader, *args, **kwargs)
                layers.validate(shard, kind, tensor)
                self.groups.setdefault(shard.name, {})[kind] = tensor
                return
            if p.is_floating_point() and not tensor.is_floating_point():
                raise ValueError(f"dtype {tensor.dtype}, expected a float dtype (the model's is {p.dtype})")
            loader(_scratch(p, loader), tensor, *args, **kwargs)
        return check

    def feed(self, weights: list[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """The update in order; loader calls between two yields belong to the tensor yielded first."""
        for name, tensor in weights:
            _check_finite(name, tensor)
            self.current = name
            yield name, tensor


def check_update(load_weights, model: torch.nn.Module, weights: list[tuple[str, torch.Tensor]], *,
                 default_loader) -> None:
    """Raise UpdateRejected naming the first tensor of `weights` that `load_weights` (the model's own,
    with its name mapping) would refuse, fail on, or drop, writing nothing.

    Refused: NaN/Inf, a dtype or shape the parameter's loader refuses, a name no parameter takes, an
    NVFP4 checkpoint tensor that is neither a float weight (quantized on arrival) nor a whole triplet
    (`P.weight` uint8, `P.weight_scale`, `P.weight_scale_2`) within this call. Assumes a load_weights
    that maps its input in order (SGLang's models stream it).
    """
    dry = _DryRun(model, default_loader)
    with dry.swapped():
        try:
            load_weights(dry.feed(weights))
        except UpdateRejected:
            raise
        except Exception as e:
            raise UpdateRejected(f"nvfp4_sampler: weight update refused, no tensor written: {dry.current}: "
                                 f"{type(e).__name__}: {e}") from e
    for name, _ in weights:
        if name not in dry.reached:
            raise UpdateRejected(f"nvfp4_sampler: weight update refused, no tensor written: {name}: "
                                 f"no parameter of the model takes this tensor")
    for prefix, group in dry.groups.items():
        try:
            commit.check_group(prefix, group)
        except ValueError as e:
            raise UpdateRejected(f"nvfp4_sampler: weight update refused, no tensor written: {e}") from e


def _alone(refusal: UpdateRejected | None) -> None:
    if refusal is not None:
        raise refusal


@contextlib.contextmanager
def checked_loads(model: torch.nn.Module, *, default_loader,
                  agree: Callable[[UpdateRejected | None], None] = _alone) -> Iterator[None]:
    """Within the block, every `model.load_weights(weights)` call runs `check_update` first.
    default_loader: the engine's loader of parameters that have none of their own. agree: called on
    every rank with its refusal (or None) between the check and the write; raises UpdateRejected on
    every rank if any rank refused (tensor-parallel ranks each check their own shards), so that all
    ranks write or none. The default: this process alone."""
    original = model.load_weights
    shadowed = model.__dict__.get("load_weights", _MISSING)

    def load_weights(weights: Iterable[tuple[str, torch.Tensor]]):
        weights = list(weights)
        try:
            check_update(original, model, weights, default_loader=default_loader)
            refusal = None
        except UpdateRejected as e:
            refusal = e
        agree(refusal)
        return original(weights)

    model.load_weights = load_weights
    try:
        yield
    finally:
        if shadowed is _MISSING:
            del model.load_weights
        else:
            model.load_weights = shadowed
