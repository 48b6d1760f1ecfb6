"""`python -m serving`: Triton (and the gateway in front of it) on localhost, in the foreground.

python -m serving [--model-repository REPO] [--gateway-port 8080] [--host 127.0.0.1]
python -m serving --no-gateway [--model-repository REPO] [--http-port 8000] [--grpc-port 8001] [--metrics-port 8002]
python -m serving repository --artifacts DIR --repository REPO     fill a repository from an artifact
python -m serving ensure --repository REPO [--preset|--config|--config-json]   build and fill if it lacks the model

The default model is exported first when the repository lacks it. SIGINT or SIGTERM shuts
everything down gracefully and leaves no process behind.
"""

from __future__ import annotations

import argparse
import contextlib
import signal
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

PROJECT_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_REPOSITORY = PROJECT_ROOT / "model_repository"


class Shutdown(Exception):
    """SIGINT or SIGTERM arrived."""


def triton_arguments(parser: argparse.ArgumentParser) -> None:
    triton = parser.add_argument_group("Triton")
    triton.add_argument("--model-repository", type=Path, default=DEFAULT_REPOSITORY, help="default: %(default)s")
    triton.add_argument("--http-port", type=int, default=8000)
    triton.add_argument("--grpc-port", type=int, default=8001)
    triton.add_argument("--metrics-port", type=int, default=8002)
    triton.add_argument("--log", type=Path, help="Triton's log file (default: a temporary file, kept on failure)")


def gateway_arguments(parser: argparse.ArgumentParser) -> None:
    gateway = parser.add_argument_group("gateway")
    gateway.add_argument("--no-gateway", action="store_true", help="run Triton alone")
    gateway.add_argument("--gateway-port", type=int, default=8080)
    gateway.add_argument(
        "--host", help="the address the gateway listens on (default: SERVING_HOST or 127.0.0.1; loopback without keys)"
    )


def parser() -> argparse.ArgumentParser:
    from serving.triton import cli

    root = argparse.ArgumentParser(prog="python -m serving", description=__doc__.splitlines()[0])
    triton_arguments(root)
    gateway_arguments(root)
    cli.add_commands(root.add_subparsers(dest="command"))
    return root


def ensure_repository(repository: Path) -> None:
    """Export the default model into `repository` unless it already holds the served models."""
    from serving.triton.repository import is_complete

    if is_complete(repository):
        return
    print(f"{repository} lacks the models; exporting the default preset first (about a minute)", flush=True)
    from export.build import BuildError
    from serving.triton.cli import export_default

    try:
        export_default(repository)
    except BuildError as error:  # a failed variant is left out; serve if the python models got theirs
        print(f"warning: {error}", file=sys.stderr)
        if not is_complete(repository):
            raise


@contextlib.contextmanager
def shutdown_signals() -> Iterator[threading.Event]:
    """SIGINT/SIGTERM raise Shutdown once (to interrupt a start in progress) and set the event."""
    stop = threading.Event()

    def handle(signum: int, frame: object) -> None:
        if not stop.is_set():
            stop.set()
            raise Shutdown(signal.Signals(signum).name)

    previous = {sig: signal.signal(sig, handle) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield stop
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def run(args: argparse.Namespace) -> int:
    from serving.gateway.server import GatewayStartError
    from serving.launcher import TritonStartError, start_triton

    ensure_repository(args.model_repository)
    server = None
    with shutdown_signals() as stop:
        try:
            server = start_triton(
                args.model_repository,
                http_port=args.http_port,
                grpc_port=args.grpc_port,
                metrics_port=args.metrics_port,
                log_path=args.log,
            )
            print_urls(server)
            serve(args, server, stop)
        except Shutdown as received:
            print(f"{received}: shutting down", flush=True)
        except (TritonStartError, GatewayStartError) as error:
            print(f"error: {error}", file=sys.stderr)
            return 1
        finally:
            for sig in (signal.SIGINT, signal.SIGTERM):  # a second signal must not cut the shutdown short
                signal.signal(sig, signal.SIG_IGN)
            if server is not None:
                server.stop()
    return 0 if server is None or stop.is_set() or server.process.returncode == 0 else 1


def print_urls(server) -> None:
    print(f"Triton HTTP     http://{server.http_url}", flush=True)
    print(f"Triton gRPC     {server.grpc_url}", flush=True)
    print(f"Triton metrics  {server.metrics_url}", flush=True)
    print(f"models          {', '.join(server.models)}", flush=True)


def serve(args: argparse.Namespace, server, stop: threading.Event) -> None:
    """Run until a signal arrives or Triton exits on its own; the gateway (unless --no-gateway)
    talks to this Triton over gRPC, with its other settings from SERVING_* variables."""
    if args.no_gateway:
        return watch(server, stop)
    from serving.gateway import Settings, banner, run_gateway

    overrides = {"triton_url": server.grpc_url, "port": args.gateway_port}
    if args.host is not None:
        overrides["host"] = args.host
    gateway = run_gateway(Settings(**overrides))
    try:
        print(banner(gateway), flush=True)
        watch(server, stop)
    finally:
        gateway.stop()


def watch(server, stop: threading.Event) -> None:
    while not stop.wait(0.5):
        if not server.is_running():
            print(f"tritonserver exited with {server.process.returncode}; its log: {server.log_path}", file=sys.stderr)
            return


def main(argv: list[str] | None = None) -> int:
    from serving.triton import cli

    args = parser().parse_args(argv)
    commands = {None: run, "repository": cli.run_repository, "ensure": cli.run_ensure}
    return commands[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
