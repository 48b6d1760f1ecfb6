"""The engine core (serving/engine/core.py) in process, over the static engine of the `whole` artifact: greedy
generations decoded together equal the PyTorch original's, the token budget bounds what a joining prompt
costs the decoders, a stop and a client that left end a generation exactly where the session stands, prefix
reuse is per owner and exact, kept rows give way under the budget, and requests keep their session's order."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch

from contract import generation, names
from contract.files import model_filename
from export.artifacts import load_model
from serving.engine import core, factory
from serving.engine.settings import SessionSettings
from serving.engine.steps import StepRequest

WHOLE = "whole"


class Answers:
    """A request's answers, as the core hands them (a Responder)."""

    def __init__(self, on_token: Callable[[int], None] | None = None, cancelled: Callable[[], bool] | None = None):
        self.tokens: list[int] = []
        self.sent: list[dict] = []
        self.final: dict | None = None
        self.error: Exception | None = None
        self.done = threading.Event()
        self._on_token, self._cancelled = on_token, cancelled

    def send(self, outputs) -> None:
        self.sent.append(dict(outputs))
        if generation.TOKEN_ID in outputs:
            self.tokens.append(int(outputs[generation.TOKEN_ID][0]))
            if self._on_token is not None:
                self._on_token(len(self.tokens))

    def finish(self, outputs=None, error=None) -> None:
        self.final, self.error = (dict(outputs) if outputs is not None else None), error
        self.done.set()

    def cancelled(self) -> bool:
        return self._cancelled() if self._cancelled is not None else False

    def wait(self, timeout: float = 30.0) -> Answers:
        assert self.done.wait(timeout), "no final answer in time"
        return self

    @property
    def reason(self) -> str:
        return self.final[generation.FINISH_REASON][0].decode()

    @property
    def held(self) -> int:
        return int(self.final[names.HELD_LENGTH].reshape(-1)[0])

    @property
    def cached(self) -> int:
        return int(self.final[generation.CACHED_TOKENS][0])


@pytest.fixture(scope="module")
def original(artifact_dir):
    return load_model(artifact_dir(WHOLE)).eval()


def engine_of(artifact_dir, kv_rows: int = 16):
    return static_engine(artifact_dir(WHOLE), kv_rows)


def static_engine(artifact: Path, kv_rows: int):
    """The artifact's fp32-static engine with room for `kv_rows` full rows, one thread."""
    cfg = load_model(artifact).cfg
    budget = kv_rows * cfg.kv_cache_bytes(1, cfg.max_seq_len)
    settings = SessionSettings(kv_cache_bytes=budget, threads=1, min_row_positions=cfg.max_seq_len)
    return factory.session_engine({"cpu": artifact / model_filename("fp32-static")}, cfg, settings, "core-test")


@pytest.fixture
def make_core(artifact_dir):
    made: list[core.EngineCore] = []

    def make(**settings) -> core.EngineCore:
        rows = settings.pop("kv_rows", 16)
        started = core.EngineCore(engine_of(artifact_dir, rows), core.CoreSettings(**settings)).start()
        made.append(started)
        return started

    yield make
    for started in made:
        started.stop()


def greedy(model, prompt: np.ndarray, tokens: int) -> list[int]:
    """The PyTorch original's greedy tokens after `prompt`, each over the whole sequence so far."""
    ids = torch.from_numpy(np.asarray(prompt, np.int64))[None]
    out = []
    with torch.no_grad():
        for _ in range(tokens):
            token = int(model(ids).output[0, -1].argmax())
            out.append(token)
            ids = torch.cat([ids, torch.tensor([[token]])], 1)
    return out


def generate(engine_core, sid, prompt, answers=None, owner: str = "", **asked) -> Answers:
    answers = answers or Answers()
    request = generation.GenerationRequest(**{"session_start": True, "session_end": True} | asked)
    engine_core.submit(core.Generate(sid, answers, owner, prompt=np.asarray(prompt, np.int64), asked=request))
    return answers


