"""`mha_generate`: generation on the server, a decoupled model beside a whole model's `mha_session`.

A request names a session (Triton's correlation id), brings new token ids `input_ids` [1, T] (T may be 0
after a generation: the session then goes on from what it holds) and the parameters of
contract/generation.py. A thread of its own steps the session through `mha_session` by BLS (Triton's
calls between models: no network): the prompt in chunks of `prefill_chunk` tokens, each answering its
last position's logits only, then one token at a time, picking each with contract/sampling.py. Every
token goes out in a response of its own as soon as it is picked; the final response carries the finish
reason and the positions the session holds.

Why through `mha_session` and not an engine of its own: the session (its KV rows, snapshots, forks,
rewinds, prefixes, durable checkpoints) lives there, and generating sessions share its graph runs with
each other and with plain steps: Triton's sequence batcher gathers the steps that arrive together into one
execute(), so a joining prompt's chunk and the other sessions' decode steps run in one round (continuous
batching), and a decoder waits at most one chunk.

The session holds every token it answered: each picked token is stepped into the cache before it is
answered (its logits are the next pick's), so whatever ends a generation, the session holds the prompt
and exactly the tokens the client saw. The logits after the last one are kept here (`pending`), with the
length the session had then, so that a generation with no new ids continues from them; a session that
moved, changed since or outlived this process has none: such a request needs a token, and is told so.
"""

from __future__ import annotations

import collections
import contextlib
import json
import threading

import numpy as np
import triton_python_backend_utils as pb_utils

from contract import errors as kinds
from contract import generation, names
from contract.files import TEXT_FILES
from contract.inputs import InputError, check_token_values
from contract.sampling import Sampler
from serving.engine import generation as loop
from serving.triton import digests
from serving.triton.config import P_PREFILL_CHUNK, P_SESSION_MODEL, P_TEXT_DIGEST
from serving.triton.models import common

START = pb_utils.TRITONSERVER_REQUEST_FLAG_SEQUENCE_START
END = pb_utils.TRITONSERVER_REQUEST_FLAG_SEQUENCE_END
FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
PENDING_SESSIONS = 256  # sessions whose next-token logits are kept (a vocabulary's floats each)


class StepFailed(RuntimeError):
    """`mha_session` answered a step with an error: its message and Triton error code, passed on."""

    def __init__(self, error) -> None:
        super().__init__(error.message())
        self.code = error.code() if hasattr(error, "code") else pb_utils.TritonError.INTERNAL


class NoNextLogits(InputError):
    """A generation without ids where this model kept no logits after the session's last token."""

    def __init__(self, sequence: int) -> None:
        super().__init__(
            names.INPUT_IDS,
            f"session {sequence}: no token ids given, and this server holds no logits after the session's last "
            "token (it did not generate here last, or the session changed since): send at least its last token "
            "again (rewind by one first)",
        )


