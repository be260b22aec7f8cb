"""The sampler checkpoint format: the one contract between `converters` (write), the engine
plugins (`sampler_plugin`, load) and the sidecar (`server`, accept updates). Torch-free.

A quantized linear `P` (unfused HF module name: `...self_attn.q_proj`, `...mlp.experts.3.up_proj`)
with a logical weight [N, K] is stored as the NVFP4 triplet (TRIPLET, dtypes as torch names)
  P.weight          uint8          [N, K/2]   two E2M1 codes per byte, even element in the low nibble
  P.weight_scale    float8_e4m3fn  [N, K/16]  E4M3 block scales, linear layout
  P.weight_scale_2  float32        []         decode scale (amax / 2688) of that checkpoint tensor
Which tensors are NVFP4: `is_nvfp4_weight(name, config)`, the weight of a linear in LINEARS whose
module `should_quantize` (not lm_head, embeddings, MoE routers, nor a `keep_bf16` prefix); every
other tensor keeps its name, dtype and shape. The checkpoint's config.json carries
`quantization_config = SamplerConfig(...).to_dict()`, its `Recipe` (how weights and activations are
quantized) flattened into the keys `weight_recipe`, `op_order`, `activation_scaling`.
"""
from __future__ import annotations

import dataclasses
from typing import Any

METHOD_NAME = "nvfp4_sampler"
FORMAT_VERSION = 1
WEIGHT_RECIPES = ("1d", "2d")                   # 1x16 blocks; 16x16 tiles (TransformerEngine's weights)
OP_ORDERS = ("vllm", "te")                      # quantizer float-op orders (kernels.reference): vLLM's, TE's
ACTIVATION_SCALINGS = ("per_token", "per_tensor")

BLOCK = 16                                          # elements per E4M3 block scale, along K
WEIGHT, SCALE, SCALE_2 = "weight", "weight_scale", "weight_scale_2"
TRIPLET = (WEIGHT, SCALE, SCALE_2)
TRIPLET_DTYPES = {WEIGHT: "uint8", SCALE: "float8_e4m3fn", SCALE_2: "float32"}
COLUMN_PARALLEL = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")   # split N across TP ranks
ROW_PARALLEL = ("o_proj", "down_proj")                                    # split K across TP ranks
LINEARS = COLUMN_PARALLEL + ROW_PARALLEL                                  # the linears NVFP4 applies to
FUSED_GROUPS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))  # engines fuse these into one layer
# Always BF16: output head, embeddings, and MoE routers (`mlp.gate`, a plain linear in every engine;
# quantizing it changes expert choices). Matched on the module name's components.
ALWAYS_BF16_SUFFIXES = ("lm_head", "embed_tokens", "mlp.gate", "shared_expert_gate")


