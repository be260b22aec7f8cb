"""One real CUDA vLLM engine updated by a trainer process through vLLM's own `ipc` weight-transfer backend.

  python -m tests.gpu_scripts.updates_ipc --model DIR --mode {eager,graphs,compiled} --out FILE.json
         [--new DIR --old DIR]

Starts `LLM(DIR, quantization="nvfp4_sampler", weight_transfer_config={"backend": "ipc"})` (online
quantization of a BF16 checkpoint) in-process, on the GPU, and records `observe()` (see
vllm_engine.py: prompt log-probs, greedy tokens and their decode log-probs; CUDA graphs replay the
decode in the graphs and compiled modes). With --new/--old a trainer process on the same GPU (as
colocated verl / TRL run) holds checkpoint tensors in CUDA memory and sends them with vLLM 0.26's
`IPCWeightTransferEngine.trainer_send_weights` (send_mode: a callable that hands each payload to the
engine and waits until it is loaded); the engine runs init_weight_transfer_engine ->
start_weight_update -> update_weights -> finish_weight_update. Steps, each followed by observe():
  ipc_bf16 / ipc_bf16_restored      --new, then --old: BF16 tensors (quantized on arrival)
  ipc_nvfp4 / ipc_nvfp4_restored    the same as NVFP4 triplets made by the trainer (kernels.dispatch)
  rpc_bf16 / rpc_restored           collective_rpc("reload_weights", weights_iterator=BF16 tensors), then
                                    reload_weights(weights_path=--old)
  colocated / colocated_restored    `server.colocated.ColocatedRefit` from the BF16 tensors of --new, then
                                    --old, on this GPU (no trainer process: colocated RL holds both here);
                                    NVFP4 entries written tensor by tensor recorded in "per_tensor_entries"
  group / group_restored            NVFP4 triplets of --new, then --old, from a trainer thread through a weight group
                                    (`server.broadcast`, gloo: host buffers; the worker's per-rank plan in
                                    "group_plan", the trainer's verdicts in "group_sent")
  ipc_shard / ext_shard             only q_proj of layer 0 (NVFP4 triplet of --new): one shard of the fused
                                    qkv, through ipc, then restored and sent through our worker extension
  ipc_expert / ext_expert           (MoE) one expert of layer 0 of --new (BF16), the same way
The JSON is rewritten after every step; a failing step records its error and the rest still run.
vLLM 0.26's ipc_engine imports `ray` and `requests` at module level but uses them only for its "ray"
and "http" send modes; where the image lacks them an empty module stands in (both processes).
"""
from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import os
import sys
import time
import traceback
import types
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")

SHARD = "model.layers.0.self_attn.q_proj"
EXPERT = "model.layers.0.mlp.experts.3"


def _importable_ipc_engine():
    """vllm.distributed.weight_transfer.ipc_engine, with empty `ray` / `requests` if the image lacks them."""
    for name in ("ray", "requests"):
        try:
            importlib.import_module(name)
        except ImportError:
            sys.modules[name] = types.ModuleType(name)
    return importlib.import_module("vllm.distributed.weight_transfer.ipc_engine")


def trainer_tensors(path: str, *, nvfp4: bool, prefix: str = "") -> tuple[dict, int]:
    """Checkpoint tensors of `path` whose names start with `prefix`, on the GPU, and the bytes of those
    of quantized layers; nvfp4: every weight the plugin quantizes as its triplet (weight uint8,
    weight_scale e4m3, weight_scale_2 fp32), else BF16 as stored."""
    import torch
    from safetensors.torch import load_file

    from nvfp4_sampler.kernels import dispatch
    from nvfp4_sampler.sampler_format import SamplerConfig
    from nvfp4_sampler.sampler_format import should_quantize

    config, out, quantized = SamplerConfig(), {}, 0
    for name, t in load_file(Path(path) / "model.safetensors", device="cuda").items():
        if not name.startswith(prefix):
            continue
        module = name.removesuffix(".weight")
        if not (name.endswith(".weight") and t.dim() == 2 and should_quantize(module, config)):
            out[name] = t
        elif nvfp4:
            q = dispatch.quantize_weight_on(t, recipe=config.recipe.weight)
            triplet = {name: q.codes, f"{module}.weight_scale": q.block_scales,
                       f"{module}.weight_scale_2": q.global_scale.reshape(())}
            out.update(triplet)
            quantized += sum(x.numel() * x.element_size() for x in triplet.values())
        else:
            out[name] = t
            quantized += t.numel() * t.element_size()
    torch.cuda.synchronize()
    return out, quantized


