"""vLLM weight-transfer backend `safetensors_file`: updates staged as safetensors files (any device, CPU too).

vLLM's built-in backends (nccl, ipc) need CUDA. This one runs vLLM's own lifecycle with files: the
trainer writes checkpoint-named tensors to a safetensors file (on /dev/shm it never touches a disk)
and sends its path; every worker streams it tensor by tensor into `model.load_weights`, inside vLLM's
layerwise reload like the built-in checkpoint-format backends.

  LLM(..., weight_transfer_config={"backend": "safetensors_file"})
  llm.init_weight_transfer_engine({"init_info": {}})
  llm.start_weight_update()
  llm.update_weights({"update_info": {"path": "/dev/shm/update-7.safetensors"}})   # any number of files
  llm.finish_weight_update()

or over HTTP with `VLLM_SERVER_DEV_MODE=1`: POST /init_weight_transfer_engine, /start_weight_update,
/update_weights {"update_info": {"path": ...}}, /finish_weight_update. The file is only read.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import torch
from safetensors import safe_open
from vllm.distributed.weight_transfer.base import (WeightTransferEngine, WeightTransferInitInfo,
                                                   WeightTransferUpdateInfo)

BACKEND = "safetensors_file"


@dataclasses.dataclass
class FileInitInfo(WeightTransferInitInfo):
    """Nothing to set up."""


@dataclasses.dataclass
class FileUpdateInfo(WeightTransferUpdateInfo):
    """path: a safetensors file of checkpoint-named tensors, readable by every worker."""

    path: str


def _tensors(path: str) -> Iterator[tuple[str, torch.Tensor]]:
    with safe_open(path, framework="pt") as f:
        for name in f.keys():
            yield name, f.get_tensor(name)


class FileWeightTransferEngine(WeightTransferEngine[FileInitInfo, FileUpdateInfo]):
    """Checkpoint-format updates from safetensors files, loaded through vLLM's layerwise reload."""

    init_info_cls = FileInitInfo
    update_info_cls = FileUpdateInfo

    def init_transfer_engine(self, init_info: FileInitInfo) -> None:
        pass

    def start_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        initialize_layerwise_reload(self.model)

    def receive_weights(self, update_info: FileUpdateInfo) -> None:
        self.model.load_weights(_tensors(update_info.path))

    def finish_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        finalize_layerwise_reload(self.model, self.model_config)

    def shutdown(self) -> None:
        pass


def register() -> None:
    """Register the backend with vLLM's WeightTransferEngineFactory (lazily imported; once per process)."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    if BACKEND not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(BACKEND, __name__, "FileWeightTransferEngine")