def step(engine_core, sid, ids, start=False, end=False, last_only=False) -> Answers:
    answers = Answers()
    tokens = np.asarray(ids, np.int64).reshape(1, -1)
    engine_core.submit(core.Step(sid, answers, step=StepRequest(sid, start, end, tokens, last_only=last_only)))
    return answers


def prompt(seed: int, length: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 320, length, dtype=np.int64)


# --- generations together ----------------------------------------------------------------------------------


def test_generations_decoded_together_are_each_the_originals_greedy(make_core, original):
    engine_core = make_core(step_tokens=16, min_chunk=8)  # prompts of up to 40 ids: chunked beside the decoders
    prompts = [prompt(k, length) for k, length in enumerate((5, 40, 17, 3, 29))]
    answers = [generate(engine_core, 100 + k, ids, max_new_tokens=12) for k, ids in enumerate(prompts)]
    for ids, answered in zip(prompts, answers, strict=True):
        answered.wait()
        assert answered.error is None and answered.reason == generation.LENGTH and answered.held == -1
        assert answered.tokens == greedy(original, ids, 12)
    assert engine_core.stats.most_decode_rows >= 2  # they shared decode runs
    assert engine_core.engine.stats().sequences == 0  # stateless: every row given back


def test_a_joining_prompt_costs_the_decoders_at_most_one_chunk_a_step(artifact_dir, original):
    """Every engine call while a session decodes holds its token and at most `step_tokens` tokens in all."""
    engine = engine_of(artifact_dir)
    calls: list[dict] = []  # each engine call: sequence id -> its step's tokens
    execute = engine.execute

    def recorded(steps):
        calls.append({s.sequence_id: 0 if s.hidden is None else s.hidden.shape[1] for s in steps})
        return execute(steps)

    engine.execute = recorded
    engine_core = core.EngineCore(engine, core.CoreSettings(step_tokens=8, min_chunk=4)).start()
    try:
        decoder = generate(engine_core, 1, prompt(1, 4), max_new_tokens=40)
        while len(decoder.tokens) < 3:
            decoder.done.wait(0.001)
        joiner = generate(engine_core, 2, prompt(2, 50), max_new_tokens=2)
        joiner.wait()
        decoder.wait()
    finally:
        engine_core.stop()
    assert decoder.tokens == greedy(original, prompt(1, 4), 40)
    assert joiner.tokens == greedy(original, prompt(2, 50), 2)
    joined = [sizes for sizes in calls if sizes.get(2, 0) > 1]  # the calls that ran a chunk of the joiner's
    assert len(joined) >= 50 // 8  # the joiner's prompt went in chunks
    for sizes in joined:
        assert sum(sizes.values()) <= 8 and sizes.get(1) == 1, sizes  # the decoder's token beside each chunk


# --- ends ---------------------------------------------------------------------------------------------------


def test_a_stop_ends_a_generation_after_the_token_answered_and_the_session_holds_it(make_core, original):
    engine_core = make_core()
    ids = prompt(3, 6)
    step(engine_core, 7, ids[:-1], start=True).wait()

    def on_token(count: int) -> None:
        if count == 3:  # answered from the loop's thread: the stop is read before the next token is picked
            engine_core.submit(core.Stop(7, Answers()))

    answered = generate(engine_core, 7, ids[-1:], Answers(on_token), session_start=False, session_end=False)
    answered.wait()
    assert answered.reason == generation.CANCELLED and answered.tokens == greedy(original, ids, 3)
    assert answered.held == len(ids) + 3 == engine_core.engine.length(7)
    more = generate(engine_core, 7, [], max_new_tokens=2, session_start=False, session_end=False).wait()
    assert more.tokens == greedy(original, np.concatenate([ids, answered.tokens]), 2)  # it goes on from there


def test_a_client_that_left_is_dropped_and_its_rows_freed(make_core):
    engine_core = make_core(cancel_check_s=0.01)
    left = threading.Event()

    def slow_client(count: int) -> None:  # answered from the loop: 50 tokens take half a second
        time.sleep(0.01)
        if count == 2:
            left.set()

    answered = generate(engine_core, 9, prompt(4, 8), Answers(slow_client, left.is_set), max_new_tokens=50)
    answered.wait()
    assert answered.reason == generation.CANCELLED and len(answered.tokens) < 50
    assert engine_core.engine.length(9) == -1 and engine_core.engine.stats().sequences == 0


