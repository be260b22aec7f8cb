"""What `pip install nvfp4-sampler` puts into site-packages: one import package, `nvfp4_sampler`
(issue #22: the folders' bare names collide on PyPI, `kernels` with Hugging Face's kernel hub).

The wheel is built from a scratch copy of the sources (no build/ left in the checkout, no stale
build files in the wheel). Hugging Face's `kernels` is installed with --no-deps into a scratch
--target folder, not into the venv: from the repository root (pytest's rootdir is on sys.path)
`import kernels` finds our `kernels/` folder, and a transformers whose supported range includes the
installed hub version would import it from there. The coexistence check runs in a subprocess whose
working directory is elsewhere, as a user's program would."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = ("nvfp4_sampler", "sampler_format", "kernels", "converters", "sampler_plugin", "diagnostics", "server",
           "testing")
HF_KERNELS = "kernels==0.19.1"


def _pip(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pip", *args], cwd=cwd, capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("wheel")
    src = tmp / "src"
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    for folder in FOLDERS:
        shutil.copytree(ROOT / folder, src / folder, ignore=ignore)
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    r = _pip("wheel", "-q", "--no-deps", "--no-build-isolation", "--no-index", "-w", str(tmp / "dist"), str(src),
             cwd=tmp)
    assert r.returncode == 0, r.stdout + r.stderr
    (whl,) = (tmp / "dist").glob("nvfp4_sampler-*.whl")
    return whl


def _names(whl: Path) -> list[str]:
    with zipfile.ZipFile(whl) as z:
        return z.namelist()


def _read(whl: Path, suffix: str) -> str:
    with zipfile.ZipFile(whl) as z:
        (name,) = [n for n in z.namelist() if n.endswith(suffix)]
        return z.read(name).decode()


def test_wheel_holds_only_the_namespace(wheel):
    dist_info = "nvfp4_sampler-" + wheel.name.split("-")[1] + ".dist-info"
    tops = {n.split("/")[0] for n in _names(wheel)}
    assert tops == {"nvfp4_sampler", dist_info}, tops
    if any(n.endswith(".dist-info/top_level.txt") for n in _names(wheel)):
        assert _read(wheel, ".dist-info/top_level.txt").split() == ["nvfp4_sampler"]


def test_every_source_file_is_in_the_wheel(wheel):
    """A subpackage missing from pyproject's explicit list, or a data file (kernels/cuda/*.cu) missing
    from package-data, would be absent from an installed copy."""
    names = set(_names(wheel))
    missing = []
    for folder in FOLDERS:
        for f in sorted((ROOT / folder).rglob("*")):
            if f.is_dir() or "__pycache__" in f.parts or f.suffix == ".pyc":
                continue
            rel = f.relative_to(ROOT / folder).as_posix()
            installed = f"nvfp4_sampler/{rel}" if folder == "nvfp4_sampler" else f"nvfp4_sampler/{folder}/{rel}"
            if installed not in names:
                missing.append(f"{folder}/{rel}")
    assert not missing, f"not in the wheel (pyproject packages / package-data): {missing}"


def test_entry_points_name_the_namespace(wheel):
    groups, group = {}, None
    for line in _read(wheel, ".dist-info/entry_points.txt").splitlines():
        line = line.strip()
        if line.startswith("["):
            group = groups.setdefault(line.strip("[]"), {})
        elif line:
            name, value = (s.strip() for s in line.split("=", 1))
            group[name] = value
    assert groups == {
        "console_scripts": {"nvfp4-sampler": "nvfp4_sampler.server.cli:main"},
        "vllm.general_plugins": {"nvfp4_sampler": "nvfp4_sampler.sampler_plugin.vllm:register"},
        "sglang.srt.plugins": {"nvfp4_sampler": "nvfp4_sampler.sampler_plugin.sglang:register"},
    }


CHECK = """
import importlib.metadata, importlib.util, json
import kernels
import nvfp4_sampler.kernels as ours
from nvfp4_sampler.kernels import ops  # registers torch.ops.nvfp4_sampler.*
import torch
eps = {e.name: e.value for e in importlib.metadata.entry_points(group="vllm.general_plugins")}
print(json.dumps({"hf": kernels.__file__, "hf_get_kernel": hasattr(kernels, "get_kernel"),
                  "ours": ours.__file__, "ours_tensor": hasattr(ours, "NVFP4Tensor"),
                  "op": hasattr(torch.ops.nvfp4_sampler, "linear"),
                  "plugin": eps.get("nvfp4_sampler"),
                  "plugin_module": importlib.util.find_spec("nvfp4_sampler.sampler_plugin.vllm").origin}))
"""


def _editable_root() -> Path | None:
    """The checkout an editable install of nvfp4-sampler in this interpreter points at (PEP 610)."""
    import importlib.metadata

    for dist in importlib.metadata.distributions(name="nvfp4-sampler"):   # an in-tree egg-info may come first
        info = json.loads(dist.read_text("direct_url.json") or "{}")
        if info.get("dir_info", {}).get("editable") and info.get("url", "").startswith("file://"):
            return Path(info["url"].removeprefix("file://"))
    return None


@pytest.fixture(scope="module")
def hf_kernels(tmp_path_factory) -> Path:
    target = tmp_path_factory.mktemp("hf-kernels")
    r = _pip("install", "-q", "--no-deps", "--target", str(target), HF_KERNELS, cwd=target)
    if r.returncode != 0:
        pytest.skip(f"cannot install Hugging Face's {HF_KERNELS} from the package index: {r.stderr[-500:]}")
    return target


@pytest.mark.parametrize("install", ["wheel", "editable"])
def test_hf_kernels_and_ours_in_one_process(install, wheel, hf_kernels, tmp_path):
    """`import kernels` is Hugging Face's package and `import nvfp4_sampler.kernels` ours, in one
    process: from the built wheel (a regular install) and from this venv's editable install."""
    paths = [str(hf_kernels)]
    if install == "wheel":
        ours = tmp_path / "site"
        r = _pip("install", "-q", "--no-deps", "--no-index", "--target", str(ours), str(wheel), cwd=tmp_path)
        assert r.returncode == 0, r.stderr
        paths.append(str(ours))
        where = ours / "nvfp4_sampler"
    else:
        where = _editable_root()
        if where is None:
            pytest.skip("nvfp4-sampler is not installed editable in this interpreter (make venv does)")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(paths)}
    run = subprocess.run([sys.executable, "-c", CHECK], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    got = json.loads(run.stdout.strip().splitlines()[-1])
    assert Path(got["hf"]).is_relative_to(hf_kernels) and got["hf_get_kernel"], got
    assert Path(got["ours"]).is_relative_to(where) and got["ours_tensor"] and got["op"], got
    assert got["plugin"] == "nvfp4_sampler.sampler_plugin.vllm:register", got
    assert Path(got["plugin_module"]).is_relative_to(where), got
