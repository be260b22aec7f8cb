"""`nvfp4-sampler` console script: one argparse parser, one subcommand per tool.

    serve MODEL [--engine vllm|embedded]   the sidecar + OpenAI routes in front of an engine it starts
    sidecar --engine-url URL               the sidecar in front of an already running vLLM server
    push SOURCE [--layout nvfp4|bf16]      stream a checkpoint folder to a sidecar and commit it
    logprobs --tokens 1,2,3 --prompt-len 2 recompute response-token log-probs
    version                                the serving weight version
    demo                                   the whole loop on SmolLM2-135M (`make demo`)
    diagnose --input F | --url U --model M learner-vs-sampler report: metrics, tails, weights, plots
    convert SRC DST                        learner checkpoint -> sampler checkpoint (converters)
"""
from __future__ import annotations

import argparse
import json
import sys

from nvfp4_sampler.sampler_format.args import add_recipe_args, recipe_from_args

DEFAULT_URL = "http://127.0.0.1:8000"


def _server_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host", default=None, help="bind address (default 127.0.0.1; non-loopback needs --token)")
    p.add_argument("--port", type=int, default=None, help="sidecar port (default 8000)")
    p.add_argument("--token", default=None, help="bearer token for mutating routes (or NVFP4_SAMPLER_TOKEN)")
    p.add_argument("--staging-dir", default=None, help="where commits stage the update file")


def _client_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--url", default=DEFAULT_URL, help=f"sidecar URL (default {DEFAULT_URL})")
    p.add_argument("--token", default=None, help="bearer token (or NVFP4_SAMPLER_TOKEN)")


def _run_server(args: argparse.Namespace, **flags) -> int:
    import socket

    import uvicorn

    from .app import create_app
    from .settings import Settings

    settings = Settings.from_env(host=args.host, port=args.port, token=args.token, staging_dir=args.staging_dir,
                                 **flags)
    # bound before the app starts: the engine starting in the lifespan (vLLM picks free ports for its own
    # processes) can then never take the sidecar's port, which uvicorn would bind only after the start-up
    family = socket.AF_INET6 if ":" in settings.host else socket.AF_INET
    sock = socket.create_server((settings.host, settings.port), family=family)
    config = uvicorn.Config(create_app(settings), host=settings.host, port=settings.port, log_level="info")
    uvicorn.Server(config).run(sockets=[sock])   # host and port given for its "running on" line
    return 0


def _serve(args: argparse.Namespace) -> int:
    return _run_server(args, model=args.model, engine=args.engine, vllm_args=tuple(args.vllm_arg) or None,
                       strict=args.strict or None)


def _sidecar(args: argparse.Namespace) -> int:
    return _run_server(args, model=args.model, engine="remote", engine_url=args.engine_url)


def _push(args: argparse.Namespace) -> int:
    from .client import SamplerClient

    with SamplerClient(args.url, token=args.token, retries=args.retries) as c:
        res = c.push(args.source, layout=args.layout, version=args.version, recipe=recipe_from_args(args),
                     shared_group_scale=args.shared_group_scale, device=args.device,
                     bucket_bytes=args.bucket_bytes)
    print(json.dumps(res.to_dict(), indent=2))
    return 0


def _logprobs(args: argparse.Namespace) -> int:
    from .client import SamplerClient

    tokens = [int(t) for t in args.tokens.split(",")]
    with SamplerClient(args.url, token=args.token) as c:
        res = c.logprobs([tokens], [args.prompt_len], top_k=args.top_k)
    print(res.model_dump_json(indent=2, exclude_none=True))
    return 0


def _version(args: argparse.Namespace) -> int:
    from .client import SamplerClient

    with SamplerClient(args.url, token=args.token) as c:
        print(json.dumps(c.version().model_dump(), indent=2))
    return 0


def _demo(args: argparse.Namespace) -> int:
    from .demo import run

    return run(engine=args.engine, port=args.port)


def add_parsers(sub) -> None:
    p = sub.add_parser("serve", help="serve MODEL with the sidecar routes and OpenAI-compatible routes")
    p.add_argument("model", help="HF folder (BF16, or a sampler checkpoint from `convert`)")
    p.add_argument("--engine", choices=("vllm", "embedded"), default=None,
                   help="vllm (the vLLM OpenAI server with the nvfp4_sampler method) or embedded (transformers)")
    p.add_argument("--vllm-arg", action="append", default=[], help="extra argument for the vLLM server (repeat)")
    p.add_argument("--strict", action="store_true",
                   help="batch-invariant mode: decode log-probs equal recomputed ones bitwise (vllm engine; "
                        "on CUDA it also sets VLLM_BATCH_INVARIANT=1)")
    _server_flags(p)
    p.set_defaults(func=_serve)

    p = sub.add_parser("sidecar", help="run the sidecar in front of an already running vLLM server")
    p.add_argument("--engine-url", required=True, help="the vLLM server (started with VLLM_SERVER_DEV_MODE=1)")
    p.add_argument("--model", default=None, help="the served folder (default: the server's /v1/models root)")
    _server_flags(p)
    p.set_defaults(func=_sidecar)

    p = sub.add_parser("push", help="push a checkpoint folder to a sidecar as one committed update")
    p.add_argument("source", help="HF folder with safetensors")
    p.add_argument("--layout", choices=("nvfp4", "bf16"), default="nvfp4",
                   help="nvfp4: convert here and send NVFP4 (default); bf16: send BF16, the sampler quantizes")
    p.add_argument("--version", type=int, default=None, help="target weight version (default: current + 1)")
    add_recipe_args(p, activation_scaling=False)        # the conversion's weight recipe and op order
    p.add_argument("--shared-group-scale", action="store_true",
                   help="q/k/v and gate/up share one second-level scale (as fused-QKV learners hold them)")
    p.add_argument("--device", default=None, help="where to convert (e.g. cuda; default: cpu, where files are read)")
    p.add_argument("--bucket-bytes", type=int, default=512 << 20,
                   help="bytes per streamed bucket; host memory holds about two (default 512 MiB)")
    p.add_argument("--retries", type=int, default=3)
    _client_flags(p)
    p.set_defaults(func=_push)

    p = sub.add_parser("logprobs", help="recompute the log-probs of one token sequence")
    p.add_argument("--tokens", required=True, help="comma-separated token ids")
    p.add_argument("--prompt-len", type=int, required=True)
    p.add_argument("--top-k", type=int, default=0)
    _client_flags(p)
    p.set_defaults(func=_logprobs)

    p = sub.add_parser("version", help="print the serving weight version")
    _client_flags(p)
    p.set_defaults(func=_version)

    p = sub.add_parser("demo", help="the whole loop on SmolLM2-135M: convert, serve, chat, push, log-probs")
    p.add_argument("--engine", choices=("auto", "vllm", "embedded"), default="auto")
    p.add_argument("--port", type=int, default=None, help="sidecar port (default: a free one)")
    p.set_defaults(func=_demo)


def build_parser() -> argparse.ArgumentParser:
    """The `nvfp4-sampler` parser with every subcommand (the README's commands are checked against it)."""
    from nvfp4_sampler.converters import cli as convert_cli
    from nvfp4_sampler.diagnostics import cli as diagnose_cli

    parser = argparse.ArgumentParser(prog="nvfp4-sampler", description="NVFP4 sampler tools")
    sub = parser.add_subparsers(dest="command", required=True)
    convert_cli.add_parser(sub)
    diagnose_cli.add_parser(sub)
    add_parsers(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Parse `argv` (default sys.argv[1:]) and run the chosen subcommand."""
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