def test_the_rows_end_finishes_a_generation_at_max_seq_len(make_core, original):
    engine_core = make_core()
    ids = prompt(5, original.cfg.max_seq_len - 3)
    answered = generate(engine_core, 11, ids, max_new_tokens=10, session_end=False).wait()
    assert answered.reason == generation.SESSION_FULL and len(answered.tokens) == 3
    assert answered.held == original.cfg.max_seq_len


# --- prefix reuse -------------------------------------------------------------------------------------------


def test_a_prompt_extending_a_kept_row_of_its_owner_reuses_it_and_nobody_elses(make_core, original):
    engine_core = make_core()
    first_prompt = prompt(6, 20)
    first = generate(engine_core, 20, first_prompt, owner="alice", max_new_tokens=5, reuse_prefix=True).wait()
    assert first.cached == 0 and engine_core.stats.kept == 1
    turn = np.concatenate([first_prompt, first.tokens, prompt(7, 6)])  # a chat's next turn
    forks = count_forks(engine_core)
    second = generate(engine_core, 21, turn, owner="alice", max_new_tokens=6, reuse_prefix=True).wait()
    assert second.cached == len(first_prompt) + 5  # everything the kept row held
    assert second.tokens == greedy(original, turn, 6)
    # the next turn took the kept row over (no copy), and its own row is kept in its place
    assert count_forks(engine_core) == forks and engine_core.stats.kept == 1
    parted = np.concatenate([first_prompt, prompt(8, 3)])  # shares the first prompt only: the kept row is copied
    third = generate(engine_core, 23, parted, owner="alice", max_new_tokens=2, reuse_prefix=True).wait()
    assert third.cached == len(first_prompt) and third.tokens == greedy(original, parted, 2)
    assert count_forks(engine_core) == forks + 1 and engine_core.stats.kept == 2
    stranger = generate(engine_core, 22, turn, owner="bob", max_new_tokens=6, reuse_prefix=True).wait()
    assert stranger.cached == 0 and stranger.tokens == second.tokens  # another owner's rows are never read


def count_forks(engine_core) -> int:
    """How many forks the engine has made (its fork wrapped once: the engine counts none of its own)."""
    engine = engine_core.engine
    if not hasattr(engine, "forks"):
        fork, engine.forks = engine.fork, 0

        def counted(*args, **kwargs):
            engine.forks += 1
            return fork(*args, **kwargs)

        engine.fork = counted
    return engine.forks


def test_kept_rows_give_way_least_recent_first_when_the_budget_is_full(make_core):
    engine_core = make_core(kv_rows=3)
    for k in range(3):  # three rows kept, the budget full
        generate(engine_core, 30 + k, prompt(10 + k, 20), owner="alice", max_new_tokens=2, reuse_prefix=True).wait()
    assert engine_core.stats.kept == 3 or engine_core.engine.stats().sequences == 3
    opened = step(engine_core, 40, prompt(20, 4), start=True).wait()
    assert opened.error is None  # a kept row ended for it
    again = generate(engine_core, 41, np.concatenate([prompt(12, 20), [1]]), owner="alice", reuse_prefix=True)
    assert again.wait().cached >= 16  # the most recent kept row is still there
    step(engine_core, 40, [], end=True).wait()


# --- steps and order ----------------------------------------------------------------------------------------


def test_a_long_step_in_chunks_answers_what_one_run_does(make_core, artifact_dir):
    engine_core = make_core(step_tokens=8, min_chunk=4)
    ids = prompt(8, 30)
    chunked = step(engine_core, 50, ids, start=True).wait()
    direct_engine = engine_of(artifact_dir)
    (whole_run,) = direct_engine.execute([StepRequest(51, True, False, ids[None])])
    logits = chunked.final[names.LOGITS]
    np.testing.assert_allclose(logits, whole_run, atol=1e-5 * np.abs(whole_run).max(), rtol=0)
    assert chunked.final[names.HELD_LENGTH][0, 0] == 30


