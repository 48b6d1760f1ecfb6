"""`python -m client health|infer|bench`: a thin command line over the client library."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

import numpy as np

from client import _wire
from client.bench import MODES, random_hidden, run_bench
from client.errors import ClientError
from client.sync import Client
from contract import names
from contract.arguments import DefaultsHelp
from contract.commands import CommandParser

MAX_STEPS = 10_000
MAX_SECONDS = 600.0


def _bounded(kind, low, high):
    def parse(text: str):
        value = kind(text)
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"must be between {low} and {high}, got {text}")
        return value

    return parse


HELP = DefaultsHelp  # every --help shows the defaults


def _parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--url", help="host:port (default 127.0.0.1 and the protocol's port: gRPC 8001, HTTP 8000)")
    common.add_argument("--protocol", choices=_wire.PROTOCOLS, default="grpc", help="(default: %(default)s)")
    common.add_argument("--model", default=names.MODEL, help="the stateless model")
    common.add_argument("--session-model", default=names.SESSION_MODEL, help="the stateful model")
    seconds = _bounded(float, 0.001, 3600)
    common.add_argument("--timeout", type=seconds, default=30.0, help="seconds per call")
    retries = _bounded(int, 0, 20)
    common.add_argument("--retries", type=retries, default=3, help="retries of safe calls")

    parser = argparse.ArgumentParser(prog="python -m client", description=__doc__, formatter_class=HELP)
    commands = parser.add_subparsers(dest="command", required=True, parser_class=CommandParser)
    commands.add_parser(
        "health",
        formatter_class=HELP,
        parents=[common],
        help="server and model readiness, and a one-token request to each model (exit 1 unless both answer)",
    )
    commands.add_parser(
        "info",
        formatter_class=HELP,
        parents=[common],
        help="what each model is: its sizes, limits, engine and KV budget",
    )

    infer = commands.add_parser(
        "infer", formatter_class=HELP, parents=[common], help="send one request and summarize the answer"
    )
    infer.add_argument("--hidden", help="hidden states .npy (default: random)")
    infer.add_argument("--mask", help="attention mask .npy (int64)")
    infer.add_argument("--batch", type=_bounded(int, 1, 1024), default=1, help="rows of random hidden states")
    infer.add_argument("--tokens", type=_bounded(int, 1, 65536), default=8, help="new tokens per row")
    infer.add_argument("--seed", type=int, default=0, help="the random hidden states' seed")
    infer.add_argument("--session", action="store_true", help="one step of a new session instead")

    bench = commands.add_parser("bench", formatter_class=HELP, parents=[common], help="decode-step latency p50/p99")
    bench.add_argument("--mode", choices=MODES, default="session", help="a session's steps, or stateless calls")
    bench.add_argument("--steps", type=_bounded(int, 1, MAX_STEPS), default=64, help="timed decode steps (cap)")
    bench.add_argument("--prompt", type=_bounded(int, 1, 65536), default=16, help="prompt tokens before decoding")
    bench.add_argument("--time-limit", type=_bounded(float, 0.1, MAX_SECONDS), default=30.0, help="seconds (cap)")
    return parser


def _client(args: argparse.Namespace) -> Client:
    url = args.url or f"127.0.0.1:{_wire.DEFAULT_PORTS[args.protocol]}"
    return Client(url, args.protocol, args.model, args.session_model, timeout=args.timeout, retries=args.retries)


def health(client: Client) -> int:
    """Readiness as Triton reports it, then one real token through each model (Triton's flags stay
    green while a model's process is dead): exit 0 only when both answer (container probes use it)."""
    state = client.probe()
    print(f"server {state.url}: live={state.live} ready={state.ready}")
    for model, ready in state.models.items():
        verdict = f"NOT SERVING: {state.failures[model]}" if model in state.failures else "serving"
        print(f"model {model}: {verdict if ready else 'NOT READY'}")
    return 0 if state.ok else 1


def _shown(value) -> str:
    return " ".join(map(str, value)) if isinstance(value, list) else str(value)


def info(client: Client) -> int:
    """Each model's facts as its config publishes them (GET /v1/models answers the same)."""
    for model in (client.model, client.session_model):
        described = client.metadata(model)
        facts = ", ".join(f"{key} {_shown(value)}" for key, value in sorted(described.facts.items()))
        print(f"model {model}: d_model {described.d_model}, dtype {described.float_dtype}; {facts}")
    return 0


def infer(client: Client, args: argparse.Namespace) -> int:
    info = client.metadata(args.session_model if args.session else args.model)
    rng = np.random.default_rng(args.seed)
    if args.hidden:
        hidden = np.load(args.hidden, allow_pickle=False)
    else:
        hidden = random_hidden(rng, 1 if args.session else args.batch, args.tokens, info.d_model, info.float_dtype)
    mask = np.load(args.mask, allow_pickle=False) if args.mask else None
    if args.session:
        with client.session() as session:
            output, present = session.step(hidden, mask), []
    else:
        result = client.infer(hidden, mask)
        output, present = result.output, result.present
    print(f"output {tuple(output.shape)} {output.dtype}: {describe(output)}")
    for layer, (key, value) in enumerate(present):
        print(f"present.{layer}: key {tuple(key.shape)}, value {tuple(value.shape)}")
    return 0


def describe(array: np.ndarray) -> str:
    finite = bool(np.isfinite(array).all())
    return f"mean {array.mean():.4g} std {array.std():.4g} min {array.min():.4g} max {array.max():.4g} finite={finite}"


def bench(client: Client, args: argparse.Namespace) -> int:
    result = run_bench(client, mode=args.mode, steps=args.steps, prompt=args.prompt, time_limit=args.time_limit)
    print(result.summary())
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        with _client(args) as client:
            if args.command == "health":
                return health(client)
            if args.command == "info":
                return info(client)
            if args.command == "infer":
                return infer(client, args)
            return bench(client, args)
    except (ClientError, OSError, ValueError) as error:  # OSError, ValueError: a .npy file that won't load
        print(f"error: {type(error).__name__}: {error}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
