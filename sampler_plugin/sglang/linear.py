"""SGLang linear method of nvfp4_sampler: NVFP4 weights, per-token NVFP4 activations.

Parameters of a quantized linear (checkpoint layout, kept as they are; no derived tensors):
  weight          uint8 [N, K/2]           (N = sum of the fused output shards)
  weight_scale    float8_e4m3fn [N, K/16]
  weight_scale_2  float32 [N]              one decode scale per checkpoint tensor, spread over its rows
Every parameter's `weight_loader` takes one checkpoint tensor (BF16 `P.weight`, or one of the NVFP4
triplet) and writes it through `sampler_plugin.layers`, at start-up and in weight updates alike.
"""
from __future__ import annotations

import torch
from sglang.srt.distributed.utils import get_group_rank_size
from sglang.srt.layers.quantization.base_config import LinearMethodBase

from nvfp4_sampler.kernels import NVFP4Tensor

from .. import layers
from ..config import SamplerConfig

class UpdateTracking:
    """Load bookkeeping shared by the linear and MoE methods (`layer.nvfp4_tracker`, `self.memory`).

    At start-up every checkpoint tensor of the layer must arrive; the first process_weights_after_loading
    names the missing ones. Weight updates (SGLang's begin_weight_update / update_weights_from_tensor /
    end_weight_update, update_weights_from_disk) are checked whole before anything is written
    (`updates.py`), so later calls have nothing to check. Storage stays in checkpoint layout: there is
    no repacking for restore_weights_before_loading to undo.
    """

    memory: layers.MemoryReport

    def quantized_weights(self, layer: torch.nn.Module) -> list[NVFP4Tensor]:
        raise NotImplementedError

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        if not layer.nvfp4_loaded:
            layer.nvfp4_tracker.check()
            layer.nvfp4_loaded = True
        for w in self.quantized_weights(layer):
            self.memory.processed_weight(w)
        self.memory.processed_layer()


class ShardLoader:
    """`weight_loader` of an NVFP4 layer's parameters: one checkpoint tensor into its shard (`layers.write`).

    locate(*args, **kwargs) -> (NVFP4Tensor, Shard) from SGLang's loader arguments after
    (param, tensor); the update check (`updates.py`) calls it to validate a tensor without writing it.
    """

    def __init__(self, layer: torch.nn.Module, config: SamplerConfig, locate):
        self.layer, self.config, self.locate = layer, config, locate

    def __call__(self, param: torch.nn.Parameter, loaded_weight: torch.Tensor, *args, **kwargs) -> None:
        w, shard = self.locate(*args, **kwargs)
        layers.write(w, shard, param.nvfp4_kind, loaded_weight, config=self.config)
        self.layer.nvfp4_tracker.record(shard, param.nvfp4_kind, loaded_weight)


class NVFP4LinearMethod(UpdateTracking, LinearMethodBase):
    """W4A4 linear for one module `prefix`; `shard_names` are its checkpoint tensors' prefixes."""

    def __init__(self, config: SamplerConfig, prefix: str, shard_names: list[str], memory: layers.MemoryReport):
        self.config = config
        self.prefix = prefix
        self.shard_names = shard_names
        self.memory = memory

    def create_weights(self, layer: torch.nn.Module, input_size_per_partition: int, output_partition_sizes: list[int],
                       input_size: int, output_size: int, params_dtype: torch.dtype, **extra_weight_attrs):
        if get_group_rank_size(layer.tp_group)[1] != 1:
            raise NotImplementedError(f"nvfp4_sampler: {self.prefix}: tensor parallelism is not supported by the "
                                      f"SGLang adapter yet (tp_size must be 1)")
        if len(output_partition_sizes) != len(self.shard_names):
            raise ValueError(f"nvfp4_sampler: {self.prefix}: {len(output_partition_sizes)} output shards but "
                             f"checkpoint names {self.shard_names}")
        w = layers.create_weight(sum(output_partition_sizes), input_size_per_partition, name=self.prefix)
        layers.register_weight(layer, w, self._loader(layer))
        shards, offset = [], 0
        for name, size in zip(self.shard_names, output_partition_sizes):
            shards.append(layers.Shard(name=name, shape=(size, input_size), rows=slice(offset, offset + size)))
            offset += size
        layer.nvfp4_tracker = layers.LoadTracker(shards)
        layer.nvfp4_loaded = False
        layer.nvfp4_backend = layers.choose_backend(self.config, op="linear", name=self.prefix, device=w.codes.device,
                                                    k=input_size_per_partition)
        self.memory.add_layer()

    def _loader(self, layer: torch.nn.Module) -> ShardLoader:
        def locate(shard_id: str | int | None = None) -> tuple[NVFP4Tensor, layers.Shard]:
            index = layers.QKV_SHARD_INDEX[shard_id] if isinstance(shard_id, str) else (shard_id or 0)
            return self.storage(layer), layer.nvfp4_tracker.shards[index]
        return ShardLoader(layer, self.config, locate)

    @staticmethod
    def storage(layer: torch.nn.Module) -> NVFP4Tensor:
        return layers.module_weight(layer)

    def quantized_weights(self, layer: torch.nn.Module) -> list[NVFP4Tensor]:
        return [self.storage(layer)]

    def apply(self, layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        w = NVFP4Tensor(layer.weight, layer.weight_scale, layer.weight_scale_2)
        return layers.apply_linear(x, w, bias=bias, config=self.config, backend=layer.nvfp4_backend)
