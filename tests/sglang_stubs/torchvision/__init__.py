"""Import stub for torchvision in the SGLang test venv (tests/sglang-requirements.txt).

PyPI's torchvision is a CUDA build that breaks beside the CPU torch, yet SGLang imports it at
module level in its multimodal processors and configs, which a text-only test never calls.
This stub lets those modules import; using any of its names raises a clear RuntimeError.
Only the SGLang test harness puts this folder on sys.path.
"""
import enum
import sys
import types

__version__ = "0.0.0+stub"


class InterpolationMode(enum.Enum):
    NEAREST = "nearest"
    NEAREST_EXACT = "nearest-exact"
    BILINEAR = "bilinear"
    BICUBIC = "bicubic"
    BOX = "box"
    HAMMING = "hamming"
    LANCZOS = "lanczos"


def _unavailable(qualname: str):
    def call(*args, **kwargs):
        raise RuntimeError(f"{qualname} is not available: torchvision is a stub in the SGLang test venv "
                           "(text-only tests; tests/sglang_stubs/torchvision)")
    call.__qualname__ = qualname
    return call


def _stub_module(name: str) -> types.ModuleType:
    module = types.ModuleType(name)
    module.__path__ = []                       # a package: submodules resolve through sys.modules
    module.InterpolationMode = InterpolationMode

    def getattr_(attr: str):
        if attr.startswith("__"):              # __file__, __spec__, ...: inspect and importlib probe these
            raise AttributeError(f"module {name!r} has no attribute {attr!r}")
        return _unavailable(f"{name}.{attr}")

    module.__getattr__ = getattr_
    sys.modules[name] = module
    return module


for _name in ("transforms", "transforms.functional", "transforms.v2", "transforms.v2.functional", "io", "ops"):
    _stub_module(f"{__name__}.{_name}")
transforms = sys.modules[f"{__name__}.transforms"]
transforms.functional = sys.modules[f"{__name__}.transforms.functional"]
transforms.v2 = sys.modules[f"{__name__}.transforms.v2"]
transforms.v2.functional = sys.modules[f"{__name__}.transforms.v2.functional"]
io = sys.modules[f"{__name__}.io"]
ops = sys.modules[f"{__name__}.ops"]