def trainer_main(conn) -> None:
    """The trainer process: for each (path, nvfp4, prefix) received, send those tensors over CUDA IPC."""
    ipc = _importable_ipc_engine()
    while (cmd := conn.recv()) is not None:
        path, nvfp4, prefix = cmd
        try:
            tensors, quantized = trainer_tensors(path, nvfp4=nvfp4, prefix=prefix)

            def send(info) -> None:
                conn.send(("update", dataclasses.asdict(info)))
                if conn.recv() != "loaded":
                    raise RuntimeError("the engine did not load the update")

            ipc.IPCWeightTransferEngine.trainer_send_weights(iter(tensors.items()), {"send_mode": send})
            conn.send(("done", quantized))
            del tensors
        except Exception as e:    # reported to the engine process, which records it
            conn.send(("error", f"{type(e).__name__}: {e}\n{traceback.format_exc()[-2000:]}"))


def push(llm, conn, path: str, *, nvfp4: bool, prefix: str = "") -> int:
    """One weight update through vLLM's lifecycle; returns the bytes the trainer sent for quantized layers."""
    llm.start_weight_update()
    conn.send((path, nvfp4, prefix))
    error = None
    while (msg := conn.recv())[0] == "update":      # the trainer waits for each reply
        try:
            if error is None:
                llm.update_weights({"update_info": msg[1]})
        except Exception as e:      # answered, so the trainer stops; raised below
            error = e
        conn.send("loaded" if error is None else "failed")
    if msg[0] == "error" and error is None:
        raise RuntimeError(f"trainer: {msg[1]}")
    if error is not None:
        raise error
    llm.finish_weight_update()
    return msg[1]