def test_a_sessions_requests_run_in_the_order_they_came(make_core, original):
    """A step sent right behind a generation of its session runs after it: it sees the generated tokens."""
    engine_core = make_core()
    ids = prompt(9, 5)
    generated = generate(engine_core, 60, ids, max_new_tokens=4, session_end=False)
    after = step(engine_core, 60, [3], last_only=True)
    generated.wait()
    after.wait()
    assert after.final[names.HELD_LENGTH][0, 0] == len(ids) + 4 + 1
    history = np.concatenate([ids, generated.tokens, [3]])
    with torch.no_grad():
        expected = original(torch.from_numpy(history)[None]).output[0, -1].numpy()
    np.testing.assert_allclose(after.final[names.LOGITS][0, -1], expected, atol=1e-5 * np.abs(expected).max(), rtol=0)


def test_an_owners_generations_past_its_cap_wait_their_turn(make_core):
    engine_core = make_core(generations_per_owner=1)
    first = generate(engine_core, 70, prompt(10, 4), owner="alice", max_new_tokens=20)
    second = generate(engine_core, 71, prompt(11, 4), owner="alice", max_new_tokens=2)
    other = generate(engine_core, 72, prompt(12, 4), owner="bob", max_new_tokens=2)
    other.wait()
    assert not second.done.is_set() or first.done.is_set()
    second.wait()
    assert first.done.is_set()  # the second ran only after the first ended


# --- the kept rows' index ------------------------------------------------------------------------------------


def test_the_longest_kept_row_of_the_owner_is_found_from_min_shared_on_and_the_cap_drops_the_least_recent():
    assert core.shared_prefix(np.array([5, 6, 7, 8]), np.array([5, 6, 9])) == 2
    assert core.shared_prefix(np.array([5, 6]), np.array([5, 6, 7])) == 2
    opening = list(range(100, 100 + core.MIN_SHARED))  # a chat template's opening, and a system prompt
    kept = core.KeptRows(per_owner=2)

    def keep(sid, owner, ids, at):
        return kept.add(core.Kept(sid, owner, np.asarray(ids), at))

    keep("short", "alice", [*opening, 1, 2, 3], 1.0)
    keep("long", "alice", [*opening, 1, 2, 3, 4, 5, 6], 2.0)
    keep("bobs", "bob", [*opening, 1, 2, 3, 4, 5, 6, 7], 3.0)
    entry, length = kept.longest("alice", np.array([*opening, 1, 2, 3, 4, 5, 9]))
    assert entry.sequence_id == "long" and length == core.MIN_SHARED + 5
    # the whole of a kept row is never the whole prompt: one id is left to step, for the logits to go on from
    assert kept.longest("alice", np.array([*opening, 1, 2, 3]))[1] == core.MIN_SHARED + 2
    assert kept.longest("alice", np.array([*opening[:-1], 0, 1]))[0] is None  # fewer than MIN_SHARED shared
    assert kept.longest("carol", np.array([*opening, 1]))[0] is None  # another owner's rows are never read
    assert keep("third", "alice", [*opening, 9], 0.5) == ["third"]  # past the cap: the least recently used goes
    assert kept.least_recent() == "bobs"  # the one no lookup has touched since it was kept


def test_a_full_budget_ends_the_kept_rows_of_the_owner_over_its_share_first():
    """Room for a new row ends a kept row of the owner holding more than an equal share (its least recently
    used), before another owner's older ones: one key's loops end its own conversations, not every key's."""
    kept = core.KeptRows(per_owner=8)
    for at, (sid, owner) in enumerate(
        [("bob-1", "bob"), ("carol-1", "carol"), *((f"alice-{k}", "alice") for k in range(5))]
    ):
        kept.add(core.Kept(sid, owner, np.arange(4), float(at)))
    assert kept.least_recent() == "bob-1"
    assert kept.victim() == "alice-0"  # alice holds 5 of 7 rows: more than her share of 7/3
    for k in range(4):
        kept.remove(f"alice-{k}")
    assert kept.victim() == "bob-1"  # one row each: the least recently used of all
