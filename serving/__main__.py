"""`python -m serving`: Triton (and the gateway in front of it) on localhost, in the foreground.

python -m serving FOLDER [--served-model-name NAME]   a Hugging Face checkpoint (built once) or an artifact, served
python -m serving FOLDER FOLDER ...   several, each under its folder's name (the `model` of a request names one)
python -m serving [--model-repository REPO] [--gateway-port 8080] [--host 127.0.0.1]
python -m serving --no-gateway [--model-repository REPO] [--http-port 8000] [--grpc-port 8001] [--metrics-port 8002]
python -m serving --replicas 3     three Triton replicas behind Envoy (on the HTTP and gRPC ports), the gateway on Envoy
python -m serving repository --artifacts DIR --repository REPO     fill a repository from an artifact
python -m serving ensure --repository REPO [--preset|--config|--config-json]   build and fill if it lacks the model
python -m serving envoy-config --dns NAME | --replica IP:HTTP:GRPC ...     the Envoy config in front of N replicas

The default model is exported first when the repository lacks it. Triton is supervised
(serving/host/supervisor.py): a dead server is started again and a model whose process died is reloaded,
each within seconds; the gateway stays up and its /readyz says "not ready" meanwhile. A port that
another process holds is refused before anything starts, naming that process. SIGINT or SIGTERM
shuts everything down gracefully and leaves no process behind.
"""

from __future__ import annotations

import argparse
import contextlib
import secrets
import shutil
import signal
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

from contract import files
from contract.arguments import DefaultsHelp
from contract.commands import CommandParser


class Shutdown(Exception):
    """SIGINT or SIGTERM arrived."""


