"""Admission: the KV budget, never Triton's sequence batcher, is what turns a session away.

Triton gives each sequence a candidate slot from START to END; with every slot taken it holds a new
START unanswered in a backlog. sessions had 1,024 slots whatever its budget: on a budget of more
sessions than that, the 1,025th START hung to the caller's deadline. The slots now follow the budget
(serving/triton/config.py `candidate_sequences`): on a budget of more than 1,024 sessions every START
is answered at once, those beyond the budget with `[cache_full]` (the client's ServerBusyError),
and the client ends the refused sequence so that refusals do not hold slots.
"""

from __future__ import annotations

import concurrent.futures

import numpy as np
import pytest
from tritonclient.utils import InferenceServerException

from client import Client, ServerBusyError
from contract import errors as kinds
from contract.config import ModelConfig
from serving.host.launcher import start_triton
from serving.triton.config import FORWARD, SESSIONS, ServingSettings
from serving.triton.repository import write_repository
from tests.serving import helpers

pytestmark = [pytest.mark.served, pytest.mark.slow]

# fp32 rows of the tiny model's max_seq_len; a session opened without tokens takes half a row, so the
# budget holds 2 * ROWS = 1,040 sessions: more than the 1,024 slots Triton had, by a few (each open is a
# request: 2,200 of them took 50 s here). A multiple of 4: whole slabs of 4 rows (cache_manager.py).
ROWS = 520
ANSWER_WITHIN_S = 10.0  # a START Triton held in its backlog would time out here instead of answering
BEYOND = 4  # opens past the budget: each must be refused
AT_ONCE = 4  # opens (and closes) in flight together: one at a time took 13 s of this test here


@pytest.fixture(scope="module")
def server(artifact_dir, tmp_path_factory):
    artifact = artifact_dir("tiny")
    cfg = ModelConfig.load(artifact)
    settings = ServingSettings(threads=1, kv_cache_bytes=ROWS * cfg.kv_cache_bytes(1, cfg.max_seq_len))
    work = tmp_path_factory.mktemp("admission")
    repository = write_repository(artifact, work / "repository", settings, models=(FORWARD, SESSIONS))
    triton = start_triton(repository, log_path=work / "triton.log")
    yield triton
    triton.stop()


def open_past_the_budget(client: Client, admitted: int) -> tuple[list, list[ServerBusyError]]:
    """`admitted + BEYOND` sessions opened, AT_ONCE at a time: those opened and the refusals. Any
    other answer (a START held to the client's deadline: RequestTimeoutError) fails the test."""

    def open_one(_: int):
        session = client.session()
        try:
            return session.open()
        except ServerBusyError as refused:
            return refused

    with concurrent.futures.ThreadPoolExecutor(AT_ONCE) as pool:
        answers = list(pool.map(open_one, range(admitted + BEYOND)))
    refusals = [answer for answer in answers if isinstance(answer, ServerBusyError)]
    return [answer for answer in answers if not isinstance(answer, ServerBusyError)], refusals


def test_every_start_is_answered_and_those_beyond_the_budget_are_refused_as_cache_full(server):
    client = Client(server.grpc_url, timeout=ANSWER_WITHIN_S, retries=0)
    sessions, refusals = open_past_the_budget(client, admitted=2 * ROWS)
    try:
        # exactly 2 * ROWS, past Triton's old 1,024: the budget is ROWS fp32 rows of the tiny model's
        # max_seq_len (512), and the CPU's static engine sizes rows to the session, so a session opened
        # without tokens holds a row of min_row_positions (256), half a full one. (A GPU's CUDA-graph
        # engine keeps full rows, in fp16: half the bytes, 2 * ROWS again.)
        assert (len(sessions), len(refusals)) == (2 * ROWS, BEYOND)
        for refused in refusals:
            assert refused.kind == kinds.CACHE_FULL and "the KV cache budget is full" in refused.message
        assert_a_refused_open_is_ended(server, client)
        assert_live_sessions_still_answer_right(client, [sessions[0], sessions[len(sessions) // 2], sessions[-1]])
    finally:
        with concurrent.futures.ThreadPoolExecutor(AT_ONCE) as pool:
            list(pool.map(lambda session: session.close(), sessions))
        client.close()
    with Client(server.grpc_url, timeout=ANSWER_WITHIN_S, retries=0) as again:
        again.session().open().close()  # the ENDs gave the rows back


def assert_a_refused_open_is_ended(server, client: Client) -> None:
    """A refused START holds a Triton slot until its END: open() sends that END, so refusals never
    fill the slots. Seen from Triton: a later step of the refused sequence is no longer one it holds
    (its own "must specify the START flag"; had it kept the slot, the model would answer the step)."""
    refused = client.session()
    with pytest.raises(ServerBusyError):
        refused.open()
    width = client.metadata(SESSIONS).d_model
    with helpers.Client(server, "grpc") as raw, pytest.raises(InferenceServerException) as answer:
        raw.step(refused.id, np.zeros((1, 1, width), np.float32))
    assert "must specify the START flag" in answer.value.message(), answer.value.message()


def assert_live_sessions_still_answer_right(client: Client, sessions: list) -> None:
    """Sessions opened before the refusals step as usual: the same tokens give each of them the
    stateless model's answer for a sequence with no past."""
    width = client.metadata(SESSIONS).d_model
    tokens = np.random.default_rng(5).standard_normal((1, 3, width)).astype(np.float32)
    expected = client.infer(tokens).output
    for session in sessions:
        np.testing.assert_allclose(session.step(tokens), expected, atol=1e-5, rtol=1e-5)
