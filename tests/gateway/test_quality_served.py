"""The quality ladder's served rung (issue 33, item 4): the held-out ids' bits per byte measured through a real
Triton and the gateway's `POST /v1/completions` (a prompt of token ids, `echo` with `logprobs`, no new tokens)
equal the PyTorch original's on the same ids within 0.1%, the fp32 served form's bound.

The artifact is one fixture, `trained_artifact`: a whole model built by `python -m export build` from a
checkpoint folder with a held_out.txt, which the build copies beside the graphs (export/quality.py)."""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from contract import files
from export import quality
from export.artifacts import load_model
from tests.export.test_quality import whole_window_nats
from tests.gateway.conftest import FORTUNES_KEY, FORTUNES_MODEL

pytestmark = pytest.mark.served

MODEL_ID = FORTUNES_MODEL


@pytest.fixture(scope="module")
def completions(fortunes_served) -> Iterator[httpx.Client]:
    """An HTTP client of the gateway in front of the Triton serving `trained_artifact`."""
    headers = {"Authorization": f"Bearer {FORTUNES_KEY}"}
    with httpx.Client(base_url=fortunes_served.gateway.url, headers=headers, timeout=120) as api:
        yield api


def served_nats(api: httpx.Client, window: list[int]) -> float:
    """The summed negative logprobs of a window's ids after its first, scored by the server as a prompt."""
    body = {"model": MODEL_ID, "prompt": window, "max_tokens": 0, "echo": True, "logprobs": 0}
    answer = api.post("/v1/completions", json=body)
    assert answer.status_code == 200, answer.text
    (choice,) = answer.json()["choices"]
    logprobs = choice["logprobs"]["token_logprobs"]
    assert len(logprobs) == len(window) and logprobs[0] is None  # the first id is context only
    return -sum(logprobs[1:])


def test_served_bits_per_byte_equal_the_originals_within_a_tenth_of_a_percent(trained_artifact, completions):
    model = load_model(trained_artifact)
    held = quality.held_out_for(trained_artifact, trained_artifact / files.HELD_OUT_FILENAME)
    windows = quality.scoring_windows(held.ids, model.cfg.max_seq_len)
    assert len(windows) > 1 and all(len(window) <= model.cfg.max_seq_len for window in windows)
    served = sum(served_nats(completions, window.tolist()) for window in windows) / math.log(2) / held.bytes
    original = whole_window_nats(model, held.ids, model.cfg.max_seq_len) / math.log(2) / held.bytes
    assert served == pytest.approx(original, rel=1e-3)
    reported = load_report(trained_artifact)["quality"]["original"]["bits_per_byte"]
    assert reported == pytest.approx(original, rel=1e-6)  # the build scored the same ids


def load_report(artifact: Path) -> dict:
    import json

    return json.loads((artifact / files.REPORT_FILENAME).read_text())
