"""The sidecar's HTTP data plane on loopback: payload GB/s of update bodies, NVFP4 and BF16.

A random Qwen3-shaped model (BF16, quantized on load) is served by a real sidecar child
(`nvfp4-sampler serve --engine embedded`); each push is begin -> one body -> commit through
`SamplerClient`, with random NVFP4 triplets (or BF16 tensors) of the model's shapes built in memory
beforehand, so only the transfer is timed: no conversion. "body" is the PUT of the frames (payload
bytes / seconds from the first byte to the server's answer: parsed, checksummed, NaN-checked and
staged); "commit" is staging handed to the engine and applied. CPU seconds per GB of payload of the
sidecar process (/proc) and of this client during the body say what two idle cores could sustain
when the machine is shared (wall GB/s moves 2-3x with other jobs). Medians of `--repeats`.

    .venv/bin/python bench/bench_wire.py [--hidden 1536 --inter 4096 --layers 12] [--repeats 5]
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from nvfp4_sampler.server.client import SamplerClient
from nvfp4_sampler.server.engines.base import checkpoint_specs
from nvfp4_sampler.server.process import sidecar
from nvfp4_sampler.server.protocol import TensorEntry
from nvfp4_sampler.server.wire import encode_frame, payload_nbytes

ROOT = Path(__file__).resolve().parents[1]


def _model(root: Path, *, hidden: int, inter: int, layers: int) -> Path:
    """A random BF16 Qwen3 folder (nvfp4_sampler.testing.models.tiny_qwen3 with these sizes, heads of 64)."""
    code = (f"from nvfp4_sampler.testing.models import tiny_qwen3; print(tiny_qwen3({str(root / 'model')!r}, hidden_size={hidden}, "
            f"intermediate_size={inter}, num_hidden_layers={layers}, num_attention_heads={hidden // 64}, "
            f"num_key_value_heads={max(1, hidden // 256)}, head_dim=64))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True, capture_output=True, text=True)
    return Path(out.stdout.strip().splitlines()[-1])


def _update(model: Path, layout: str) -> tuple[list[TensorEntry], dict[str, torch.Tensor]]:
    """Random tensors for every tensor of the model: NVFP4 triplets for quantized linears under
    layout "nvfp4", BF16 otherwise (valid values: finite, positive global scales)."""
    g = torch.Generator().manual_seed(0)
    entries, tensors = [], {}
    for name, spec in checkpoint_specs(model).items():
        if layout == "nvfp4" and spec.quantized:
            n, k = spec.shape
            p = name.removesuffix(".weight")
            tensors[name] = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=g)
            tensors[f"{p}.weight_scale"] = (torch.rand(n, k // 16, generator=g) * 4 + 0.5).to(torch.float8_e4m3fn)
            tensors[f"{p}.weight_scale_2"] = torch.tensor(1e-3)
            entries.append(TensorEntry(name=name, layout="nvfp4", dtype="nvfp4", shape=[n, k]))
        else:
            tensors[name] = (torch.randn(spec.shape, generator=g) * 0.02).to(torch.bfloat16)
            entries.append(TensorEntry(name=name, layout="dense", dtype="bfloat16", shape=list(spec.shape)))
    return entries, tensors


def _cpu_seconds(pid: int) -> float:
    """user + system CPU seconds of process `pid` so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _push(client: SamplerClient, entries, tensors, *, server_pid: int) -> tuple[float, float, float, float]:
    """(body seconds, commit seconds, sidecar CPU seconds and client CPU seconds during the body)."""
    st = client.begin(client.version().weight_version + 1, entries)
    s0, c0, t0 = _cpu_seconds(server_pid), time.process_time(), time.perf_counter()
    st = client.send(st.update_id, (b for e in entries for b in encode_frame(e, tensors)))
    t1 = time.perf_counter()
    server_cpu, client_cpu = _cpu_seconds(server_pid) - s0, time.process_time() - c0
    assert not st.missing_count, st.missing[:3]
    client.commit(st.update_id)
    return t1 - t0, time.perf_counter() - t1, server_cpu, client_cpu


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hidden", type=int, default=1536)
    p.add_argument("--inter", type=int, default=4096)
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--layouts", default="nvfp4,bf16", help="comma-separated: nvfp4, bf16")
    args = p.parse_args()

    work = Path(tempfile.mkdtemp(prefix="bench-wire-"))
    model = _model(work, hidden=args.hidden, inter=args.inter, layers=args.layers)
    rows = []
    with sidecar(model, engine="embedded", log=work / "sidecar.log") as srv, SamplerClient(srv.url) as client:
        for layout in args.layouts.split(","):
            entries, tensors = _update(model, layout)
            nbytes = sum(payload_nbytes(e) for e in entries)
            _push(client, entries, tensors, server_pid=srv.proc.pid)        # warm-up
            runs = [_push(client, entries, tensors, server_pid=srv.proc.pid) for _ in range(args.repeats)]
            med = [statistics.median(r[i] for r in runs) for i in range(4)]
            rows.append((layout, nbytes, *med, max(nbytes / r[0] for r in runs)))
    print(f"\nmodel hidden {args.hidden}, MLP {args.inter}, {args.layers} layers; embedded sidecar on 127.0.0.1; "
          f"medians of {args.repeats} pushes\n")
    print("| body | payload MB | body s | GB/s (median) | GB/s (best) | CPU s/GB sidecar | CPU s/GB client | commit s |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for layout, nbytes, body, commit, server_cpu, client_cpu, best in rows:
        gb = nbytes / 1e9
        print(f"| {layout} | {nbytes / 1e6:.1f} | {body:.3f} | {gb / body:.2f} | {best / 1e9:.2f} | "
              f"{server_cpu / gb:.2f} | {client_cpu / gb:.2f} | {commit:.3f} |")
    print(f"\nbody route: {'data-plane port' if os.environ.get('NVFP4_SAMPLER_DATA_PORT', '0') != 'off' else 'main port'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
