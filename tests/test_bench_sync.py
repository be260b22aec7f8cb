"""bench/bench_sync.py's planned mode, the parts that need no GPU: the manifest and plan of the
Qwen3-30B-A3B shape, the timing table, and a small planned run on the CPU whose sidecar profiles its commits;
bench/bench_sync_vllm.py's colocated refit of a vLLM CPU engine (one layer); bench/bench_sync_nccl.py's
trainer and two tensor-parallel sampler ranks over gloo."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from bench import bench_sync as bs
from nvfp4_sampler.server.plan import TransferPlan


def test_planned_manifest_of_the_whole_model():
    manifest = bs.nvfp4_manifest({**bs.QWEN3_30B_A3B, "num_hidden_layers": 48, "vocab_size": 151936})
    counts = bs.plan_counts(TransferPlan.build(manifest))
    assert counts["manifest_entries"] == 18867 and counts["manifest_tensors"] == 56115
    assert counts["planned_entries"] == 435 and counts["planned_tensors"] == 819
    assert counts["sidecar_host_syncs"] == counts["buckets"] + 1


def test_timing_table():
    row = {k: 0.5 for k in bs.SUBSTEPS} | {"entries": 12, "buckets": 1, "trainer_host_syncs": 1,
                                          "sidecar_host_syncs": 2}
    lines = bs.timing_table({"steady": row, "bad": {"error": "OOM"}}, scale=48).splitlines()
    assert lines[0].startswith("| run | plan s | version s | convert s") and len(lines) == 4
    assert "| sidecar s | sidecar_queue s | sidecar_open s | sidecar_copy s | sidecar_status s |" in lines[0]
    assert lines[2].endswith("| 24.00 | 12 | 1 | 1 + 2 |") and "not available: OOM" in lines[3]
    assert all(line.count("|") == lines[0].count("|") for line in lines)


def test_planned_run_profiles_the_sidecars_commits(tmp_path):
    """`--profile-commits DIR`: the sidecar (embedded engine, through NVFP4_SAMPLER_PROFILE_COMMITS) writes each
    commit's profiler table there, one per committed version, and the bench prints the last one."""
    root = Path(__file__).resolve().parents[1]
    res = subprocess.run([sys.executable, "bench/bench_sync.py", "--quick", "--paths", "planned",
                          "--profile-commits", str(tmp_path / "commits")], cwd=root, capture_output=True,
                         text=True, timeout=600)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    tables = sorted((tmp_path / "commits").glob("commit-*.txt"))
    assert [t.name for t in tables] == ["commit-1.txt", "commit-2.txt"]     # the first update and one repeat
    assert "aten::_foreach_copy_" in tables[-1].read_text()
    assert "the last commit's operators and kernels" in res.stdout and "aten::_foreach_copy_" in res.stdout


@pytest.mark.engine
def test_colocated_vllm_bench_runs_on_the_cpu(tmp_path):
    """bench/bench_sync_vllm.py --quick: the nvfp4_sampler engine from the pre-quantized placeholder checkpoint, the
    trainer's fused BF16 state built beside it, the colocated refit and load_weights with per-expert names timed."""
    root = Path(__file__).resolve().parents[1]
    out = tmp_path / "bench.json"
    res = subprocess.run([sys.executable, "bench/bench_sync_vllm.py", "--quick", "--distinct-layers", "1", "--out",
                          str(out)], cwd=root, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    results = json.loads(out.read_text())
    nv = results["engines"]["nvfp4_sampler"]
    assert results["distinct_layers"] == 1                               # the engine process ran with it
    assert nv["colocated_entries"] == 12 and nv["colocated_report"]["version"] == 2    # a first update and one repeat
    assert len(nv["nvfp4 load_weights"]["runs"]) == 2 and "| nvfp4 colocated |" in res.stdout


def test_nccl_bench_runs_on_the_cpu(tmp_path):
    out = tmp_path / "sync_nccl.json"
    subprocess.run([sys.executable, "bench/bench_sync_nccl.py", "--quick", "--out", str(out)], check=True, timeout=300,
                   cwd=Path(__file__).resolve().parents[1])
    ranks = json.loads(out.read_text())["ranks"]
    assert [r["rank"] for r in ranks] == [0, 1, 2]
    assert ranks[1]["bytes"] == ranks[2]["bytes"] < ranks[0]["whole_bytes"]
    assert ranks[0]["bytes"] == 2 * ranks[1]["bytes"]               # the trainer sends each rank its own
    assert all(r[m] > 0 for r in ranks for m in ("broadcast", "per_rank", "roof"))