class TritonPythonModel:
    def initialize(self, args: dict) -> None:
        self.model = common.Loaded(args)
        self.cfg = self.model.cfg
        self.session_model = self.model.parameters[P_SESSION_MODEL]
        self.chunk = int(self.model.parameters[P_PREFILL_CHUNK])
        # a session's logits after its last generated token, and the positions it held then
        self.pending: collections.OrderedDict[int, tuple[np.ndarray, int]] = collections.OrderedDict()
        self.generating: set[int] = set()  # sessions with a generation under way: one at a time each
        self.stopping: set[int] = set()  # of those, the ones asked to stop (generation.STOP_GENERATION)
        self.lock = threading.Lock()
        self.text_files = _text_files(self.model.version, self.model.parameters.get(P_TEXT_DIGEST))
        text = f", text files {', '.join(self.text_files)}" if self.text_files else ", no tokenizer (token ids only)"
        pb_utils.Logger.log_info(
            f"{self.model.name}: generation over {self.session_model}, prompts in chunks of {self.chunk} tokens{text}"
        )

    def finalize(self) -> None:
        self.model.server_watch.stop()

    def execute(self, requests: list) -> None:
        """Each generation on a thread of its own (a decoupled model answers through each one's sender); a
        stop request marks its session's generation, which ends before its next token."""
        for request in requests:
            asked = json.loads(request.parameters() or "{}")
            if generation.TEXT_FILES in asked:
                self._answer_text_files(request)
                continue
            if generation.STOP_GENERATION in asked:
                with self.lock:
                    if request.correlation_id() in self.generating:
                        self.stopping.add(request.correlation_id())
                request.get_response_sender().send(flags=FINAL)
                continue
            sequence = request.correlation_id()
            with self.lock:  # registered here, in arrival order: a stop right behind it finds it
                busy = sequence in self.generating
                self.generating.add(sequence)
            if busy:
                error = InputError("sequence_id", f"session {sequence} is generating already: one generation at a time")
                request.get_response_sender().send(common.error_response(self.model.name, error), flags=FINAL)
                continue
            threading.Thread(target=self._generate, args=(request,), name="generation", daemon=True).start()

    def _answer_text_files(self, request) -> None:
        sender = request.get_response_sender()
        names_, contents = list(self.text_files), list(self.text_files.values())
        outputs = {
            generation.TEXT_FILE_NAMES: np.array([name.encode() for name in names_], np.object_),
            generation.TEXT_FILE_CONTENTS: np.array(contents, np.object_),
        }
        self._complete(sender, common.response(outputs))

    # --- one generation -------------------------------------------------------------------------------------

    def _generate(self, request) -> None:
        sender = request.get_response_sender()
        sequence = request.correlation_id()
        asked, answer = None, None
        try:
            asked = generation.GenerationRequest.from_parameters(request.parameters())
            asked.check(self.cfg.vocab_size, self.cfg.max_seq_len)
            prompt = self._prompt(request)
            reason, held = self._loop(request, sender, sequence, asked, prompt)
            final = {generation.FINISH_REASON: np.array([reason.encode()], np.object_), names.HELD_LENGTH: held}
            answer = common.response(final)
        except NoNextLogits as error:  # its own kind: the client sends the last token again and goes on
            message = kinds.tag(kinds.NO_NEXT_LOGITS, str(error))
            answer = pb_utils.InferenceResponse(error=pb_utils.TritonError(message, pb_utils.TritonError.INVALID_ARG))
        except StepFailed as failed:
            if asked is not None and asked.session_end:  # a stateless generation leaves nothing behind
                self._end_quietly(sequence)
            answer = pb_utils.InferenceResponse(error=pb_utils.TritonError(str(failed), failed.code))
        except Exception as error:  # the request's own answer (a token's send to a client gone included)
            answer = common.error_response(self.model.name, error)
        finally:
            with self.lock:
                self.generating.discard(sequence)
                self.stopping.discard(sequence)
            self._complete(sender, answer)

    def _complete(self, sender, answer) -> None:
        """The final response; to a client that left, an empty final one: a request never completed
        would hold the model in Triton's shutdown until its exit timeout."""
        try:
            sender.send(answer, flags=FINAL)
        except Exception:
            with contextlib.suppress(Exception):  # nothing more can be said to anyone
                sender.send(flags=FINAL)

    def _prompt(self, request) -> np.ndarray:
        tensor = pb_utils.get_input_tensor_by_name(request, names.INPUT_IDS)
        ids = np.zeros((1, 0), np.int64) if tensor is None else tensor.as_numpy()
        if ids.ndim != 2 or ids.shape[0] != 1:
            raise InputError(names.INPUT_IDS, f"expected shape [1, T], got {list(ids.shape)}")
        check_token_values(self.cfg, {names.INPUT_IDS: ids})
        return ids[0].astype(np.int64)

    def _loop(self, request, sender, sequence: int, asked: generation.GenerationRequest, prompt: np.ndarray):
        """serving/engine/generation.py's loop over this session's BLS steps; (finish reason, held_length [1])."""

        def step(ids: np.ndarray, start: bool, end: bool):
            logits, held = self._step(sequence, ids, start=start, end=end)
            return logits, int(held[0])

        if len(prompt) and asked.prompt_logprobs is not None:
            logits, held, scored = self._scored_prefill(sequence, prompt, asked)
            sender.send(common.response(scored))
        elif len(prompt):
            logits, held = loop.prefill(step, prompt, asked.session_start, self.chunk)
        else:
            logits, held = self._kept_logits(sequence, asked.session_start)
        finished = loop.generate(
            step,
            asked,
            logits,
            held,
            self.cfg.max_seq_len,
            emit=lambda choice: sender.send(common.response(token_outputs(choice))),
            stopped=lambda: request.is_cancelled() or sequence in self.stopping,
            prompt_ids=prompt.tolist(),
        )
        self._keep(sequence, finished.next_logits, finished.held_length, ended=asked.session_end)
        return finished.reason, np.array([finished.held_length], np.int64)

    def _scored_prefill(self, sequence: int, prompt: np.ndarray, asked: generation.GenerationRequest):
        """The prompt in chunks with every position's logits: each prompt token's logprob given the ones
        before it, and the top `prompt_logprobs` there (the first token has nothing before it in this
        request: NaN). (the logits after the last id, held_length, the response's outputs)"""
        logits, held, rows = None, -1, []
        for offset in range(0, len(prompt), self.chunk):
            ids = prompt[offset : offset + self.chunk]
            chunk_logits, held_array = self._step(
                sequence, ids, start=asked.session_start and offset == 0, last_only=False
            )
            rows.append(chunk_logits)
            logits, held = chunk_logits[-1], int(held_array[0])
        scored = score_prompt(np.concatenate(rows)[:-1], prompt[1:], asked.prompt_logprobs)
        return logits, held, scored

    def _kept_logits(self, sequence: int, start: bool) -> tuple[np.ndarray, int]:
        """Without a prompt: the logits this model kept after the session's last generation, if the
        session still holds what it held then."""
        if start:
            raise InputError(names.INPUT_IDS, "a new session needs at least one token id to generate from")
        with self.lock:
            logits, kept_length = self.pending.get(sequence, (None, -1))
        held = int(self._step(sequence, np.zeros(0, np.int64))[1][0])  # a step of no ids: the length
        if logits is None or held != kept_length:
            raise NoNextLogits(sequence)
        return logits, held

    def _step(self, sequence: int, ids: np.ndarray, start: bool = False, end: bool = False, last_only: bool = True):
        """One step of the session in `mha_session`: the last position's logits (vocab,) (with `last_only`
        False: every position's, (T, vocab)) and held_length [1]."""
        step = pb_utils.InferenceRequest(
            model_name=self.session_model,
            inputs=[pb_utils.Tensor(names.INPUT_IDS, ids[None])],
            requested_output_names=[names.LOGITS, names.HELD_LENGTH],
            correlation_id=sequence,
            flags=(START if start else 0) | (END if end else 0),
            parameters={names.LAST_ONLY: last_only},
        )
        answer = step.exec()
        if answer.has_error():
            raise StepFailed(answer.error())
        logits = pb_utils.get_output_tensor_by_name(answer, names.LOGITS).as_numpy()
        held = pb_utils.get_output_tensor_by_name(answer, names.HELD_LENGTH).as_numpy().reshape(1)
        if not last_only:
            return logits[0], held.astype(np.int64)
        return (logits[0, -1] if logits.shape[1] else None), held.astype(np.int64)

    def _end_quietly(self, sequence: int) -> None:
        with contextlib.suppress(StepFailed):  # gone already: the session model's idle timeout frees what is left
            self._step(sequence, np.zeros(0, np.int64), end=True)

    def _keep(self, sequence: int, logits: np.ndarray | None, held: int, ended: bool) -> None:
        with self.lock:
            self.pending.pop(sequence, None)
            if not ended and logits is not None:
                self.pending[sequence] = (logits, held)
                while len(self.pending) > PENDING_SESSIONS:
                    self.pending.popitem(last=False)


