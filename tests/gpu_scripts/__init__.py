"""Scripts the GPU tests and benchmarks run in subprocesses (one vLLM engine per process)."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def run_script(module: str, args: list[str], out: Path, log: Path, *, timeout: float) -> dict:
    """Run `python -m module *args --out OUT` from the repository root, output to `log`; the JSON it
    wrote to `out` (steps cut short keep what they measured), with errors["process"] set when it exited
    non-zero."""
    with open(log, "w") as f:
        proc = subprocess.run([sys.executable, "-m", module, *args, "--out", str(out)],
                              cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, timeout=timeout)
    result = json.loads(out.read_text()) if out.exists() else {"errors": {}}
    if proc.returncode:
        result["errors"]["process"] = f"exit {proc.returncode}: " + log.read_text()[-4000:]
    return result
