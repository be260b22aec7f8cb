"""`nvfp4-sampler` console script: one argparse parser, one subcommand per tool."""
from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    """Parse `argv` (default sys.argv[1:]) and run the chosen subcommand."""
    from converters import cli as convert_cli

    parser = argparse.ArgumentParser(prog="nvfp4-sampler", description="NVFP4 sampler tools")
    sub = parser.add_subparsers(dest="command", required=True)
    convert_cli.add_parser(sub)
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
