"""The generated Envoy config: what it routes where, checked in the dict, and the whole of it checked
by the real Envoy (`envoy --mode validate`); the process wrapper's start, coexistence and failure;
`python -m serving envoy-config`. No Triton here."""

from __future__ import annotations

import socket
import urllib.error
import urllib.request

import pytest
import yaml

from contract.routing import REPLICA_HEADER, SESSION_HEADER
from serving import __main__ as serving_cli
from serving.host.envoy import (
    DnsName,
    EndpointFiles,
    EnvoyConfigError,
    EnvoyStartError,
    ProxySettings,
    Replica,
    bootstrap,
    render,
    start_envoy,
    validate,
    write_endpoints,
)
from serving.host.envoy.config import HEALTH_PATH, OVERRIDE_HOST_STATUSES, endpoints, endpoints_path
from serving.host.launcher import free_port

REPLICAS = [Replica("10.0.0.5"), Replica("10.0.0.6", 9000, 9001, draining=True)]


@pytest.fixture
def eds_config(tmp_path):
    write_endpoints(tmp_path / "endpoints", REPLICAS)
    return bootstrap(EndpointFiles(tmp_path / "endpoints"), ProxySettings(health_port=8081))


def _clusters(config) -> dict:
    return {cluster["name"]: cluster for cluster in config["static_resources"]["clusters"]}


def _manager(config, listener: str) -> dict:
    (found,) = (item for item in config["static_resources"]["listeners"] if item["name"] == listener)
    return found["filter_chains"][0]["filters"][0]["typed_config"]


def test_envoy_accepts_both_forms_of_the_config(eds_config):
    validate(eds_config)
    validate(render(bootstrap(DnsName("triton.attention-serving.svc.cluster.local"))))


def test_validate_names_what_envoy_rejects(eds_config):
    eds_config["static_resources"]["clusters"][0]["lb_policy"] = "NO_SUCH_POLICY"
    with pytest.raises(EnvoyConfigError, match="NO_SUCH_POLICY"):
        validate(eds_config)


@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_steps_of_a_session_are_pinned_and_its_start_hashed(eds_config, protocol):
    routes = _manager(eds_config, f"triton_{protocol}")["route_config"]["virtual_hosts"][0]["routes"]
    by_name = {route["name"]: route for route in routes}
    assert [route["name"] for route in routes] == ["pinned_step", "session_start", "stateless"]
    assert by_name["pinned_step"]["match"]["headers"] == [{"name": REPLICA_HEADER, "present_match": True}]
    assert by_name["session_start"]["match"]["headers"] == [{"name": SESSION_HEADER, "present_match": True}]
    for name in ("pinned_step", "session_start"):
        assert by_name[name]["route"]["cluster"] == f"triton_{protocol}_sessions"
        assert by_name[name]["route"]["hash_policy"] == [{"header": {"header_name": SESSION_HEADER}}]
    assert "retry_policy" not in by_name["pinned_step"]["route"]  # a step may have run: never twice
    assert by_name["stateless"]["route"]["cluster"] == f"triton_{protocol}"
    clusters = _clusters(eds_config)
    assert clusters[f"triton_{protocol}_sessions"]["lb_policy"] == "MAGLEV"
    assert clusters[f"triton_{protocol}"]["lb_policy"] == "LEAST_REQUEST"


def test_the_stateful_session_filter_is_strict_and_off_for_stateless_calls(eds_config):
    manager = _manager(eds_config, "triton_grpc")
    session = manager["http_filters"][0]["typed_config"]
    assert session["strict"] is True
    assert session["session_state"]["typed_config"]["name"] == REPLICA_HEADER
    stateless = manager["route_config"]["virtual_hosts"][0]["routes"][-1]
    assert next(iter(stateless["typed_per_filter_config"].values()))["disabled"] is True
    for cluster in _clusters(eds_config).values():
        assert cluster["common_lb_config"]["override_host_status"]["statuses"] == list(OVERRIDE_HOST_STATUSES)
        assert cluster["common_lb_config"]["healthy_panic_threshold"] == {"value": 0}
        assert cluster["ignore_health_on_host_removal"] is True


def test_grpc_goes_upstream_as_h2_and_every_replica_is_checked_on_its_http_port(eds_config, tmp_path):
    clusters = _clusters(eds_config)
    options = "envoy.extensions.upstreams.http.v3.HttpProtocolOptions"
    assert (
        "http2_protocol_options"
        in clusters["triton_grpc"]["typed_extension_protocol_options"][options]["explicit_http_config"]
    )
    assert (
        "http_protocol_options"
        in clusters["triton_http"]["typed_extension_protocol_options"][options]["explicit_http_config"]
    )
    for cluster in clusters.values():
        (check,) = cluster["health_checks"]
        assert check["http_health_check"] == {"path": HEALTH_PATH, "codec_client_type": "HTTP1"}
        assert check["no_traffic_interval"] == check["interval"]
        assert cluster["outlier_detection"]["consecutive_5xx"] > 0
        assert cluster["outlier_detection"]["base_ejection_time"] == "15s"  # users' default
        assert cluster["outlier_detection"]["interval"] == "5s"
    short = bootstrap(EndpointFiles(tmp_path / "endpoints"), ProxySettings(ejection_s=1, ejection_check_s=0.5))
    for cluster in _clusters(short).values():
        assert cluster["outlier_detection"]["base_ejection_time"] == "1s"
        assert cluster["outlier_detection"]["interval"] == "0.5s"
    with pytest.raises(ValueError, match="positive"):
        ProxySettings(ejection_s=0)
    grpc_file = yaml.safe_load(endpoints_path(tmp_path / "endpoints", "grpc").read_text())
    hosts = grpc_file["resources"][0]["endpoints"][0]["lb_endpoints"]
    assert [h["endpoint"]["address"]["socket_address"]["port_value"] for h in hosts] == [8001, 9001]
    assert [h["endpoint"]["health_check_config"]["port_value"] for h in hosts] == [8000, 9000]
    assert [h.get("health_status") for h in hosts] == [None, "DRAINING"]


