"""bench/bench_graph_launch.py's table on the records its device run writes: a formatting error there would
cost a device run its printed table."""
from __future__ import annotations

import pytest

pytest.importorskip("triton")

from bench import bench_graph_launch as bg  # noqa: E402 - after the importorskip


def test_table_prints_every_form_with_its_ratios():
    rows = {"bf16": dict(kernels=144, host_us=584.0, gpu_us=5867.0),
            "nvfp4": dict(kernels=288, host_us=1145.0, gpu_us=4629.0)}
    lines: list[str] = []
    bg.print_table({64: rows}, "test device", 36, print=lines.append)
    assert lines[0] == "\n# test device; Qwen3-8B linears x 36 layers as one CUDA graph; medians of 50"
    assert lines[2].split() == ["64", "bf16", "144", "584.0", "4.06", "5867.0", "0.10"]
    assert lines[3].split() == ["64", "nvfp4", "288", "1145.0", "3.98", "4629.0", "0.25"]
