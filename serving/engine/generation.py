"""The generation loop, written once: what `mha_generate` runs on the server (each step a BLS call to
`mha_session`) and what an in-process caller runs over a session engine (bench/generate.py).

`generate(step, ...)` drives one session through a `Step`: the prompt in chunks (each answering only its
last position's logits), then one token at a time, picked by contract/sampling.py. Each token is stepped
into the session before it is handed to `emit`: whatever ends the loop (a stop token, max_new_tokens, the
session's end, a stop asked by `stopped()`, a failed step), the session holds the prompt and exactly the
tokens emitted.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy as np

from contract import generation
from contract.sampling import Choice, Sampler

# one step of the session: (ids (T,) int64, start, end) -> (the logits after its last id (vocab,), or None
# for a step of no ids; the positions the session holds afterwards, -1 once it ended)
Step = Callable[[np.ndarray, bool, bool], tuple[np.ndarray | None, int]]


@dataclasses.dataclass(frozen=True)
class Finished:
    reason: str  # contract.generation.FINISH_REASONS
    held_length: int  # positions the session holds (-1: it ended, a stateless generation)
    next_logits: np.ndarray | None  # the logits after its last token: where a next generation starts


def prefill(step: Step, prompt: np.ndarray, start: bool, chunk: int) -> tuple[np.ndarray, int]:
    """`prompt` (T >= 1,) stepped in chunks of `chunk` ids (a decoding session beside it waits at most one);
    the logits after its last id and the positions held."""
    logits, held = None, -1
    for offset in range(0, len(prompt), chunk):
        logits, held = step(prompt[offset : offset + chunk], start and offset == 0, False)
    return logits, held


def generate(
    step: Step,
    request: generation.GenerationRequest,
    logits: np.ndarray,
    held: int,
    max_seq_len: int,
    emit: Callable[[Choice], None],
    stopped: Callable[[], bool] = lambda: False,
    prompt_ids: list[int] | tuple[int, ...] = (),
) -> Finished:
    """From `logits` (after the session's last token; `held` positions held), pick, step and emit up to
    `request.max_new_tokens` tokens. `prompt_ids`: what the repetition penalty counts besides them."""
    sampler = Sampler(request.sampling, prompt_ids=list(prompt_ids))
    stops, reason = set(request.stop_token_ids), generation.LENGTH
    for produced in range(request.max_new_tokens):
        if held >= max_seq_len:
            reason = generation.SESSION_FULL  # no room to keep another token
            break
        if stopped():
            reason = generation.CANCELLED
            break
        choice = sampler.pick(logits)
        last = produced == request.max_new_tokens - 1 or choice.token in stops
        logits, held = step(np.array([choice.token], np.int64), False, request.session_end and last)
        emit(choice)
        if choice.token in stops:
            reason = generation.STOP
            break
    if request.session_end and held >= 0:  # stopped before its last token's step could END it
        held = step(np.zeros(0, np.int64), False, True)[1]
    return Finished(reason, held, logits)