def test_the_access_log_says_which_replica_served_which_session(eds_config):
    (log,) = _manager(eds_config, "triton_http")["access_log"]
    fields = log["typed_config"]["log_format"]["json_format"]
    assert fields["upstream_host"] == "%UPSTREAM_HOST%"
    assert fields["session_id"] == f"%REQ({SESSION_HEADER})%"
    assert {"response_code", "grpc_status", "duration_ms", "response_flags"} <= set(fields)


def test_a_lost_session_gets_a_tagged_error_in_each_protocol(eds_config):
    for protocol in ("grpc", "http"):
        (mapper,) = _manager(eds_config, f"triton_{protocol}")["local_reply_config"]["mappers"]
        header, flags = mapper["filter"]["and_filter"]["filters"]
        assert header["header_filter"]["header"]["name"] == REPLICA_HEADER
        assert "UH" in flags["response_flag_filter"]["flags"]
        body = str(mapper["body_format_override"])
        assert "[sequence_lost]" in body and (("json_format" in body) == (protocol == "http"))


def test_replicas_are_ip_addresses_and_endpoint_files_are_replaced_whole(tmp_path):
    with pytest.raises(ValueError, match=r"does not appear to be an IPv4 or IPv6 address"):
        Replica("triton-0")
    with pytest.raises(ValueError, match="ports"):
        Replica("10.0.0.5", 0, 8001)
    write_endpoints(tmp_path, REPLICAS, version="7")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["triton_grpc.yaml", "triton_http.yaml"]
    assert yaml.safe_load(endpoints_path(tmp_path, "http").read_text()) == endpoints("http", REPLICAS, "7")


def test_several_envoys_run_side_by_side_and_stop_clean():
    first, second = start_envoy([]), start_envoy([])
    try:
        assert len({first.grpc_port, first.http_port, second.grpc_port, second.http_port}) == 4
        assert first.admin_url != second.admin_url
        assert first.hosts("triton_grpc_sessions") == {}
    finally:
        work_dirs = [first.work_dir, second.work_dir]
        assert (first.stop(), second.stop()) == (0, 0)
    assert not any(path.exists() for path in work_dirs)


def test_an_envoy_that_cannot_start_says_why():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        settings = ProxySettings(http_port=port, grpc_port=0, listen_address="127.0.0.1")
        with pytest.raises(EnvoyStartError, match=r"(?s)envoy exited with 1.*Address already in use"):
            start_envoy([], settings, ready_timeout=20)


def test_the_cli_prints_a_config_headed_by_the_command_that_makes_it(capsys, tmp_path):
    argv = ["envoy-config", "--dns", "triton.ns.svc.cluster.local", "--health-port", "8081", "--request-timeout", "60"]
    assert serving_cli.main(argv) == 0
    text = capsys.readouterr().out
    first_line = text.splitlines()[0]
    assert first_line == f"# Generated by `python -m serving {' '.join(argv)}`."
    validate(text)
    assert serving_cli.main([*argv, "--out", str(tmp_path / "envoy.yaml")]) == 0
    assert (tmp_path / "envoy.yaml").read_text() == text


def test_the_cli_writes_the_replica_files_it_names(capsys, tmp_path):
    argv = ["envoy-config", "--replica", "127.0.0.1:8000:8001", "--endpoints", str(tmp_path / "eds")]
    assert serving_cli.main(argv) == 0
    validate(capsys.readouterr().out)
    assert endpoints_path(tmp_path / "eds", "grpc").is_file()
    assert serving_cli.main(["envoy-config", "--replica", "127.0.0.1:8000:8001"]) == 2
    assert "--replica needs --endpoints" in capsys.readouterr().err


def test_the_health_listener_answers_ready_until_envoy_is_told_to_fail():
    port = free_port()
    envoy = start_envoy([], ProxySettings(http_port=0, grpc_port=0, listen_address="127.0.0.1", health_port=port))
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/ready", timeout=5) as answer:
            assert answer.status == 200
        with pytest.raises(urllib.error.HTTPError, match="404"):
            urllib.request.urlopen(f"http://127.0.0.1:{port}/v2/health/ready", timeout=5)
        envoy.admin("/healthcheck/fail", method="POST")
        with pytest.raises(urllib.error.HTTPError, match="503"):
            urllib.request.urlopen(f"http://127.0.0.1:{port}/ready", timeout=5)
    finally:
        envoy.stop()


def test_python_m_serving_takes_how_long_an_outlier_is_ejected():
    from serving.__main__ import parser
    from serving.host.front import FrontPorts, proxy_settings

    ports = FrontPorts(http=8000, grpc=8001, metrics=8002)
    default = parser().parse_args([]).ejection_seconds
    assert proxy_settings(ports, "127.0.0.1", default) == ProxySettings(listen_address="127.0.0.1")
    short = proxy_settings(ports, "127.0.0.1", parser().parse_args(["--ejection-seconds", "1"]).ejection_seconds)
    assert (short.ejection_s, short.ejection_check_s) == (1.0, 1.0)
    for bad in ("soon", "0"):
        with pytest.raises(SystemExit):
            parser().parse_args(["--ejection-seconds", bad])
