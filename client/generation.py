"""A generation on the server as the client sees it: a stream of tokens from the session model's engine core
(contract/generation.py), blocking (`Generation`) or asyncio (`AsyncGeneration`).

Each is an iterable of the generated token ids (ints), in order, as the server answers them; after the
last, `finish_reason` says why it ended (contract.generation.FINISH_REASONS) and `held_length` how many
positions the session holds. `tokens` keeps the ids and `logprobs` each one's `Token` (its logprob and
the top alternatives the request asked for). Leaving the loop early, or `close()`, cancels the request:
the server stops within one step, and the session keeps what was answered.

The stream is gRPC's (Triton takes a decoupled model's requests on ModelStreamInfer only): the generation is a
stream of one request on the client's own channel (client/affinity.py `stream`), its responses read as they
come, and a stop is a request of its own on the session's sequence. No channel is opened per generation.

The generation is written once, as the core's operation (client/core.py `SessionCore._generate`): its tokens are
`Emit` actions the drivers hand out (client/retry.py `emitted_blocking`, `emitted_async`), and a caller that
leaves early is told by the answer to the next one. `Generation` and `AsyncGeneration` are its two fronts.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import queue
import secrets
import threading
from collections.abc import AsyncIterator, Iterator
from typing import Any

import numpy as np

from client import affinity, errors
from client._wire import decoded
from client.errors import ClientError
from contract import generation, names


@dataclasses.dataclass(frozen=True)
class Token:
    id: int
    logprob: float
    top: tuple[tuple[int, float], ...]  # the most likely (id, logprob) at its position, best first


@dataclasses.dataclass
class Outcome:
    """What a generation answered so far."""

    tokens: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[Token] = dataclasses.field(default_factory=list)
    # with prompt_logprobs: each prompt token's, None for the first (nothing before it in the request)
    prompt_logprobs: list[Token | None] = dataclasses.field(default_factory=list)
    finish_reason: str | None = None
    held_length: int | None = None
    cached_tokens: int = 0  # prompt ids a kept row saved (contract.generation.REUSE_PREFIX)
    answered: bool = False  # the final response (or an error) came: the request is over on the server

    def read(self, response, failure: BaseException | None) -> int | None:
        """A stream's next message: a response (None: the stream ended), or the gRPC error that broke it; its
        token (None for the final response and the prompt's scores), or the request's error raised typed."""
        if failure is not None:  # a gRPC error: the stream broke (the server went away, a deadline)
            from tritonclient.grpc._utils import get_error_grpc

            self.answered = True  # an error is a request's final answer: nothing is left running
            raise errors.from_exception(get_error_grpc(failure), session=True) from None
        if response is None:
            raise ClientError("the server closed the generation's stream before its end")
        try:
            result = affinity.result(response)
        except Exception as error:  # the request's error, as the server answered it
            self.answered = True
            raise stream_error(error) from None
        return self.take(result)

    def take(self, result) -> int | None:
        """One response: the token it carries (None for the final one, which says how it ended, and for the
        prompt's scores)."""
        result = decoded(result)  # its outputs read once, not once per name asked
        scored = result.as_numpy(generation.PROMPT_LOGPROB)
        if scored is not None:
            self.prompt_logprobs = prompt_tokens(
                scored,
                result.as_numpy(generation.PROMPT_TOP_TOKEN_IDS),
                result.as_numpy(generation.PROMPT_TOP_LOGPROBS),
            )
            return None
        reason = result.as_numpy(generation.FINISH_REASON)
        if reason is not None:
            self.answered = True
            self.finish_reason = reason.reshape(-1)[0].decode()
            self.held_length = int(result.as_numpy(names.HELD_LENGTH).reshape(-1)[0])
            cached = result.as_numpy(generation.CACHED_TOKENS)
            self.cached_tokens = 0 if cached is None else int(cached.reshape(-1)[0])
            return None
        token = int(result.as_numpy(generation.TOKEN_ID)[0])
        top_ids = result.as_numpy(generation.TOP_TOKEN_IDS)
        top_logprobs = result.as_numpy(generation.TOP_LOGPROBS)
        top = tuple(zip(top_ids.tolist(), top_logprobs.tolist(), strict=True)) if top_ids is not None else ()
        self.tokens.append(token)
        self.logprobs.append(Token(token, float(result.as_numpy(generation.LOGPROB)[0]), top))
        return token


def prompt_tokens(logprobs: np.ndarray, top_ids: np.ndarray, top_logprobs: np.ndarray) -> list[Token | None]:
    """The prompt's scores as the server answers them (contract/generation.py): ids are the prompt's own,
    filled in by the caller; -1 pads a row of alternatives."""
    scores: list[Token | None] = []
    for logprob, ids, values in zip(logprobs.tolist(), top_ids.tolist(), top_logprobs.tolist(), strict=True):
        top = tuple((token, value) for token, value in zip(ids, values, strict=True) if token >= 0)
        scores.append(None if np.isnan(logprob) else Token(-1, logprob, top))
    return scores


class Answered:
    """What a generation answered, read as it goes: the fronts share it."""

    outcome: Outcome

    @property
    def tokens(self) -> list[int]:
        return self.outcome.tokens

    @property
    def logprobs(self) -> list[Token]:
        return self.outcome.logprobs

    @property
    def finish_reason(self) -> str | None:
        return self.outcome.finish_reason

    @property
    def prompt_logprobs(self) -> list[Token | None]:
        return self.outcome.prompt_logprobs

    @property
    def held_length(self) -> int | None:
        return self.outcome.held_length

    @property
    def cached_tokens(self) -> int:
        """Prompt ids the server took from a kept row instead of computing them (`reuse_prefix`)."""
        return self.outcome.cached_tokens


class Generation(Answered):
    """A blocking generation: iterate for the token ids (see the module). The generation itself is the core's
    operation (client/core.py `SessionCore._generate`); this front only hands its tokens out."""

    def __init__(self, tokens: Iterator[int], outcome: Outcome) -> None:
        self.outcome, self._tokens = outcome, tokens

    def __iter__(self) -> Iterator[int]:
        """The tokens; leaving the loop early (the iterator closed or dropped) stops the generation."""
        return (yield from self._tokens)

    def __next__(self) -> int:
        return next(self._tokens)

    def close(self) -> None:
        """Stop here: the server is asked to cancel, and stops within one step."""
        self._tokens.close()


class AsyncGeneration(Answered):
    """An asyncio generation: `async for` the token ids (see the module and `Generation`)."""

    def __init__(self, tokens: AsyncIterator[int], outcome: Outcome) -> None:
        self.outcome, self._tokens = outcome, tokens
        self._closing = False

    async def __aiter__(self) -> AsyncIterator[int]:
        """The tokens; leaving the loop early stops the generation (once the loop's iterator is closed:
        at once with `aclose()`)."""
        try:
            async for token in self._tokens:
                yield token
        finally:
            await self.aclose()

    async def __anext__(self) -> int:
        return await self._tokens.__anext__()

    async def aclose(self) -> None:
        """Stop here: the server is asked to cancel, and stops within one step (once; a second call, or the
        loop's iterator closed meanwhile, finds it closing)."""
        if not self._closing:
            self._closing = True
            await self._tokens.aclose()


def opened_stream(stub: Any, request: dict, headers: dict[str, str]) -> Any:
    """The generation `request` (`stream_request`) sent on `stub` (the client's tritonclient.grpc client): its
    responses read with `receive(timeout)`, `cancel()` to leave it. For the asyncio client an awaitable of it,
    and its `receive` a coroutine (a Call's answer, client/retry.py)."""
    call = affinity.stream(stub, headers=headers, **request)
    if type(stub).__module__.endswith(".aio"):
        return _at_once(_AsyncStream(call))
    return _BlockingStream(call)


async def _at_once(value: Any) -> Any:
    return value


class _Stream:
    """A generation's gRPC call; `cancel()` leaves it (the server drops the request within a step)."""

    def __init__(self, call) -> None:
        self.call = call

    def cancel(self) -> None:
        with contextlib.suppress(Exception):
            self.call.cancel()


class _BlockingStream(_Stream):
    """A blocking stream, read by a thread of its own into a queue: a wait for the next response has a deadline."""

    def __init__(self, call) -> None:
        super().__init__(call)
        self.answers = queue.Queue()
        threading.Thread(target=_read_into, args=(call, self.answers), name="generation-stream", daemon=True).start()

    def receive(self, timeout: float) -> tuple[Any, BaseException | None]:
        """(the next response, None); (None, None) at the stream's end; (None, the gRPC error) where it broke."""
        try:
            return self.answers.get(timeout=timeout)
        except queue.Empty:
            raise TimeoutError from None


def _read_into(call, answers: queue.Queue) -> None:
    import grpc

    try:
        for response in call:
            answers.put((response, None))
        answers.put((None, None))
    except grpc.RpcError as error:
        answers.put((None, error))


class _AsyncStream(_Stream):
    """As `_BlockingStream`, on the asyncio call."""

    async def receive(self, timeout: float) -> tuple[Any, BaseException | None]:
        import grpc

        try:
            response = await asyncio.wait_for(self.call.read(), timeout)
        except grpc.RpcError as error:
            return None, error
        return (None if response is grpc.aio.EOF else response), None


def stream_request(
    model: str,
    sequence_id: int,
    ids: np.ndarray,
    request: generation.GenerationRequest,
    module,
    parameters: dict | None = None,
) -> dict:
    """The arguments of `affinity.stream` for one generation; `parameters`: the request's others (its session's
    owner). A generation that starts its session carries Triton's START flag (the sequence
    batcher holds the session's slot from it); one that ends it is followed by an END of its own once answered
    (`Generation`'s end: a request after it on the same sequence, a stop, must still find the sequence)."""
    tensor = module.InferInput(names.INPUT_IDS, list(ids.shape), "INT64")
    tensor.set_data_from_numpy(ids)
    return {
        "model_name": model,
        "inputs": [tensor],
        "sequence_id": sequence_id,
        "sequence_start": request.session_start,
        "parameters": request.to_parameters() | (parameters or {}),
    }


def stream_error(error: BaseException) -> BaseException:
    """The typed error of a stream's answer: a stream's errors carry no status, so the server's own tag
    (contract/errors.py) says what it was."""
    from tritonclient.utils import InferenceServerException

    if isinstance(error, InferenceServerException) and error.status() is None:
        return errors.from_server(str(error.message()), "StatusCode.UNKNOWN", session=True)
    return errors.from_exception(error, session=True) or error


def stop_request(request: dict) -> dict:
    """The request that stops the generation `request` started (a request of its own on the session's sequence:
    Triton's sequence batcher hands it to the model while the generation streams). It carries no token, as an
    empty input (Triton's batcher reads a request's batch size from its first input)."""
    return {
        "model_name": request["model_name"],
        "inputs": [no_ids(type(request["inputs"][0]))],
        "sequence_id": request["sequence_id"],
        "parameters": {generation.STOP_GENERATION: True},
    }


def no_ids(make_input) -> Any:
    """An `input_ids` of no token, (1, 0), made with tritonclient's InferInput class `make_input`."""
    tensor = make_input(names.INPUT_IDS, [1, 0], "INT64")
    tensor.set_data_from_numpy(np.zeros((1, 0), np.int64))
    return tensor


async def fetch_text_files(stub, model: str, timeout: float) -> dict[str, bytes]:
    """The tokenizer files `model` (a whole model's session model, contract/generation.py) serves: name ->
    content, from one request of a sequence of its own (START and END: the session model takes sequences only)
    on `stub`, the client's tritonclient.grpc.aio client."""
    from tritonclient.grpc import InferInput

    options = {"sequence_id": secrets.randbits(63) or 1, "sequence_start": True, "sequence_end": True}
    try:
        answer, _ = await affinity.infer(
            stub,
            model,
            [no_ids(InferInput)],
            headers={},
            parameters={generation.TEXT_FILES: True},
            client_timeout=timeout,
            **options,
        )
    except Exception as error:
        raise stream_error(error) from None
    found = answer.as_numpy(generation.TEXT_FILE_NAMES)
    if found is None:
        raise ClientError(f"'{model}' answered no text files")
    contents = answer.as_numpy(generation.TEXT_FILE_CONTENTS).tolist()
    return {name.decode(): bytes(data) for name, data in zip(found.tolist(), contents, strict=True)}
