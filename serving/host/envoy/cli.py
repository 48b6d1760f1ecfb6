"""`python -m serving envoy-config`: the Envoy config in front of N Triton replicas, printed or written.

python -m serving envoy-config --dns triton.NS.svc.cluster.local [--health-port 8081] [--out envoy.yaml]
python -m serving envoy-config --replica 10.0.0.5:8000:8001 --replica 10.0.0.6:8000:8001 --endpoints DIR

With --dns, every address the name resolves to is a replica (a Kubernetes headless Service). With
--replica (HOST:HTTP_PORT:GRPC_PORT, an IP address), the replicas are written to files under
--endpoints that Envoy watches: rewrite them (serving.envoy.config.write_endpoints) to add, drain or
remove a replica without restarting Envoy. The config starts with a comment naming the command that
made it, which regenerates it.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from contract.arguments import DefaultsHelp
from serving.host.envoy.config import DnsName, EndpointFiles, ProxySettings, Replica, bootstrap, render, write_endpoints

COMMAND = "envoy-config"
DO_NOT_EDIT = "Do not edit: change the command or serving/host/envoy/config.py, then run it."


def add_commands(commands) -> None:
    _arguments(
        commands.add_parser(
            COMMAND, formatter_class=DefaultsHelp, help="print or write the Envoy config in front of N Triton replicas"
        )
    )


def _arguments(e: argparse.ArgumentParser) -> None:
    defaults = ProxySettings()
    upstreams = e.add_mutually_exclusive_group(required=True)
    upstreams.add_argument("--dns", help="a name resolving to every replica (STRICT_DNS)")
    upstreams.add_argument("--replica", type=_replica, action="append", help="HOST:HTTP_PORT:GRPC_PORT, repeatable")
    e.add_argument("--endpoints", type=Path, help="with --replica: the directory of the replica files Envoy watches")
    e.add_argument("--triton-http-port", type=int, default=8000, help="with --dns: the replicas' HTTP port")
    e.add_argument("--triton-grpc-port", type=int, default=8001, help="with --dns: the replicas' gRPC port")
    e.add_argument("--http-port", type=int, default=defaults.http_port, help="Envoy's HTTP listener")
    e.add_argument("--grpc-port", type=int, default=defaults.grpc_port, help="Envoy's gRPC listener")
    e.add_argument("--listen-address", default=defaults.listen_address)
    e.add_argument(
        "--admin-socket",
        default=defaults.admin_socket,
        help="the admin API on this unix socket, mode 0600 (default: none)",
    )
    e.add_argument("--health-port", type=int, help="a listener answering /ready (Kubernetes probes)")
    e.add_argument("--access-log", default=defaults.access_log, help="a file, or /dev/stdout")
    e.add_argument("--request-timeout", type=float, default=defaults.request_timeout_s, help="seconds")
    e.add_argument("--out", type=Path, help="write here instead of printing")


def _replica(text: str) -> Replica:
    try:
        host, http_port, grpc_port = text.rsplit(":", 2)
        return Replica(host, int(http_port), int(grpc_port))
    except ValueError as error:
        raise argparse.ArgumentTypeError(f"{text!r} is not IP:HTTP_PORT:GRPC_PORT ({error})") from None


def settings_from(args: argparse.Namespace) -> ProxySettings:
    return ProxySettings(
        http_port=args.http_port,
        grpc_port=args.grpc_port,
        listen_address=args.listen_address,
        admin_socket=args.admin_socket,
        health_port=args.health_port,
        access_log=args.access_log,
        request_timeout_s=args.request_timeout,
    )


# the options after the upstreams, in the order the command line names them
_OPTIONS = (
    "endpoints",
    "triton_http_port",
    "triton_grpc_port",
    "http_port",
    "grpc_port",
    "listen_address",
    "admin_socket",
    "health_port",
    "access_log",
    "request_timeout",
)


def command_line(args: argparse.Namespace) -> str:
    """The command that makes this config: options in a fixed order, defaults left out, no --out."""
    defaults = argparse.ArgumentParser()
    _arguments(defaults)
    parts = ["python -m serving", COMMAND]
    if args.dns:
        parts += ["--dns", args.dns]
    for replica in args.replica or ():
        parts += ["--replica", f"{replica.host}:{replica.http_port}:{replica.grpc_port}"]
    for name in _OPTIONS:
        value = getattr(args, name)
        if value != defaults.get_default(name):
            parts += [f"--{name.replace('_', '-')}", f"{value:g}" if isinstance(value, float) else str(value)]
    return " ".join(parts)


def run(args: argparse.Namespace) -> int:
    try:
        text = config_text(args)
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    if args.out is None:
        sys.stdout.write(text)
    else:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)
        print(f"Envoy config: {args.out}")
    return 0


def config_text(args: argparse.Namespace) -> str:
    """The config's YAML, headed by the command that made it; with --replica, the replica files too."""
    settings = settings_from(args)
    if args.dns:
        if args.endpoints is not None:
            raise ValueError("--endpoints goes with --replica; with --dns the replicas come from DNS")
        upstreams = DnsName(args.dns, http_port=args.triton_http_port, grpc_port=args.triton_grpc_port)
    elif args.endpoints is None:
        raise ValueError("--replica needs --endpoints, the directory of the replica files Envoy watches")
    else:
        upstreams = EndpointFiles(args.endpoints.resolve())
        write_endpoints(upstreams.directory, args.replica)
    header = f"Generated by `{command_line(args)}`.\n{DO_NOT_EDIT}"
    return render(bootstrap(upstreams, settings), header)
