"""nvfp4-sampler: NVFP4 weights and per-token NVFP4 activations in vLLM and SGLang.

Every import name of the distribution lives under this package, so nothing it installs collides
with other top-level packages (Hugging Face's `kernels`, for one). The subpackages are the
repository's top-level folders, mapped here at install (pyproject `package-dir`):
`nvfp4_sampler.sampler_format` (the torch-free format contract), `nvfp4_sampler.kernels` (the
format, its executable spec, CPU and Triton kernels, torch custom ops), `nvfp4_sampler.converters`
(learner checkpoints -> sampler layout), `nvfp4_sampler.sampler_plugin` (the `nvfp4_sampler`
quantization method with its vLLM and SGLang adapters), `nvfp4_sampler.diagnostics`
(learner-vs-sampler mismatch diagnostics), `nvfp4_sampler.server` (the sidecar, client and the
`nvfp4-sampler` CLI) and `nvfp4_sampler.testing` (tiny random models and checkpoints for tests and
benchmarks). docs/ARCHITECTURE.md says who may import whom.
"""
import os as _os

__version__ = "0.1.0"

# This file imported from a source checkout (the repository root on sys.path ahead of any install:
# pytest's rootdir, `python -m` from the root): the subpackages are this folder's siblings there.
# An installed copy (wheel, --target) has them inside this folder, and this does nothing.
_here = _os.path.dirname(_os.path.abspath(__file__))
_root = _os.path.dirname(_here)
if not _os.path.isdir(_os.path.join(_here, "kernels")) and _os.path.isfile(
        _os.path.join(_root, "sampler_format", "__init__.py")):
    __path__.append(_root)  # noqa: F821  (a package's __path__)
del _here, _root