def triton_arguments(parser: argparse.ArgumentParser) -> None:
    triton = parser.add_argument_group("Triton")
    triton.add_argument(
        "--model-repository",
        type=Path,
        default=files.DEFAULT_REPOSITORY,
        help="the repository to serve (only the default one is filled with the default model when it lacks it)",
    )
    triton.add_argument("--http-port", type=int, default=8000, help="Triton's HTTP port (Envoy's with --replicas)")
    triton.add_argument("--grpc-port", type=int, default=8001, help="Triton's gRPC port (Envoy's with --replicas)")
    triton.add_argument(
        "--metrics-port", type=int, default=8002, help="with --replicas, each replica takes a free port (printed)"
    )
    triton.add_argument(
        "--triton-address", default="127.0.0.1", help="the address Triton listens on (default: %(default)s)"
    )
    triton.add_argument(
        "--log",
        type=Path,
        help="Triton's log file (default: a temporary file, kept on failure); with --replicas, NAME-<i>.EXT each",
    )
    triton.add_argument(
        "--tritonserver", type=Path, help="an installed tritonserver binary (the NGC image's) instead of the wheel's"
    )
    triton.add_argument(
        "--probe-interval", type=float, default=1.0, help="seconds between the supervisor's probes (default: 1)"
    )
    triton.add_argument(
        "--replicas",
        type=positive_int,
        default=1,
        help="Triton processes; more than 1 puts Envoy on the HTTP and gRPC ports in front of them, each on "
        "free ports of its own, and routes each session to the replica holding it (default: 1, no Envoy)",
    )
    triton.add_argument(
        "--ejection-seconds",
        type=positive_float,
        default=15.0,
        help="with --replicas: how long Envoy keeps a replica that answered five errors in a row out of "
        "new work, longer with each ejection (default: 15)",
    )


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number, got {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be more than 0, got {text}")
    return value


def gateway_arguments(parser: argparse.ArgumentParser) -> None:
    gateway = parser.add_argument_group("gateway")
    gateway.add_argument("--no-gateway", action="store_true", help="run Triton alone")
    gateway.add_argument("--gateway-port", type=int, default=8080, help="the gateway's HTTP port")
    gateway.add_argument(
        "--host", help="the address the gateway listens on (default: SERVING_HOST or 127.0.0.1; loopback without keys)"
    )
    gateway.add_argument(
        "--served-model-name",
        help="the model's id on the OpenAI-compatible routes (default: a FOLDER's name, else "
        "SERVING_SERVED_MODEL_NAME)",
    )
    gateway.add_argument(
        "--session-store",
        help="where the gateway's sessions write checkpoints, so that a session whose replica dies goes on: a "
        "directory, a redis:// URL, or none (default: SERVING_SESSION_STORE, else a folder of this run's, removed "
        "at its end)",
    )


def parser() -> argparse.ArgumentParser:
    from serving.host.envoy import cli as envoy_cli
    from serving.triton import cli

    root = argparse.ArgumentParser(
        prog="python -m serving",
        description=__doc__.splitlines()[0],
        formatter_class=DefaultsHelp,
        allow_abbrev=False,  # `ensure --weights DIR` must not be taken as --weights-dtype
    )
    triton_arguments(root)
    gateway_arguments(root)
    commands = root.add_subparsers(dest="command", parser_class=CommandParser)
    cli.add_commands(commands)
    envoy_cli.add_commands(commands)
    return root


def ensure_repository(repository: Path) -> None:
    """The default repository is filled with the default model, and the model trained here beside it, when it
    lacks them; a repository the user named is never filled behind their back: it must hold the served models
    already."""
    from serving.host.launcher import TritonStartError
    from serving.triton.repository import is_complete, lacks, rename_legacy_models

    for line in rename_legacy_models(repository):
        print(line, flush=True)
    if is_complete(repository):
        if repository.resolve() == files.DEFAULT_REPOSITORY.resolve():
            ensure_trained(repository)
        return
    if repository.resolve() != files.DEFAULT_REPOSITORY.resolve():
        what = "; ".join(lacks(repository)) if repository.is_dir() else "no such folder"
        raise TritonStartError(
            f"{repository} does not hold the served models ({what}); fill it with "
            f"`python -m serving ensure --repository {repository} [--preset NAME | --config FILE]` or "
            f"`python -m serving repository --artifacts DIR --repository {repository}`"
        )
    from serving.triton.cli import DEFAULT_ARTIFACTS, BuildFailed, cannot_build, export_default

    reason = cannot_build()
    if reason:  # a serving-only environment (the Triton image) cannot export
        raise TritonStartError(
            f"{repository} lacks the models and this environment cannot build them ({reason}); "
            "fill it first with `python -m serving ensure --repository ...` where the export extra is installed"
        )
    print(f"{repository} lacks the models; exporting the default preset first (about 15 s)", flush=True)
    try:
        export_default(repository, DEFAULT_ARTIFACTS, shown=True)
    except BuildFailed as error:  # a failed variant is left out; serve if the python models got theirs
        print(f"warning: {error}", file=sys.stderr)
        if not is_complete(repository):
            raise TritonStartError(f"the default model could not be built: {error}") from None
    ensure_trained(repository)


def ensure_trained(repository: Path) -> None:
    """The model trained here (models/fortunes) built into the default repository beside the default model
    when it is not there yet; a checkout without it, or an environment that cannot build, serves without it."""
    from serving.triton.cli import BuildFailed, cannot_build, export_trained, has_trained

    if has_trained(repository) or not files.TRAINED_MODEL.is_dir():
        return
    reason = cannot_build()
    if reason:
        print(f"warning: the trained model is not served: this environment cannot build it ({reason})", file=sys.stderr)
        return
    where = files.TRAINED_ARTIFACTS
    print(
        f"{repository} lacks the model trained on fortunes; building it from {files.TRAINED_MODEL} (about a minute)",
        flush=True,  # before the build's own output
    )
    try:
        export_trained(repository, where, shown=True)
    except (BuildFailed, OSError, ValueError) as error:
        print(f"warning: the trained model is not served: {error}", file=sys.stderr)


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
    from serving.host.envoy import EnvoyError
    from serving.host.gateway import GatewayProcessError
    from serving.host.launcher import TritonStartError

    front = None
    with shutdown_signals() as stop:
        try:
            ensure_repository(args.model_repository)
            front = start_front(args)
            for line in [f"repository      {args.model_repository.resolve()}", *front.layout()]:
                print(line, flush=True)
            serve(args, front, stop)
        except Shutdown as received:
            print(f"{received}: shutting down", flush=True)
        except (TritonStartError, GatewayProcessError, EnvoyError) as error:
            print(f"error: {error}", file=sys.stderr)
            return 1
        finally:
            for sig in (signal.SIGINT, signal.SIGTERM):  # a second signal must not cut the shutdown short
                signal.signal(sig, signal.SIG_IGN)
            if front is not None:
                front.stop()
    return 0 if front is None or front.failed is None else 1


def start_front(args: argparse.Namespace):
    """What the gateway and the clients talk to (serving/host/front.py)."""
    from serving.host.front import FrontPorts, TritonOptions, start_front

    options = TritonOptions(
        args.model_repository, args.triton_address, args.log, args.tritonserver, args.probe_interval
    )
    ports = FrontPorts(args.http_port, args.grpc_port, args.metrics_port)
    gateway = (gateway_host(args), args.gateway_port) if not args.no_gateway and args.gateway_port else None
    return start_front(
        options,
        ports,
        args.replicas,
        gateway,
        say=lambda line: print(line, flush=True),
        ejection_s=args.ejection_seconds,
    )


def gateway_host(args: argparse.Namespace) -> str:
    from serving.gateway import Settings

    return Settings(**({"host": args.host} if args.host is not None else {})).bind_host()


def serve(args: argparse.Namespace, front, stop: threading.Event) -> None:
    """Run until a signal arrives or nothing is left to serve; the gateway (unless --no-gateway)
    talks gRPC to the front (Triton, or Envoy), with its other settings
    from SERVING_* variables."""
    if args.no_gateway:
        return watch(front, stop)
    from serving.gateway import Settings, banner
    from serving.gateway.settings import settings_environment
    from serving.host.front import metrics_urls
    from serving.host.gateway import SupervisedGateway
    from serving.host.process import owned_folder

    overrides = {"triton_url": front.grpc_url, "triton_metrics_urls": metrics_urls(front), "port": args.gateway_port}
    given = {"host": args.host, "session_store": args.session_store, "served_model_name": args.served_model_name}
    given["more_served_models"] = getattr(args, "more_served_models", None)
    overrides |= {name: value for name, value in given.items() if value is not None}
    overrides |= trained_model_settings(args.model_repository, Settings(**overrides))
    settings = Settings(**overrides)
    own_store = owned_folder("serving-sessions-") if settings.session_store is None else None
    if own_store is not None:  # a store of this run's unless one is named (or `none`)
        settings = Settings(**overrides, session_store=str(own_store))
    try:
        settings, url = lasting_settings(settings)
        gateway = SupervisedGateway(settings_environment(settings), url)
        try:
            print(banner(settings, url), flush=True)
            watch(front, stop, gateway)
        finally:
            gateway.stop()
    finally:
        if own_store:
            shutil.rmtree(own_store, ignore_errors=True)


def lasting_settings(settings) -> tuple:
    """`settings` with what every gateway of the run must share fixed now (the port, a session secret: the
    next gateway honours the session ids of one that died), and the gateway's URL."""
    from pydantic import SecretStr

    from serving.host.launcher import free_port

    chosen = {
        "session_secret": settings.session_secret or SecretStr(secrets.token_urlsafe(32)),
        "port": settings.port or free_port(settings.bind_host()),
    }
    settings = settings.model_copy(update=chosen)
    return settings, f"http://{settings.bind_host()}:{settings.port}"


def trained_model_settings(repository: Path, settings) -> dict:
    """A repository that holds the trained model beside the default one: the OpenAI-compatible routes serve it
    (as `fortunes`), unless SERVING_GENERATE_MODEL or SERVING_SERVED_MODEL_NAME say otherwise."""
    from serving.triton.cli import has_trained, trained_model

    if not has_trained(repository):
        return {}
    chosen = {"generate_model": trained_model(), "served_model_name": files.TRAINED_MODEL_NAME}
    return {name: value for name, value in chosen.items() if name not in settings.model_fields_set}


def watch(front, stop: threading.Event, *more) -> None:
    from serving.host.front import watch

    watch(front, stop, lambda line: print(line, file=sys.stderr, flush=True), *more)


def serve_folders(args: argparse.Namespace, folders: list[Path]) -> int:
    """`python -m serving FOLDER [FOLDER ...]`: each a checkpoint built into its artifacts once (by the digest of
    its files) or an artifact folder `python -m export build` wrote, served from one repository under the
    folder's name (the first under --served-model-name when given, alone)."""
    from serving.triton.cli import served_folders_repository

    names = [args.served_model_name or folders[0].resolve().name, *(folder.resolve().name for folder in folders[1:])]
    if len(folders) > 1 and args.served_model_name:
        print("error: --served-model-name names one FOLDER's model; several are served by their names", file=sys.stderr)
        return 2
    twins = sorted({name for name in names if names.count(name) > 1})
    if twins:
        print(f"error: two FOLDERs are named {', '.join(twins)}: the model ids would clash", file=sys.stderr)
        return 2
    served = []
    for folder, name in zip(folders, names, strict=True):
        artifacts = built_folder(folder)
        if artifacts is None:
            return 1
        served.append((artifacts, name))
    args.model_repository, more = served_folders_repository(served)
    args.served_model_name = names[0]
    args.more_served_models = more
    return run(args)


def built_folder(folder: Path) -> Path | None:
    """A FOLDER's artifacts: itself when `python -m export build` wrote it, else its build (made once); None
    once the reason it cannot be served is printed."""
    if not (folder / "config.json").is_file():
        print(f"error: {folder} holds no config.json: expected a Hugging Face checkpoint folder", file=sys.stderr)
        return None
    if (folder / files.REPORT_FILENAME).is_file():  # an artifact `export build` wrote, not a checkpoint
        return folder
    from serving.triton.cli import BuildFailed, export_folder, folder_artifacts

    print(f"{folder}: building it (once: later runs reuse the build while the folder is unchanged)", flush=True)
    try:
        return export_folder(folder, shown=True, artifacts=folder_artifacts(folder))  # the folder's digest read once
    except (BuildFailed, OSError, ValueError) as error:
        print(f"error: {folder} could not be built: {error}", file=sys.stderr)
        return None


def main(argv: list[str] | None = None) -> int:
    from serving.host.envoy import cli as envoy_cli
    from serving.triton import cli

    commands = {None: run, "repository": cli.run_repository, "ensure": cli.run_ensure, envoy_cli.COMMAND: envoy_cli.run}
    argv = sys.argv[1:] if argv is None else list(argv)
    folders = []
    while argv and not argv[0].startswith("-") and Path(argv[0]).is_dir():  # checkpoint folders, not a command
        folders.append(Path(argv.pop(0)))
    if folders:
        command = next((word for word in argv if word in commands), None)
        if command is not None:
            print(f"error: a FOLDER is served on its own, not with `{command}`", file=sys.stderr)
            return 2
        return serve_folders(parser().parse_args(argv), folders)
    args = parser().parse_args(argv)
    return commands[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