GROUP_EXTENSION = "nvfp4_sampler.server.broadcast.BroadcastWorkerExtension"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--mode", default="graphs")
    ap.add_argument("--out", required=True)
    ap.add_argument("--new")
    ap.add_argument("--old")
    args = ap.parse_args()
    out: dict = {"mode": args.mode, "model": args.model, "errors": {}, "bytes": {}}

    from tests.gpu_scripts.vllm_engine import MODES, observe, recorder
    save, step = recorder(args.out, out)

    import multiprocessing
    from concurrent.futures import ThreadPoolExecutor

    from safetensors.torch import load_file, save_file
    from vllm import LLM

    from nvfp4_sampler.server.process import free_port
    from tests.vllm_helpers import group_trainer

    _importable_ipc_engine()
    t0 = time.time()
    llm = LLM(args.model, quantization="nvfp4_sampler", dtype="bfloat16", skip_tokenizer_init=True, max_model_len=512,
              gpu_memory_utilization=0.08, kv_cache_memory_bytes=1 << 30, attention_backend="TRITON_ATTN", seed=0,
              enable_prefix_caching=False, worker_extension_cls=GROUP_EXTENSION,
              weight_transfer_config={"backend": "ipc"},
              **MODES[args.mode])
    out["start_seconds"] = round(time.time() - t0, 1)
    model = llm.llm_engine.model_executor.driver_worker.model_runner.model
    codes = lambda: [(str(p.dtype), p.data_ptr()) for p in model.parameters()   # noqa: E731
                     if getattr(p, "nvfp4_kind", "") == "weight"]
    before = codes()
    step("start", lambda: observe(llm))
    if args.new:
        llm.init_weight_transfer_engine({"init_info": {}})
        ctx = multiprocessing.get_context("spawn")
        conn, child = ctx.Pipe()
        trainer = ctx.Process(target=trainer_main, args=(child,), daemon=True)
        trainer.start()
        staged = Path(args.out).with_suffix(".staged.safetensors")

        def ipc(name, path, *, nvfp4, prefix=""):
            out["bytes"][name] = push(llm, conn, path, nvfp4=nvfp4, prefix=prefix)
            return observe(llm)

        def ext(path, prefix):
            save_file({n: t for n, t in load_file(Path(path) / "model.safetensors").items() if n.startswith(prefix)},
                      staged)
            llm.collective_rpc("nvfp4_apply_update", args=(str(staged), 1))
            return observe(llm)

        def rpc(**kwargs):
            llm.collective_rpc("reload_weights", kwargs={**kwargs, "is_checkpoint_format": True})
            return observe(llm)

        step("ipc_bf16", lambda: ipc("ipc_bf16", args.new, nvfp4=False))
        step("ipc_bf16_restored", lambda: ipc("ipc_bf16_restored", args.old, nvfp4=False))
        step("ipc_nvfp4", lambda: ipc("ipc_nvfp4", args.new, nvfp4=True))
        step("ipc_nvfp4_restored", lambda: ipc("ipc_nvfp4_restored", args.old, nvfp4=True))
        step("rpc_bf16", lambda: rpc(weights_iterator=list(load_file(Path(args.new) / "model.safetensors").items())))
        step("rpc_restored", lambda: rpc(weights_path=args.old))

        def colocated(path, version):
            from nvfp4_sampler.server.colocated import ColocatedRefit

            state = load_file(Path(path) / "model.safetensors", device="cuda")
            refit = ColocatedRefit(llm, state, config=json.loads((Path(path) / "config.json").read_text()))
            out.setdefault("per_tensor_entries", []).extend(refit.update(version)["per_tensor_entries"])
            return observe(llm)

        step("colocated", lambda: colocated(args.new, 2))
        step("colocated_restored", lambda: colocated(args.old, 3))
        pool, port = ThreadPoolExecutor(1), free_port()        # the trainer: rank 0 of a gloo weight group
        sent = pool.submit(group_trainer, port, 2, [{n: t.cpu() for n, t in trainer_tensors(p, nvfp4=True)[0].items()}
                                                     for p in (args.new, args.old)], timeout_s=300)

        def receive(version):
            llm.collective_rpc("nvfp4_receive_rank_update", args=(version,))
            return observe(llm)

        join = ("127.0.0.1", port, 1, 2, "gloo", 300)                  # the worker: rank 1
        step("group_plan", lambda: (llm.collective_rpc("nvfp4_join_weight_group", args=join),
                                    llm.collective_rpc("nvfp4_share_rank_plans"))[1])
        step("group", lambda: receive(10))
        step("group_restored", lambda: receive(11))
        step("group_sent", lambda: sent.result(timeout=300)[1])       # the trainer's verdicts: [True, True]
        pool.shutdown(wait=False)
        partial = [("shard", f"{SHARD}.", True)]
        if json.loads((Path(args.old) / "config.json").read_text())["model_type"].endswith("_moe"):
            partial.append(("expert", f"{EXPERT}.", False))
        for name, prefix, nvfp4 in partial:
            step(f"ipc_{name}", lambda: ipc(f"ipc_{name}", args.new, nvfp4=nvfp4, prefix=prefix))
            step(f"ipc_{name}_restored", lambda: ipc(f"ipc_{name}_restored", args.old, nvfp4=False))
            if nvfp4:       # the extension gets the same triplet the trainer sent
                tensors = {n: t.cpu() for n, t in trainer_tensors(args.new, nvfp4=True, prefix=prefix)[0].items()}
                save_file(tensors, staged)
                step(f"ext_{name}", lambda: (llm.collective_rpc("nvfp4_apply_update", args=(str(staged), 1)),
                                             observe(llm))[1])
            else:
                step(f"ext_{name}", lambda: ext(args.new, prefix))
            step(f"ext_{name}_restored", lambda: ipc(f"ext_{name}_restored", args.old, nvfp4=False))
        conn.send(None)
        trainer.join(60)
        staged.unlink(missing_ok=True)
    out["codes_4bit_in_place"] = codes() == before and {d for d, _ in before} == {"torch.uint8"}
    out["total_seconds"] = round(time.time() - t0, 1)
    save()


if __name__ == "__main__":
    main()
