"""The gateway's small doors (issue 34, items 2 and 7), against a real gateway and the session's real Triton:
a snapshot is restored whatever the case and parameters of its media type, and a restore body of another type
is a 415 instead of an empty session; a rewind past int64 is a 400 naming the field and the bound, not a 500;
the /inspect page and its files are served with a Content-Security-Policy the page keeps to, no framing and
no sniffing."""

from __future__ import annotations

from collections.abc import Iterator
from html.parser import HTMLParser

import httpx
import numpy as np
import pytest

from tests.gateway.conftest import running

KEY = "edges-key"
SNAPSHOT = "application/octet-stream"


@pytest.fixture(scope="module")
def api(triton) -> Iterator[httpx.Client]:
    with (
        running(api_keys=(KEY,), triton_url=triton.grpc_url) as gateway,
        httpx.Client(base_url=gateway.url, headers={"X-API-Key": KEY}, timeout=60) as client,
    ):
        yield client


def step(api: httpx.Client, session: str, tokens: int, d_model: int) -> dict:
    states = np.random.default_rng(tokens).standard_normal((1, tokens, d_model)).astype(np.float32)
    answer = api.post(f"/v1/sessions/{session}/step", json={"hidden_states": states.tolist()})
    assert answer.status_code == 200, answer.text
    return answer.json()


def assert_error(answer: httpx.Response, status: int, code: str, *fragments: str) -> str:
    assert answer.status_code == status, answer.text
    error = answer.json()["error"]
    assert error["code"] == code, error
    for fragment in fragments:
        assert fragment in error["message"], error["message"]
    return error["message"]


@pytest.fixture(scope="module")
def snapshot(api, served_cfg) -> bytes:
    """A snapshot of a session holding 5 positions."""
    session = api.post("/v1/sessions").json()["id"]
    step(api, session, 5, served_cfg.d_model)
    blob = api.get(f"/v1/sessions/{session}/snapshot")
    assert blob.status_code == 200, blob.text
    api.delete(f"/v1/sessions/{session}")
    return blob.content


def test_a_snapshot_restores_whatever_the_case_and_parameters_of_its_media_type(api, snapshot, served_cfg):
    restored = api.post("/v1/sessions", content=snapshot, headers={"Content-Type": "Application/Octet-Stream; foo=bar"})
    assert restored.status_code == 201, restored.text
    session = restored.json()["id"]
    assert step(api, session, 1, served_cfg.d_model)["length"] == 6  # the 5 restored positions and this one
    api.delete(f"/v1/sessions/{session}")


@pytest.mark.parametrize("content_type", ["text/plain", None])
def test_a_restore_body_of_another_type_is_415_not_an_empty_session(api, snapshot, content_type):
    headers = {"Content-Type": content_type} if content_type else {}
    request = api.build_request("POST", "/v1/sessions", content=snapshot, headers=headers)
    if content_type is None:
        request.headers.pop("Content-Type", None)  # the case is no type at all, whatever httpx would add
    answer = api.send(request)
    assert_error(answer, 415, "unsupported_media_type", SNAPSHOT, "application/json", repr(content_type or "none"))
    assert answer.json()["error"]["type"] == "invalid_request_error"


def test_json_opens_stay_as_they_were(api):
    for body in ({}, {"prefix": None}):
        opened = api.post("/v1/sessions", json=body)
        assert opened.status_code == 201, opened.text
        api.delete(f"/v1/sessions/{opened.json()['id']}")
    assert_error(api.post("/v1/sessions", json={"prefix": "never-put"}), 404, "prefix_not_found", "never-put")
    assert_error(api.post("/v1/sessions", json={"nope": 1}), 422, "validation_error", "nope")


def test_a_rewind_past_int64_is_400_naming_the_field_and_the_bound(api, served_cfg):
    session = api.post("/v1/sessions").json()["id"]
    step(api, session, 3, served_cfg.d_model)
    for length in (2**63, 2**64 + 5, 10**30):
        answer = api.post(f"/v1/sessions/{session}/rewind", json={"length": length})
        assert_error(answer, 400, "invalid_input", "body.length", "2**63", str(length))
        assert answer.json()["error"]["param"] == "length"
    assert step(api, session, 1, served_cfg.d_model)["length"] == 4  # the refused rewinds changed nothing
    api.delete(f"/v1/sessions/{session}")


class InlineCode(HTMLParser):
    """What a `default-src 'self'` policy would block in a page: inline scripts, <style> elements, style
    attributes and event-handler attributes."""

    def __init__(self) -> None:
        super().__init__()
        self.blocked: list[str] = []
        self._in_script = False

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        names = [name for name, _ in attrs]
        self._in_script = tag == "script"
        if tag == "script" and "src" not in names:
            self.blocked.append("<script> without src")
        if tag == "style":
            self.blocked.append("<style>")
        self.blocked += [f"<{tag} {name}=...>" for name in names if name == "style" or name.startswith("on")]

    def handle_data(self, data: str) -> None:
        if self._in_script and data.strip():
            self.blocked.append(f"inline script {data.strip()[:40]!r}")

    def handle_endtag(self, tag: str) -> None:
        self._in_script = False


@pytest.mark.parametrize("path", ["/inspect", "/inspect-assets/inspect.js", "/inspect-assets/inspect.css"])
def test_the_inspect_page_and_its_files_carry_a_policy_that_forbids_inline_code_and_framing(api, path):
    answer = api.get(path)
    assert answer.status_code == 200, answer.text
    policy = {
        directive.split()[0]: directive.split()[1:]
        for directive in answer.headers["content-security-policy"].split(";")
    }
    assert policy["default-src"] == ["'self'"] and "script-src" not in policy and "style-src" not in policy
    assert policy["frame-ancestors"] == ["'none'"]
    assert answer.headers["x-frame-options"] == "DENY"
    assert answer.headers["x-content-type-options"] == "nosniff"
    if path == "/inspect":
        parser = InlineCode()
        parser.feed(answer.text)
        assert parser.blocked == [], parser.blocked
    if path.endswith(".js"):  # markup the script writes is held to the same policy
        assert "style=" not in answer.text and 'setAttribute("style"' not in answer.text