def score_prompt(logits: np.ndarray, following: np.ndarray, top: int) -> dict[str, np.ndarray]:
    """The prompt's response: `logits` (T-1, vocab) at each prompt position but the last scoring the id that
    follows it (`following`, (T-1,)); the first prompt token's entry is NaN (and no alternatives)."""
    scored = [Sampler.scored(row, int(token), top) for row, token in zip(logits, following, strict=True)]
    ids = np.full((len(scored) + 1, top), -1, np.int64)
    top_logprobs = np.full((len(scored) + 1, top), np.nan, np.float32)
    for at, choice in enumerate(scored, start=1):
        ids[at, : len(choice.top)] = [token for token, _ in choice.top]
        top_logprobs[at, : len(choice.top)] = [logprob for _, logprob in choice.top]
    return {
        generation.PROMPT_LOGPROB: np.array([np.nan] + [choice.logprob for choice in scored], np.float32),
        generation.PROMPT_TOP_TOKEN_IDS: ids,
        generation.PROMPT_TOP_LOGPROBS: top_logprobs,
    }


def _text_files(version, published: str | None) -> dict[str, bytes]:
    """The tokenizer files in the version folder (those its SHA256SUMS lists), checked against it and
    against the digest the config publishes; name -> content."""
    recorded = {name: digest for name, digest in digests.read(version).items() if name in TEXT_FILES}
    digests.verify(version, recorded)  # each file has its recorded digest: the one digest over them follows
    contents = {name: (version / name).read_bytes() for name in recorded}
    found = generation.text_digest(recorded)
    if contents and found != published:
        raise digests.IntegrityError(
            f"{version}: the text files' digest is {found}, the model config publishes {published}; {digests.REWRITE}"
        )
    return contents


def token_outputs(choice) -> dict[str, np.ndarray]:
    """One token's response: its id, its logprob and the top alternatives'."""
    return {
        generation.TOKEN_ID: np.array([choice.token], np.int64),
        generation.LOGPROB: np.array([choice.logprob], np.float32),
        generation.TOP_TOKEN_IDS: np.array([token for token, _ in choice.top], np.int64),
        generation.TOP_LOGPROBS: np.array([logprob for _, logprob in choice.top], np.float32),
    }
