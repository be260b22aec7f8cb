"""The README's commands match the code: every `nvfp4-sampler ...` line parses with the CLI's own
parser (flags and choices exist), the set-up commands are the Makefile's, and the vLLM flags name
classes and methods that exist. Running them for real is the job of the tests named beside each
(test_server*.py, test_vllm_server.py, test_push.py) and of `make demo`."""
from __future__ import annotations

import importlib
import re
import shlex
from pathlib import Path

import pytest

from nvfp4_sampler.server.cli import build_parser

README = (Path(__file__).resolve().parents[1] / "README.md").read_text()
MAKEFILE = (Path(__file__).resolve().parents[1] / "Makefile").read_text()


def _cli_lines() -> list[str]:
    lines = []
    for block in re.findall(r"```bash\n(.*?)```", README, flags=re.S):
        for line in block.splitlines():
            line = line.split("  #")[0].strip()
            m = re.match(r"^(?:\$B/)?nvfp4-sampler\s+(.*)$", line)
            if m:
                lines.append(m.group(1))
    return lines


def test_the_readme_starts_with_the_two_setup_commands():
    first = re.search(r"```bash\n(.*?)```", README, flags=re.S).group(1).splitlines()
    assert [line.split("#")[0].strip() for line in first] == ["make demo", "make test"]
    assert re.search(r"^demo:", MAKEFILE, flags=re.M) and re.search(r"^test:", MAKEFILE, flags=re.M)


@pytest.mark.parametrize("line", _cli_lines())
def test_every_cli_line_parses(line):
    args = build_parser().parse_args(shlex.split(line))
    assert callable(args.func)


def test_the_cli_lines_cover_every_subcommand_users_need():
    used = {line.split()[0] for line in _cli_lines()}
    assert {"convert", "serve", "sidecar", "push", "logprobs", "version"} <= used


def test_the_vllm_flags_name_real_objects():
    for path in set(re.findall(r"--worker-extension-cls\s+([\w.]+)", README)):
        module, name = path.rsplit(".", 1)
        assert hasattr(importlib.import_module(module), name), path
    assert "--quantization nvfp4_sampler" in README


def test_the_device_steps_named_in_the_docs_exist():
    """Every step a `bash bench/h200.sh ...` line of the README or docs/BENCHMARKS.md names is a step of
    bench/h200.sh (its `case` labels)."""
    root = Path(__file__).resolve().parents[1]
    steps = set(re.findall(r"^\s+([a-z0-9_.]+)\)", (root / "bench" / "h200.sh").read_text(), flags=re.M))
    named = {step for text in (README, (root / "docs" / "BENCHMARKS.md").read_text())
             for line in re.findall(r"bash bench/h200\.sh ([a-z0-9_.+ ]+)", text)
             for step in re.split(r"[+ ]", line.strip()) if step}
    assert named and not named - steps, sorted(named - steps)
