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
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import queue
import secrets
import threading
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import Any

import numpy as np

from client import affinity, errors
from client._wire import decoded
from client.errors import ClientError, RequestTimeoutError
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


class Generation:
    """A blocking generation: iterate for the token ids (see the module)."""

    def __init__(
        self,
        open_stream: Callable[[], tuple[Any, dict, dict[str, str]]],
        recover: Callable[[ClientError], bool],
        timeout: float,
        on_end: Callable[[Outcome, BaseException | None], None],
    ) -> None:
        """`open_stream()` -> (the client's tritonclient.grpc InferenceServerClient, the generation's request
        (`stream_request`), its headers); `recover(error)`: whether the session was rebuilt after a loss that
        came before any token (the generation is then sent again); `on_end` is told once what was answered,
        and the error that ended it if any (the session's bookkeeping)."""
        self.outcome = Outcome()
        self._open, self._recover, self._timeout, self._on_end = open_stream, recover, timeout, on_end
        self._stub = self._request = self._headers = self._call = self._answers = None
        self._done = False
        self._iterator = self._generate()

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

    def __iter__(self) -> Iterator[int]:
        """The tokens; leaving the loop early (the iterator closed or dropped) stops the generation."""
        return (yield from self._iterator)

    def __next__(self) -> int:
        return next(self._iterator)

    def _generate(self) -> Iterator[int]:
        failure: BaseException | None = None
        try:
            while True:
                try:
                    yield from self._stream()
                    return
                except ClientError as error:
                    if self.outcome.tokens or not self._recover(error):
                        raise
        except BaseException as error:
            failure = error if isinstance(error, Exception) else None
            raise
        finally:
            self._finish(failure)

    def _stream(self) -> Iterator[int]:
        self._cancel()
        self._stub, self._request, self._headers = self._open()
        self._answers = answers = queue.Queue()
        self._call = call = affinity.stream(self._stub, headers=self._headers, **self._request)
        threading.Thread(target=_read_into, args=(call, answers), name="generation-stream", daemon=True).start()
        while self.outcome.finish_reason is None:
            token = self._answer()
            if token is not None:
                yield token

    def _answer(self) -> int | None:
        """The next response: its token, or None for the final one."""
        try:
            response, failure = self._answers.get(timeout=self._timeout)
        except queue.Empty:
            raise RequestTimeoutError(f"no token from the server in {self._timeout:g} s") from None
        return self.outcome.read(response, failure)

    def _stop(self) -> None:
        """Ask the server to stop before its next token, and read what it still answers up to its final
        response: the tokens it stepped in meanwhile are the session's too (kept in `tokens`)."""
        affinity.send(self._stub, headers=self._headers, **stop_request(self._request))
        while self.outcome.finish_reason is None:
            self._answer()

    def close(self) -> None:
        """Stop here: the server is asked to cancel, and stops within one step."""
        self._iterator.close()
        self._finish(None)

    def _cancel(self) -> None:
        """The stream left: cancelled where the server may still answer (it drops the request within a step)."""
        call, self._call = self._call, None
        if call is not None and not self.outcome.answered:
            with contextlib.suppress(Exception):
                call.cancel()

    def _finish(self, failure: BaseException | None) -> None:
        if self._done:
            return
        self._done = True
        if failure is None and self.outcome.finish_reason is None and self._call is not None:
            try:
                self._stop()
            except Exception as error:  # the stream broke while stopping: what it held is unknown
                failure = error
        self._cancel()
        self._on_end(self.outcome, failure)


def _read_into(call, answers: queue.Queue) -> None:
    """A blocking stream's responses into `answers` as (response, None), then (None, None) at its end, or (None,
    the gRPC error) where it broke."""
    import grpc

    try:
        for response in call:
            answers.put((response, None))
        answers.put((None, None))
    except grpc.RpcError as error:
        answers.put((None, error))


class AsyncGeneration:
    """An asyncio generation: `async for` the token ids (see the module)."""

    def __init__(
        self,
        open_stream: Callable[[], Awaitable[tuple[Any, dict, dict[str, str]]]],
        recover: Callable[[ClientError], Awaitable[bool]],
        timeout: float,
        on_end: Callable[[Outcome, BaseException | None], Awaitable[None]],
    ) -> None:
        """As `Generation`'s, awaitable: `open_stream` gives the client's tritonclient.grpc.aio client."""
        self.outcome = Outcome()
        self._open, self._recover, self._timeout, self._on_end = open_stream, recover, timeout, on_end
        self._stub = self._request = self._headers = self._call = None
        self._done = self._closing = False
        self._iterator = self._generate()

    tokens = Generation.tokens
    logprobs = Generation.logprobs
    finish_reason = Generation.finish_reason
    held_length = Generation.held_length
    cached_tokens = Generation.cached_tokens
    prompt_logprobs = Generation.prompt_logprobs

    async def __aiter__(self) -> AsyncIterator[int]:
        """The tokens; leaving the loop early stops the generation (once the loop's iterator is closed:
        at once with `aclose()`)."""
        try:
            async for token in self._iterator:
                yield token
        finally:
            await self.aclose()

    async def __anext__(self) -> int:
        return await self._iterator.__anext__()

    async def _generate(self) -> AsyncIterator[int]:
        failure: BaseException | None = None
        try:
            while True:
                try:
                    async for token in self._stream():
                        yield token
                    return
                except ClientError as error:
                    if self.outcome.tokens or not await self._recover(error):
                        raise
        except BaseException as error:
            failure = error if isinstance(error, Exception) else None
            raise
        finally:
            await self._finish(failure)

    async def _stream(self) -> AsyncIterator[int]:
        self._cancel()
        self._stub, self._request, self._headers = await self._open()
        self._call = affinity.stream(self._stub, headers=self._headers, **self._request)
        while self.outcome.finish_reason is None:
            token = await self._answer()
            if token is not None:
                yield token

    async def _answer(self) -> int | None:
        import grpc

        try:
            response = await asyncio.wait_for(self._call.read(), self._timeout)
        except TimeoutError:
            raise RequestTimeoutError(f"no token from the server in {self._timeout:g} s") from None
        except grpc.RpcError as error:
            return self.outcome.read(None, error)
        return self.outcome.read(None if response is grpc.aio.EOF else response, None)

    async def _stop(self) -> None:
        """As `Generation._stop`."""
        await affinity.send(self._stub, headers=self._headers, **stop_request(self._request))
        while self.outcome.finish_reason is None:
            await self._answer()

    async def aclose(self) -> None:
        """Stop here: the server is asked to cancel, and stops within one step (once; a second call, or the
        loop's iterator closed meanwhile, finds it closing)."""
        if self._closing:
            return
        self._closing = True
        await self._iterator.aclose()
        await self._finish(None)

    def _cancel(self) -> None:
        """As `Generation._cancel`."""
        call, self._call = self._call, None
        if call is not None and not self.outcome.answered:
            with contextlib.suppress(Exception):
                call.cancel()

    async def _finish(self, failure: BaseException | None) -> None:
        if self._done:
            return
        self._done = True
        if failure is None and self.outcome.finish_reason is None and self._call is not None:
            try:
                await self._stop()
            except Exception as error:  # the stream broke while stopping: what it held is unknown
                failure = error
        self._cancel()
        await self._on_end(self.outcome, failure)


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