def triplet_shapes(n: int, k: int) -> dict[str, tuple[int, ...]]:
    """Shapes of the triplet of a logical weight [n, k] by kind; ValueError if k % 16."""
    if k % BLOCK:
        raise ValueError(f"K={k} is not a multiple of {BLOCK}; NVFP4 needs 16-element blocks")
    return {WEIGHT: (n, k // 2), SCALE: (n, k // BLOCK), SCALE_2: ()}


def triplet_names(prefix: str) -> dict[str, str]:
    """Checkpoint names of module `prefix`'s triplet by kind ("P.weight", "P.weight_scale", ...)."""
    return {kind: f"{prefix}.{kind}" for kind in TRIPLET}


@dataclasses.dataclass(frozen=True)
class Recipe:
    """How weights and activations are quantized: the learner's recipe, which the sampler must match.

    weight: "1d" (1x16 blocks, default) or "2d" (16x16 tiles, TransformerEngine's weight recipe).
    op_order: the quantizers' float-op order, "vllm" (default, vLLM's NVFP4 reference) or "te"
      (TransformerEngine's, bit for bit: a TE learner's codes for weights and activations).
    activation_scaling: "per_token" (default; a token's codes ignore its batch neighbours) or
      "per_tensor" (dynamic, one scale per batch: for comparison only).
    TE's recipe is `Recipe(weight="2d", op_order="te")`. Allowed values: WEIGHT_RECIPES, OP_ORDERS,
    ACTIVATION_SCALINGS. On disk (`to_json`) the keys are `weight_recipe`, `op_order`,
    `activation_scaling` of `quantization_config`.
    """

    weight: str = "1d"
    op_order: str = "vllm"
    activation_scaling: str = "per_token"

    def __post_init__(self):
        for field, allowed in (("weight", WEIGHT_RECIPES), ("op_order", OP_ORDERS),
                               ("activation_scaling", ACTIVATION_SCALINGS)):
            value = getattr(self, field)
            if value not in allowed:
                raise ValueError(f"{METHOD_NAME}: recipe {_JSON_KEYS[field]} must be one of {allowed}, got {value!r}")

    def to_json(self) -> dict[str, str]:
        """The recipe's `quantization_config` keys: {"weight_recipe", "op_order", "activation_scaling"}."""
        return {key: getattr(self, field) for field, key in _JSON_KEYS.items()}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> "Recipe":
        """The recipe from `quantization_config` keys (missing keys: defaults; other keys ignored)."""
        return cls(**{field: d[key] for field, key in _JSON_KEYS.items() if key in d})


_JSON_KEYS = {"weight": "weight_recipe", "op_order": "op_order", "activation_scaling": "activation_scaling"}


@dataclasses.dataclass(frozen=True)
class SamplerConfig:
    """recipe: the `Recipe` (weight recipe, op order, activation scaling) the sampler quantizes with.
    keep_bf16: module-name prefixes left unquantized, on top of lm_head, embeddings and MoE routers.
    backend: "auto" or a kernels.dispatch backend name.
    prequantized: True when the checkpoint holds NVFP4 codes and scales (written by the converter).
    strict: batch-invariant execution (an execution choice, not part of the recipe): every NVFP4 GEMM
      sums each output in an order that depends on the weight shape only, never on the batch, so a
      token's log-probs are the same bits in decode and in a teacher-forced recomputation (with the
      engine's own batch-invariant mode for the rest; docs/NUMERICS.md "Strict mode"). Needs
      per-token activation scaling. Default False: the faster batch-dependent paths.
    """

    recipe: Recipe = Recipe()
    keep_bf16: tuple[str, ...] = ()
    backend: str = "auto"
    prequantized: bool = False
    strict: bool = False

    def __post_init__(self):
        if not isinstance(self.recipe, Recipe):
            raise ValueError(f"{METHOD_NAME}: recipe must be a Recipe, got {self.recipe!r}")
        if isinstance(self.keep_bf16, str) or not all(isinstance(p, str) for p in self.keep_bf16):
            raise ValueError(f"{METHOD_NAME}: keep_bf16 must be a list of module-name prefixes, got {self.keep_bf16!r}")
        object.__setattr__(self, "keep_bf16", tuple(self.keep_bf16))
        if not isinstance(self.strict, bool):
            raise ValueError(f"{METHOD_NAME}: strict must be true or false, got {self.strict!r}")
        if self.strict and self.recipe.activation_scaling != "per_token":
            raise ValueError(f"{METHOD_NAME}: strict needs activation_scaling 'per_token' (a per-tensor scale "
                             f"depends on the whole batch), got {self.recipe.activation_scaling!r}")

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "SamplerConfig":
        """Parse a `quantization_config` dict; unknown keys and a wrong format_version raise ValueError."""
        d = dict(d)
        method = d.pop("quant_method", METHOD_NAME)
        if method != METHOD_NAME:
            raise ValueError(f"quant_method must be {METHOD_NAME!r}, got {method!r}")
        version = d.pop("format_version", FORMAT_VERSION)
        if version != FORMAT_VERSION:
            raise ValueError(f"{METHOD_NAME}: format_version {version} is not supported (this build reads {FORMAT_VERSION})")
        recipe = Recipe.from_json({k: d.pop(k) for k in _JSON_KEYS.values() if k in d})
        fields = {f.name for f in dataclasses.fields(cls)} - {"recipe"}
        unknown = sorted(set(d) - fields)
        if unknown:
            raise ValueError(f"{METHOD_NAME}: unknown quantization_config option(s) {unknown}; "
                             f"known: {sorted(fields | set(_JSON_KEYS.values()))}")
        if "keep_bf16" in d and isinstance(d["keep_bf16"], list):
            d["keep_bf16"] = tuple(d["keep_bf16"])
        return cls(recipe=recipe, **d)

    def to_dict(self) -> dict[str, Any]:
        """The `quantization_config` dict written into a sampler checkpoint's config.json (`strict` only
        when set: an execution choice, so checkpoints written without it read back to the same keys)."""
        return {"quant_method": METHOD_NAME, "format_version": FORMAT_VERSION, **self.recipe.to_json(),
                "keep_bf16": list(self.keep_bf16), "backend": self.backend, "prequantized": self.prequantized,
                **({"strict": True} if self.strict else {})}


def should_quantize(prefix: str, config: SamplerConfig) -> bool:
    """True if the linear/MoE module named `prefix` (e.g. "model.layers.0.self_attn.qkv_proj")
    is NVFP4 under `config`; False for always-BF16 modules and user `keep_bf16` prefixes."""
    if any(prefix == s or prefix.endswith("." + s) for s in ALWAYS_BF16_SUFFIXES):
        return False
    return not any(prefix == p or prefix.startswith(p.rstrip(".") + ".") for p in config.keep_bf16)


def fused_group(name: str) -> tuple[str, ...] | None:
    """Checkpoint names of the weights engines fuse with weight `name` into one layer (q/k/v ->
    qkv_proj, gate/up -> gate_up_proj, per expert), `name` among them; None if it is not fused.
    E.g. "m.layers.0.self_attn.k_proj.weight" -> ("m.layers.0.self_attn.q_proj.weight", ... v_proj)."""
    prefix, _, leaf = name.rpartition(".")
    parent, _, module = prefix.rpartition(".")
    group = next((g for g in FUSED_GROUPS if module in g), None)
    return None if group is None else tuple(f"{parent}.{m}.{leaf}" for m in group)


def is_nvfp4_weight(name: str, config: SamplerConfig) -> bool:
    """True if checkpoint tensor `name` is the weight of a linear that the sampler holds in NVFP4
    (stored as the triplet of its module)."""
    prefix, _, leaf = name.rpartition(".")
    return leaf == WEIGHT and prefix.rpartition(".")[2] in LINEARS and should_quantize(prefix, config)
