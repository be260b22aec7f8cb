"""nvfp4_sampler layers under vLLM's layerwise reload (`reload_weights`, the weight-transfer engines).

What vLLM does (`vllm/model_executor/model_loader/reload/layerwise.py`): when a reload starts it
swaps every layer's parameters for `meta` copies and wraps their weight loaders. Each incoming
tensor's loader runs once on the meta copies, to count the elements it copies; the tensor is
buffered. When a layer's count reaches its parameters' size, vLLM materializes fresh
(uninitialized) parameters, runs the buffered loaders for real, then `process_weights_after_loading`,
and copies every parameter back into the tensors the engine serves with (same addresses, so CUDA
graphs see the new values). Layers that never reach their size (a partial update; a BF16 tensor
into a one-shard layer, whose loader fills three parameters but is counted against the codes one)
are processed the same way in `finalize_layerwise_reload`.

What the plugin adds:
- loaders write shape-only on meta (`layers.write`), so the counting pass works and counts exactly;
- `complete_load`: the fresh parameters start uninitialized, so shards (one shard of a fused layer,
  one expert) that received nothing in this reload are copied from the serving tensors first;
- `abort_on_error`: if a loader or the post-load step raises, vLLM would leave every layer not yet
  complete on `meta` (the next forward fails). The guard puts them back on their serving tensors
  before the error propagates. Layers that completed earlier in the same reload keep their new
  weights: vLLM writes a layer as soon as it has all of its tensors, with no hook before.
"""
from __future__ import annotations

import functools

import torch

from nvfp4_sampler.kernels import NVFP4Tensor

from .. import layers


def complete_load(layer: torch.nn.Module, loaded: dict[str, NVFP4Tensor],
                  shards: list[tuple[str, layers.Shard]], tracker: layers.LoadTracker) -> None:
    """A layer's post-load bookkeeping: keep what a reload did not send, check, start the next load.

    loaded: the layer's storages by name ("weight"; "w13", "w2") over its parameters as they are now;
    shards: (storage name, shard) of every checkpoint tensor of the layer. At the first load the
    storages are recorded as the serving ones (`layer.nvfp4_serving`). In a layerwise reload (fresh
    parameters) the shards that received nothing are copied from the serving storage. Then every
    checkpoint tensor must have arrived (ValueError naming the missing ones). A repeated post-load
    step with nothing loaded since is a no-op.
    """
    first = not hasattr(layer, "nvfp4_serving")
    if first:
        layer.nvfp4_serving = dict(loaded)
    elif not tracker.seen:
        return
    serving = layer.nvfp4_serving
    untouched = {s.name for s in tracker.untouched()}
    for name, shard in shards:
        if shard.name in untouched and loaded[name].codes.data_ptr() != serving[name].codes.data_ptr():
            layers.copy_shard(loaded[name], serving[name], shard)
            tracker.kept(shard)
    tracker.check()
    tracker.reset()


def records(layer: torch.nn.Module, name: str, storage: NVFP4Tensor) -> bool:
    """Whether a tensor written into the layer's storage `name` counts for the post-load check: not on
    vLLM's meta counting pass, and not a direct write into the serving storage after the first load
    (`model.load_weights` on a running model, as TRL's colocate mode and verl call it, has no post-load
    step: a record left from it would hide unsent shards from the next reload)."""
    serving = getattr(layer, "nvfp4_serving", None)
    return not storage.codes.is_meta and (serving is None or
                                          serving[name].codes.data_ptr() != storage.codes.data_ptr())


def abort_pending() -> None:
    """Put every layer of a layerwise reload in progress back on the tensors it serves with."""
    from vllm.model_executor.model_loader.reload import layerwise

    for layer, info in list(layerwise.LAYERWISE_INFO.items()):
        if info.can_load() and info.kernel_tensors is not None:
            layerwise._place_kernel_tensors(layer, info)
            info.reset()
    layerwise.LOADING_LAYERS.clear()


def abort_on_error(fn):
    """Decorate a weight loader or post-load step: on an exception, `abort_pending()`, then re-raise."""
    @functools.wraps(fn)
    def guarded(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except Exception:
            abort_pending()
            raise
    return guarded
