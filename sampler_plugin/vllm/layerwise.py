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

What the plugin does about it (in the layer core, `sampler_plugin.core`, which serves SGLang too):
- loaders write shape-only on meta (`layers.write`), so the counting pass works and counts exactly;
- `LayerCore.process_weights_after_loading`: the fresh parameters start uninitialized, so shards (one shard of a fused
  layer, one expert) that received nothing in this reload are copied from the serving tensors first;
- `abort_pending` (here; the vLLM methods set it as the core's `abort_pending` hook): if a loader or
  the post-load step raises, vLLM would leave every layer not yet complete on `meta` (the next
  forward fails); it puts them back on their serving tensors before the error propagates.
"""
from __future__ import annotations


def abort_pending() -> None:
    """Put every layer of a layerwise reload in progress back on the tensors it serves with."""
    from vllm.model_executor.model_loader.reload import layerwise

    for layer, info in list(layerwise.LAYERWISE_INFO.items()):
        if info.can_load() and info.kernel_tensors is not None:
            layerwise._place_kernel_tensors(layer, info)
            info.reset()
    layerwise.LOADING_LAYERS.clear()
