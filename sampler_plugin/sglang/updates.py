"""All-or-nothing weight updates for SGLang engines serving nvfp4_sampler.

SGLang 0.5.23 writes an update tensor by tensor through `model.load_weights`, and its scheduler has
no error handler around `update_weights_from_tensor`: a bad tensor late in an update leaves the
tensors before it written, and the exception ends the scheduler (and the process that started the
engine). `register_hooks()` wraps, through SGLang's plugin HookRegistry, the `WeightUpdater` methods
that hand a caller's checkpoint-named tensors to `model.load_weights`: update_weights_from_tensor
(load_format None and "flattened_bucket"), update_weights_from_disk and load_weights_from_distributed.
For a model with nvfp4_sampler layers, each `model.load_weights` call of an update first dry-runs the
whole call (`check_update`) and writes only if every tensor passes; a refused update answers
`(False, message)` naming the first bad tensor (HTTP 400 on SGLang's routes), and the engine keeps
serving the old weights, bit for bit. Other models pass through untouched.
"""
from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterable, Iterator

import torch
from sglang.srt.model_loader.weight_utils import default_weight_loader

from .. import layers
from ..core import is_nvfp4, shard_of

logger = logging.getLogger("nvfp4_sampler")
_UPDATER = "sglang.srt.model_executor.model_runner_components.weight_updater.WeightUpdater"
_WRAPPED = ("update_weights_from_tensor", "update_weights_from_disk", "load_weights_from_distributed")
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
    if not layers.is_finite(tensor):
        raise UpdateRejected(f"nvfp4_sampler: weight update refused, no tensor written: {name}: "
                             f"contains NaN or Inf")


class _DryRun:
    """Every parameter's loader replaced by a check: NVFP4 parameters validate the checkpoint tensor
    against their shard (`layers.validate`); other parameters run their own loader into scratch memory."""

    def __init__(self, model: torch.nn.Module):
        self.params = list(model.parameters())
        self.current: str | None = None                   # checkpoint name being mapped by the model
        self.reached: set[str] = set()
        self.groups: dict[str, dict[str, torch.Tensor]] = {}

    @contextlib.contextmanager
    def swapped(self) -> Iterator[None]:
        saved = [(p, _loader_attr(p), p.__dict__.get(_loader_attr(p), _MISSING)) for p in self.params]
        try:
            for p, attr, loader in saved:
                setattr(p, attr, self._check(default_weight_loader if loader is _MISSING else loader))
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


def check_update(load_weights, model: torch.nn.Module, weights: list[tuple[str, torch.Tensor]]) -> None:
    """Raise UpdateRejected naming the first tensor of `weights` that `load_weights` (the model's own,
    with its name mapping) would refuse, fail on, or drop, writing nothing.

    Refused: NaN/Inf, a dtype or shape the parameter's loader refuses, a name no parameter takes, an
    NVFP4 checkpoint tensor that is neither a float weight (quantized on arrival) nor a whole triplet
    (`P.weight` uint8, `P.weight_scale`, `P.weight_scale_2`) within this call. Assumes a load_weights
    that maps its input in order (SGLang's models stream it).
    """
    dry = _DryRun(model)
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
            layers.check_group(prefix, group)
        except ValueError as e:
            raise UpdateRejected(f"nvfp4_sampler: weight update refused, no tensor written: {e}") from e


@contextlib.contextmanager
def checked_loads(model: torch.nn.Module) -> Iterator[None]:
    """Within the block, every `model.load_weights(weights)` call runs `check_update` first."""
    original = model.load_weights
    shadowed = model.__dict__.get("load_weights", _MISSING)

    def load_weights(weights: Iterable[tuple[str, torch.Tensor]]):
        weights = list(weights)
        check_update(original, model, weights)
        return original(weights)

    model.load_weights = load_weights
    try:
        yield
    finally:
        if shadowed is _MISSING:
            del model.load_weights
        else:
            model.load_weights = shadowed


def atomic_update(original, updater, *args, **kwargs):
    """SGLang AROUND hook on WeightUpdater.update_weights_from_tensor / update_weights_from_disk.

    For a model with nvfp4_sampler layers: every model.load_weights call of the update is checked
    whole first (`checked_loads`); a refused update returns (False, message) and writes nothing.
    (SGLang's disk path retries a failed load once as its "rollback"; that retry is refused the same
    way, and the model_path it had already switched to is put back.)
    """
    model = updater.get_model()
    if not any(is_nvfp4(m) for m in model.modules()):
        return original(updater, *args, **kwargs)
    model_path = updater.model_config.model_path
    with checked_loads(model):
        try:
            return original(updater, *args, **kwargs)
        except UpdateRejected as e:
            updater.model_config.model_path = model_path
            logger.error("%s", e)
            return False, str(e)


_registered: set[str] = set()


def register_hooks() -> None:
    """Register `atomic_update` with SGLang's plugin HookRegistry (applied by SGLang after plugins load)."""
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    for name in _WRAPPED:
        target = f"{_UPDATER}.{name}"
        if target not in _registered:
            HookRegistry.register(target, atomic_update, HookType.AROUND)
            _registered.add(target)
