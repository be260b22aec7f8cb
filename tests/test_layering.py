"""The dependency direction between our packages (docs/ARCHITECTURE.md "Dependency direction"),
read from the source with `ast`: every import statement of every module, also those inside
functions, relative ones resolved to their full `nvfp4_sampler.*` names. Fails on a violation."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# folder -> subpackage of nvfp4_sampler (pyproject [tool.setuptools.package-dir])
PACKAGES = ("sampler_format", "kernels", "converters", "sampler_plugin", "diagnostics", "server", "testing")
# which of our subpackages each one may import (besides itself)
MAY_IMPORT = {
    "sampler_format": set(),
    "kernels": {"sampler_format"},
    "converters": {"sampler_format", "kernels"},
    "sampler_plugin": {"sampler_format", "kernels"},
    "diagnostics": {"sampler_format", "kernels", "converters", "sampler_plugin"},
    "server": {"sampler_format", "kernels", "converters", "sampler_plugin", "diagnostics"},
    "testing": {"sampler_format", "kernels", "converters"},
}
# third-party top-level modules that only these subpackages (module-name prefixes) may import
ONLY_IN = {
    "vllm": ("nvfp4_sampler.sampler_plugin.vllm",),
    "sglang": ("nvfp4_sampler.sampler_plugin.sglang",),
    "triton": ("nvfp4_sampler.kernels",),
}
FORBIDDEN_IN_FORMAT = {"torch"}   # sampler_format is the torch-free contract
OLD_TOP_LEVEL = set(PACKAGES)      # the folders' bare names: importable only from the repository root


def module_name(path: Path, root: Path = ROOT) -> str:
    """`kernels/ops.py` -> `nvfp4_sampler.kernels.ops`; `bench/x.py` -> `bench.x`."""
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(["nvfp4_sampler", *parts] if parts[0] in PACKAGES else parts)


def imports(path: Path, root: Path = ROOT) -> list[tuple[int, str]]:
    """(line, absolute module name) of every import in the file; `from X import a` also yields X.a
    (a may be a submodule)."""
    name = module_name(path, root)
    is_pkg = path.name == "__init__.py"
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".")
                base = base[:len(base) - node.level + (1 if is_pkg else 0)]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module
            found.append((node.lineno, mod))
            found += [(node.lineno, f"{mod}.{a.name}") for a in node.names if a.name != "*"]
    return found


def ours(mod: str) -> str | None:
    """The subpackage of nvfp4_sampler that `mod` names (or None)."""
    parts = mod.split(".")
    if parts[0] == "nvfp4_sampler" and len(parts) > 1 and parts[1] in PACKAGES:
        return parts[1]
    return None


def violations(files: list[Path], root: Path = ROOT) -> list[str]:
    bad = []
    for path in files:
        me = module_name(path, root)
        pkg = ours(me)
        rel = path.relative_to(root)
        for line, mod in imports(path, root):
            top = mod.split(".")[0]
            where = f"{rel}:{line} imports {mod}"
            if top in OLD_TOP_LEVEL:
                bad.append(f"{where} (bare folder name: use nvfp4_sampler.{mod})")
            if top in ("tests", "bench") and pkg is not None:
                bad.append(f"{where} (packages never import tests or bench)")
            if top == "tests" and rel.parts[0] == "bench":
                bad.append(f"{where} (bench imports nvfp4_sampler.testing, not tests)")
            if top in ONLY_IN and pkg is not None and not me.startswith(ONLY_IN[top]):
                bad.append(f"{where} ({top} only inside {', '.join(ONLY_IN[top])})")
            if pkg == "sampler_format" and top in FORBIDDEN_IN_FORMAT:
                bad.append(f"{where} (sampler_format is torch-free)")
            other = ours(mod)
            if pkg is not None and other not in (None, pkg) and other not in MAY_IMPORT[pkg]:
                bad.append(f"{where} ({pkg} may import only {sorted(MAY_IMPORT[pkg]) or 'nothing of ours'})")
            if other == "testing" and pkg is not None and pkg != "testing":
                bad.append(f"{where} (only tests and benchmarks import nvfp4_sampler.testing)")
    return bad


def source_files() -> list[Path]:
    files = [f for p in (*PACKAGES, "nvfp4_sampler", "bench", "tests") for f in sorted((ROOT / p).rglob("*.py"))]
    assert files, ROOT
    return files


def test_module_names_resolve_relative_imports():
    assert module_name(ROOT / "kernels" / "ops.py") == "nvfp4_sampler.kernels.ops"
    assert module_name(ROOT / "server" / "engines" / "__init__.py") == "nvfp4_sampler.server.engines"
    assert module_name(ROOT / "bench" / "bench_sync.py") == "bench.bench_sync"


def test_dependency_direction():
    bad = violations(source_files())
    assert not bad, "layering violations:\n" + "\n".join(bad)


@pytest.mark.parametrize("where, code, expected", [
    ("kernels/_probe.py", "from nvfp4_sampler.server import cli\n", "kernels may import only"),
    ("kernels/_probe.py", "def f():\n    from ..sampler_plugin import layers\n", "kernels may import only"),
    ("sampler_format/_probe.py", "import torch\n", "torch-free"),
    ("sampler_plugin/_probe.py", "from nvfp4_sampler.converters import convert\n", "sampler_plugin may import only"),
    ("diagnostics/_probe.py", "from nvfp4_sampler.server import app\n", "diagnostics may import only"),
    ("converters/_probe.py", "import vllm\n", "vllm only inside"),
    ("server/engines/_probe.py", "from sglang.srt import server_args\n", "sglang only inside"),
    ("sampler_plugin/_probe.py", "import triton\n", "triton only inside"),
    ("server/_probe.py", "from tests.server_fixtures import models\n", "never import tests"),
    ("server/_probe.py", "from nvfp4_sampler.testing import models\n", "only tests and benchmarks"),
    ("bench/_probe.py", "from tests import vllm_helpers\n", "bench imports nvfp4_sampler.testing"),
    ("server/_probe.py", "from kernels import dispatch\n", "bare folder name"),
])
def test_a_violation_fails(where, code, expected, tmp_path):
    """Each rule catches a breach (a probe module in a scratch copy of the layout)."""
    probe = tmp_path / where
    probe.parent.mkdir(parents=True)
    probe.write_text(code)
    bad = violations([probe], tmp_path)
    assert any(expected in b for b in bad), bad
