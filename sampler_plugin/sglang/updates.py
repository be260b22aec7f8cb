"""All-or-nothing weight updates for SGLang engines serving nvfp4_sampler.

SGLang 0.5.23 writes an update tensor by tensor through `model.load_weights`, and its scheduler has
no error handler around `update_weights_from_tensor`: a bad tensor late in an update leaves the
tensors before it written, and the exception ends the scheduler (and the process that started the
engine). `register_hooks()` wraps, through SGLang's plugin HookRegistry, the `WeightUpdater` methods
that hand a caller's checkpoint-named tensors to `model.load_weights`: update_weights_from_tensor
(load_format None and "flattened_bucket"), update_weights_from_disk and load_weights_from_distributed.
For a model with nvfp4_sampler layers, each `model.load_weights` call of an update first dry-runs the
whole call (the engine-agnostic `sampler_plugin.updates.check_update`) and writes only if every
tensor passes; a refused update answers `(False, message)` naming the first bad tensor (HTTP 400 on
SGLang's routes), and the engine keeps serving the old weights, bit for bit. Other models pass
through untouched.
"""
from __future__ import annotations

import contextlib
import logging

import torch
from sglang.srt.distributed.parallel_state import get_tp_group, model_parallel_is_initialized
from sglang.srt.model_loader.weight_utils import default_weight_loader

from .. import updates
from ..core import is_nvfp4
from ..updates import UpdateRejected

logger = logging.getLogger("nvfp4_sampler")
_UPDATER = "sglang.srt.model_executor.model_runner_components.weight_updater.WeightUpdater"
_WRAPPED = ("update_weights_from_tensor", "update_weights_from_disk", "load_weights_from_distributed")


def checked_loads(model: torch.nn.Module) -> contextlib.AbstractContextManager[None]:
    """`updates.checked_loads` with SGLang's default loader (parameters without a loader of their own),
    the verdict agreed over the tensor-parallel group (`agree_over_tp`)."""
    return updates.checked_loads(model, default_loader=default_weight_loader, agree=agree_over_tp)


def agree_over_tp(refusal: UpdateRejected | None) -> None:
    """Every tensor-parallel rank's verdict on one `load_weights` call (all-reduce MAX over the group's
    CPU side): raises on every rank if any refused, its own message where it refused."""
    tp = get_tp_group() if model_parallel_is_initialized() else None
    if tp is not None and tp.world_size > 1:
        flag = torch.tensor([refusal is not None], dtype=torch.int32)
        torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX, group=tp.cpu_group)
        if refusal is None and flag.item():
            refusal = UpdateRejected("nvfp4_sampler: weight update refused, no tensor written: another "
                                     "tensor-parallel rank refused it (its log names the tensor)")
    if refusal is not None:
        raise refusal


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
