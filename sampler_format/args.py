"""The recipe's command-line flags, built from the contract's constants: one definition for the
`convert`, `push` and `diagnose` CLIs. `--recipe` is the weight recipe (the `Recipe.weight` field)."""
from __future__ import annotations

import argparse

from . import ACTIVATION_SCALINGS, OP_ORDERS, WEIGHT_RECIPES, Recipe

_DEFAULT = Recipe()


def add_recipe_args(parser: argparse.ArgumentParser, *, activation_scaling: bool = True) -> None:
    """Add `--recipe`, `--op-order` and (with `activation_scaling`) `--activation-scaling` to `parser`;
    `recipe_from_args` builds the Recipe from the parsed namespace."""
    parser.add_argument("--recipe", choices=WEIGHT_RECIPES, default=_DEFAULT.weight,
                        help="the learner's weight recipe: 1d = 1x16 blocks, 2d = 16x16 tiles (TransformerEngine "
                             f"NVFP4BlockScaling); default {_DEFAULT.weight}")
    parser.add_argument("--op-order", choices=OP_ORDERS, default=_DEFAULT.op_order,
                        help="the quantizers' float-op order: vllm (the spec) or te (TransformerEngine's, bit for "
                             f"bit); default {_DEFAULT.op_order}")
    if activation_scaling:
        parser.add_argument("--activation-scaling", choices=ACTIVATION_SCALINGS, default=_DEFAULT.activation_scaling,
                            help="the sampler's activation scaling (per_tensor: for comparison only); "
                                 f"default {_DEFAULT.activation_scaling}")


def recipe_from_args(args: argparse.Namespace) -> Recipe:
    """The Recipe of flags added by `add_recipe_args` (`--activation-scaling` absent: the default)."""
    return Recipe(weight=args.recipe, op_order=args.op_order,
                  activation_scaling=getattr(args, "activation_scaling", _DEFAULT.activation_scaling))
