"""Property-based tests of the gateway against its own OpenAPI document (schemathesis): fifty and more
generated requests per operation and mode, valid and invalid, over real HTTP to a gateway in front of the
real Triton. None may get a 5xx, and every answer must be one the document declares, with the
declared content type and body schema."""

from __future__ import annotations

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    negative_data_rejection,
    response_schema_conformance,
    status_code_conformance,
)

from serving.gateway import Settings, create_app
from tests.gateway.conftest import running

KEY = "fuzz-key"
# per operation and generation mode: 50 reach every route and status that 200 did (the table in
# test_the_fuzzing_reached_every_route_and_status; generation is deterministic), in a quarter of the time
EXAMPLES = 50
SPEC = create_app(Settings(api_keys=(KEY,))).openapi()
schema = schemathesis.openapi.from_dict(SPEC)
schema.config.generation.update(modes=["positive", "negative"], max_examples=EXAMPLES, deterministic=True)
CHECKS = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_schema_conformance,
    negative_data_rejection,
]


@pytest.fixture(scope="module")
def fuzzed(triton):
    """A gateway of its own: the fuzzer opens sessions up to the limit, which must not touch other tests."""
    with running(api_keys=(KEY,), triton_url=triton.grpc_url, sessions_per_key=4) as gateway:
        yield gateway


def test_the_served_document_is_the_one_fuzzed(fuzzed):
    assert httpx.get(f"{fuzzed.url}/openapi.json").json() == SPEC


@schema.parametrize()
@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck), database=None)
def test_generated_requests_get_declared_answers_and_no_5xx(case, fuzzed):
    response = case.call(base_url=fuzzed.url, headers={"X-API-Key": KEY}, timeout=30)
    case.validate_response(response, checks=CHECKS)


# what the generated requests reached, per route (measured with 200 examples; 100 reach all of it): past
# auth into validation, the shape checks and the session store, not only 401s; 405 for another method
REACHED = {
    "/v1/attend": (400, 401, 405, 422),
    "/v1/inspect": (400, 401, 405, 422),
    "/v1/models": (200, 401, 405),
    "/v1/models/{model}": (401, 404, 405),
    "/v1/sessions": (201, 400, 401, 404, 405, 422, 429),
    "/v1/sessions/{session_id}": (401, 404, 405),
    "/v1/sessions/{session_id}/step": (401, 404, 405, 422),
    "/v1/sessions/{session_id}/fork": (401, 404, 405),
    "/v1/sessions/{session_id}/snapshot": (401, 404, 405),
    "/v1/sessions/{session_id}/rewind": (400, 401, 404, 405, 422),
    "/v1/generate": (400, 401, 405, 422),
    "/v1/sessions/{session_id}/generate": (401, 404, 405, 422),
    "/v1/completions": (400, 401, 404, 405),
    "/v1/chat/completions": (400, 401, 404, 405),
    "/v1/responses": (400, 401, 404, 405),
    "/v1/responses/{response_id}": (401, 404, 405),
    "/v1/prefixes": (200, 401, 405),
    "/v1/prefixes/{name}": (400, 401, 404, 405, 422),
    "/healthz": (200, 405),
    "/readyz": (200, 405),
    "/metrics": (200, 405),
}

# the metrics' route label is the route's own path, converters included (a model id may hold a slash)
LABELS = {"/v1/models/{model}": "/v1/models/{model:path}"}


def test_the_fuzzing_reached_every_route_and_status(fuzzed):
    """Runs after the fuzzing (file order): every operation was called, and every status the
    generated requests reached with twice the examples was reached again."""
    counts = httpx.get(f"{fuzzed.url}/metrics").text
    assert set(SPEC["paths"]) == set(REACHED)  # every route the document declares
    for route, statuses in REACHED.items():
        label = LABELS.get(route, route)
        for status in statuses:
            assert f'route="{label}",status="{status}"' in counts, (route, status)
    assert 'status="5' not in counts
