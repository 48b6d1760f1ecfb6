"""The engine core: one loop that owns a served model's batch (vLLM v1's EngineCore, onnxruntime-genai's
Engine). Every request of the session model is a request to it: a session's steps, its operations
(snapshot, restore, fork, rewind, prefixes, attention maps), generations, and stops; no Triton model calls
another, and no thread runs per request.

Any thread submits (`submit`: Triton's execute(), a test, a benchmark); the core's thread runs the loop, and
each request is answered through its `Responder` (the Triton model sends from a thread of its own, so that a
response's trip to Triton overlaps the next graph run: ONNX Runtime releases the GIL while it runs). Each
iteration of the loop (`iterate`):

1. take what was submitted: each request joins its session's queue (a session's requests run in the order
   they came); a stop marks its session's generation at once;
2. begin what the sessions' queues hold, first come first served: an operation, or a step of no tokens (open,
   close, a length asked), runs at once; a step of tokens or a generation becomes the session's work, which
   lasts over several iterations (a long prompt is stepped in chunks; a generation decodes a token each);
3. schedule under the token budget (`CoreSettings.step_tokens`): every decoding row's one token, then chunks
   of waiting prompts in arrival order, so that a joining prompt holds the decoders up for at most one chunk;
4. run the model once over all of it (`StepEngine.execute`: the static engine runs every decoding row in one
   graph run per cache window, and each prefill chunk as a run of its own: GroupQueryAttention takes several
   new tokens onto a past for one row at a time);
5. sample every generation that has logits now, together (serving/engine/sampler.py), answer each its token,
   and finish those that are done.

A generation answers each token as soon as it is picked; the token is stepped into the session by the next
iteration's decode. When a generation ends, its last token is stepped too before the final response, unless
the session ends with it, so the session holds the prompt and exactly the tokens answered. A generation with
no new ids goes on from what the session holds: the core knows each session's ids (a whole model's), so it
steps the last one again (a rewind by one and one token), whoever generated it.

Prefix reuse (`reuse_prefix`): a generation that starts a session looks among its owner's kept rows for the
one that shares the longest prefix with its prompt, takes it over where the prompt goes on from all it holds (a
conversation's next turn) or starts as a copy of it rewound to where they part, and prefills only the rest;
when it ends with its session, its row is kept for the next request instead of freed (per owner at most
`kept_per_owner`, least recently used first out; evicted when the KV budget has no room for a new session: the
least recently used of the owners holding more than an equal share first). Only the owner's own rows are read:
another owner's request never reuses them, and learns nothing of them.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import logging
import threading
import time
from collections.abc import Callable, Hashable, Mapping, Sequence
from typing import Any, Protocol

import numpy as np

from contract import generation, names
from contract.inputs import InputError, real_tokens
from serving.engine import constraint as grammar_masks
from serving.engine import errors, operations
from serving.engine.constraint import Constraint
from serving.engine.sampler import Pick, Sampler, sample, score_prompt
from serving.engine.steps import StepEngine, StepRequest, check_step, no_result

log = logging.getLogger(__name__)

SequenceId = Hashable
Outputs = Mapping[str, np.ndarray]
# the fewest shared ids worth a copy of a kept row: a copy and a rewind cost about what a prefill of this many
# tokens costs on the CPU (chosen, not tuned); every chat template's opening markers are shared by all of an
# owner's conversations and would otherwise copy an unrelated one
MIN_SHARED = 16
KEPT = "kept"  # a kept row's sequence id is (KEPT, n): never a client's (Triton's ids are ints or strings)


class Responder(Protocol):
    """Where a request's answers go. `send` a non-final response (a token, a prompt's scores); `finish` the
    final one, exactly once (outputs, or an error); `cancelled`: whether the client went away (the core asks
    it at a bounded rate, from a thread of its own, for running generations only)."""

    def send(self, outputs: Outputs) -> None: ...

    def finish(self, outputs: Outputs | None = None, error: Exception | None = None) -> None: ...

    def cancelled(self) -> bool: ...


@dataclasses.dataclass(frozen=True)
class CoreSettings:
    step_tokens: int = 256  # new tokens one iteration runs: every decoding row's, then prompt chunks
    min_chunk: int = 32  # a waiting prompt's chunk when the decoders take the whole budget (it must progress)
    kept_per_owner: int = 8  # rows kept for prefix reuse per owner (0: none kept)
    generations_per_owner: int = 16  # an owner's running generations; more wait their turn (0: no cap)
    cancel_check_s: float = 0.05  # how often each running generation's client is asked whether it left
    tick_s: float = 1.0  # the loop's wake-up when idle: idle eviction, gauges (at once when a session starts or ends)

    def __post_init__(self) -> None:
        if self.step_tokens < 1 or not 1 <= self.min_chunk <= self.step_tokens:
            raise ValueError(f"need step_tokens >= 1 and 1 <= min_chunk <= step_tokens, got {self}")
        if self.kept_per_owner < 0 or self.generations_per_owner < 0:
            raise ValueError(f"kept_per_owner and generations_per_owner must be >= 0, got {self}")


# --- requests -----------------------------------------------------------------------------------------------


@dataclasses.dataclass(eq=False)
class Request:
    sequence_id: SequenceId
    responder: Responder
    owner: str = ""  # who it is for: whose kept rows a generation may reuse, whose running generations it counts in
    priority: int = 0  # lower first among waiting generations (then first come first served)
    arrival: float = dataclasses.field(default_factory=time.monotonic)


@dataclasses.dataclass(eq=False)
class Step(Request):
    """A session's step (names.model_input's tokens), or a START or END of no tokens."""

    step: StepRequest | None = None


@dataclasses.dataclass(eq=False)
class Operate(Request):
    """A session operation (names.OPERATIONS): `parameters` as the request sent them, with its snapshot input."""

    step: StepRequest | None = None
    parameters: dict[str, Any] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(eq=False)
class Generate(Request):
    """A generation in the session: `prompt` (T,) int64 new ids (none: go on from what it holds)."""

    prompt: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros(0, np.int64))
    asked: generation.GenerationRequest = dataclasses.field(default_factory=generation.GenerationRequest)
    constraint: Constraint | None = None  # asked.grammar compiled (Grammars.compile), off the loop's thread


@dataclasses.dataclass(eq=False)
class Stop(Request):
    """Stop the session's generation before its next token (its final response says where it stands)."""


# --- what the core knows of a session -----------------------------------------------------------------------


class TokenLog:
    """A session's token ids, in order (int32: a growing buffer, not a list of Python ints)."""

    def __init__(self, ids: Sequence[int] | np.ndarray = ()) -> None:
        ids = np.asarray(ids, np.int32)
        self._ids = np.zeros(max(16, 2 * len(ids)), np.int32)
        self._ids[: len(ids)] = ids
        self.length = len(ids)

    def extend(self, ids: Sequence[int] | np.ndarray) -> None:
        ids = np.asarray(ids, np.int32).reshape(-1)
        if self.length + len(ids) > len(self._ids):
            grown = np.zeros(2 * (self.length + len(ids)), np.int32)
            grown[: self.length] = self._ids[: self.length]
            self._ids = grown
        self._ids[self.length : self.length + len(ids)] = ids
        self.length += len(ids)

    def cut(self, length: int) -> None:
        self.length = min(self.length, length)

    @property
    def ids(self) -> np.ndarray:
        return self._ids[: self.length]

    def copy(self) -> TokenLog:
        return TokenLog(self.ids)


@dataclasses.dataclass(eq=False)
class Kept:
    """A row kept for prefix reuse: the sequence holding it, whose it is, its ids."""

    sequence_id: SequenceId
    owner: str
    ids: np.ndarray
    last_used: float


def shared_prefix(held: np.ndarray, prompt: np.ndarray) -> int:
    """How many leading ids `held` and `prompt` share."""
    n = min(len(held), len(prompt))
    differ = np.flatnonzero(held[:n] != prompt[:n])
    return int(differ[0]) if differ.size else n


class KeptRows:
    """Rows kept for prefix reuse, by owner, and all of them in the order of last use (eviction's)."""

    def __init__(self, per_owner: int) -> None:
        self.per_owner = per_owner
        self._by_owner: dict[str, dict[SequenceId, Kept]] = {}
        self._lru: collections.OrderedDict[SequenceId, Kept] = collections.OrderedDict()
        self._numbers = itertools.count()

    def __len__(self) -> int:
        return len(self._lru)

    def __contains__(self, sequence_id: SequenceId) -> bool:
        return sequence_id in self._lru

    def new_id(self) -> tuple[str, int]:
        return (KEPT, next(self._numbers))

    def longest(self, owner: str, prompt: np.ndarray) -> tuple[Kept | None, int]:
        """The owner's kept row sharing the longest prefix with `prompt` (at least MIN_SHARED ids, and at least
        one id of the prompt left to step), and the length shared; (None, 0) when none does."""
        best, best_length = None, MIN_SHARED - 1
        for kept in self._by_owner.get(owner, {}).values():
            length = min(shared_prefix(kept.ids, prompt), len(prompt) - 1)
            if length > best_length:
                best, best_length = kept, length
        if best is None:
            return None, 0
        self._touch(best)
        return best, best_length

    def add(self, kept: Kept) -> list[SequenceId]:
        """Keep `kept`; the sequences the owner's cap pushes out (to be ended)."""
        mine = self._by_owner.setdefault(kept.owner, {})
        mine[kept.sequence_id] = kept
        self._lru[kept.sequence_id] = kept
        out = []
        while len(mine) > self.per_owner:
            oldest = min(mine.values(), key=lambda entry: entry.last_used)
            out.append(self.remove(oldest.sequence_id))
        return out

    def remove(self, sequence_id: SequenceId) -> SequenceId:
        kept = self._lru.pop(sequence_id)
        mine = self._by_owner[kept.owner]
        del mine[sequence_id]
        if not mine:
            del self._by_owner[kept.owner]
        return sequence_id

    def least_recent(self) -> SequenceId | None:
        return next(iter(self._lru), None)

    def victim(self) -> SequenceId | None:
        """The row to end when the KV budget needs room: the least recently used of the owners holding more
        than an equal share of the kept rows, else the least recently used of all. One owner's many rows go
        before another's few: a key that fills the budget ends its own conversations first, not every key's."""
        if not self._lru:
            return None
        share = len(self._lru) / len(self._by_owner)
        over = {owner for owner, mine in self._by_owner.items() if len(mine) > share}
        return next((sid for sid, kept in self._lru.items() if kept.owner in over), next(iter(self._lru)))

    def _touch(self, kept: Kept) -> None:
        kept.last_used = time.monotonic()
        self._lru.move_to_end(kept.sequence_id)


# --- work that lasts several iterations ---------------------------------------------------------------------


class Work:
    """A session's request in progress: what it asks of the next iteration, and what it does with the answer."""

    request: Request
    done: bool = False

    @property
    def decoding(self) -> bool:
        """Whether its next step is one token (scheduled with the decoders, outside the prefill budget)."""
        raise NotImplementedError

    def waiting_tokens(self) -> int:
        """The tokens it has left to step (a prefill's)."""
        raise NotImplementedError

    def next_step(self, tokens: int) -> StepRequest | None:
        """Its step of at most `tokens` new tokens for this iteration (None: nothing this iteration)."""
        raise NotImplementedError

    def took(self, result: np.ndarray | Exception) -> bool:
        """The engine's answer to its step; whether it has logits to sample from now."""
        raise NotImplementedError


class StepWork(Work):
    """A client's step of T tokens, in chunks of what the budget gives; answered once its last chunk ran:
    every real position's output (or the last one's, `last_only`), `held_length`. A padded step runs whole
    (its last real token may lie in any chunk)."""

    def __init__(self, core: EngineCore, request: Step) -> None:
        check_step(core.cfg, request.step)  # a bad step is refused before anything runs
        self.core, self.request = core, request
        step = request.step
        self.total, self.sent, self.outputs = step.hidden.shape[1], 0, []
        self.padded = step.mask is not None and not step.mask.all()
        held = 0 if step.start else max(core.engine.length(step.sequence_id), 0)
        self.reserve = held + len(real_tokens(step.hidden, step.mask)[0])

    @property
    def decoding(self) -> bool:
        return self.total == 1

    def waiting_tokens(self) -> int:
        return self.total - self.sent

    def next_step(self, tokens: int) -> StepRequest:
        step, begin = self.request.step, self.sent
        end = self.total if self.padded else min(self.total, begin + tokens)
        self.sent = end
        return dataclasses.replace(
            step,
            start=step.start and begin == 0,
            end=step.end and end == self.total,
            hidden=step.hidden[:, begin:end],
            mask=None if step.mask is None else step.mask[:, begin:end],
            reserve=self.reserve if begin == 0 else 0,
        )

    def took(self, result: np.ndarray | Exception) -> bool:
        if isinstance(result, Exception):
            self.done = True
            self.core.answer_error(self.request, result)
            return False
        if not self.request.step.last_only or self.sent == self.total:
            self.outputs.append(result)
        if self.sent == self.total:
            self.done = True
            output = self.outputs[0] if len(self.outputs) == 1 else np.concatenate(self.outputs, axis=1)
            self.core.stepped(self.request, output)
        return False


PREFILL, DECODE, FINISHING = "prefill", "decode", "finishing"


class GenerationWork(Work):
    """A generation: its prompt in chunks, then a token each iteration, picked with the others of the step
    (serving/engine/sampler.py); answered token by token, then a final response with the finish reason, the
    positions the session holds and the prompt ids it reused (`cached_tokens`)."""

    def __init__(self, core: EngineCore, request: Generate) -> None:
        self.core, self.request, self.asked = core, request, request.asked
        self.sequence_id = request.sequence_id
        self.prompt = request.prompt  # the ids still to step
        self.prompt_ids = request.prompt  # what the repetition penalty counts besides the tokens
        self.sampler = Sampler(self.asked.sampling, prompt_ids=request.prompt.tolist())
        self.constraint = request.constraint
        self.state, self.stopping, self.reason = PREFILL, False, generation.LENGTH
        self.produced = 0
        self.pending: int | None = None  # a picked token not yet stepped into the session
        self.logits: np.ndarray | None = None
        self.cached = 0  # prompt ids reused from a kept row
        self.start = self.asked.session_start
        self.reserve = 0
        self.scored: list[np.ndarray] = []  # every prompt position's logits (prompt_logprobs)
        self.chunk: StepRequest | None = None  # the last prefill chunk sent
        self.stopped_at: int | None = None  # the core's step count when its stop arrived

    # --- scheduling -------------------------------------------------------------------------------------

    @property
    def decoding(self) -> bool:
        return self.state != PREFILL

    def waiting_tokens(self) -> int:
        return len(self.prompt) if self.state == PREFILL else 1

    def next_step(self, tokens: int) -> StepRequest | None:
        if self.state == PREFILL:
            return self._prefill_chunk(tokens)
        if self.pending is None:
            return None
        ids = np.array([[self.pending]], np.int64)
        return StepRequest(self.sequence_id, start=False, end=False, hidden=ids, last_only=True)

    def _prefill_chunk(self, tokens: int) -> StepRequest:
        chunk, self.prompt = self.prompt[:tokens], self.prompt[tokens:]
        self.chunk = StepRequest(
            self.sequence_id,
            start=self.start,
            end=False,
            hidden=chunk[None],
            last_only=self.asked.prompt_logprobs is None,
            reserve=self.reserve,
        )
        return self.chunk

    def not_run(self) -> None:
        """Its last chunk was refused room: it goes back, to be sent again."""
        self.prompt = np.concatenate([self.chunk.hidden[0], self.prompt])

    # --- answers ----------------------------------------------------------------------------------------

    def took(self, result: np.ndarray | Exception) -> bool:
        if isinstance(result, Exception):
            self.core.finish_generation(self, error=result)
            return False
        if self.state == PREFILL:
            self.core.log_tokens(self.sequence_id, self.chunk.hidden[0], start=self.chunk.start)
            self.start, self.reserve = False, 0
            if self.asked.prompt_logprobs is not None:
                self.scored.append(result[0])
            if len(self.prompt):
                return False
            self._prompt_scored()
            self.state = DECODE
        else:  # its pending token is in the session now
            self.core.log_tokens(self.sequence_id, [self.pending])
            self.pending = None
            if self.state == FINISHING:
                self.core.finish_generation(self)
                return False
        if self.asked.max_new_tokens == 0 or self._stopped() or self._full():
            self.core.finish_generation(self)
            return False
        self.logits = result[0, -1]
        return True

    def _full(self) -> bool:
        """Whether the session holds max_seq_len positions: no room for another token."""
        if self.core.engine.length(self.sequence_id) < self.core.cfg.max_seq_len:
            return False
        self.reason = generation.SESSION_FULL
        return True

    def _prompt_scored(self) -> None:
        """The prompt's scores, answered before its first token (prompt_logprobs)."""
        if self.asked.prompt_logprobs is None or not len(self.prompt_ids):
            return
        logits = np.concatenate(self.scored)[:-1]  # each position scores the id that follows it
        self.request.responder.send(score_prompt(logits, self.prompt_ids[1:], self.asked.prompt_logprobs))

    def _stopped(self) -> bool:
        if self.stopping:
            self.reason = generation.CANCELLED
        return self.stopping

    def picked(self, choice: Pick) -> None:
        """Its next token, picked with the step's others: answered now, stepped into the session next."""
        self.logits, self.pending = None, choice.token
        self.produced += 1
        self.request.responder.send(token_outputs(choice))
        held = self.core.engine.length(self.sequence_id)
        if self.constraint is not None:
            self.constraint.consume(choice.token)
        if choice.token in self.asked.stop_token_ids or (self.constraint is not None and self.constraint.stopped):
            self.reason = generation.STOP
        elif self.produced >= self.asked.max_new_tokens:
            self.reason = generation.LENGTH
        elif held + 1 >= self.core.cfg.max_seq_len:  # its pending token fills the row
            self.reason = generation.SESSION_FULL
        elif not self._stopped():
            return
        self.finishing()

    def finishing(self) -> None:
        """No more tokens: its pending one is stepped in first where the session outlives it."""
        if self.pending is None or (self.asked.session_end and not self.asked.reuse_prefix):
            self.core.finish_generation(self)
        else:
            self.state = FINISHING


# --- the core -------------------------------------------------------------------------------------------------


@dataclasses.dataclass
class CoreStats:
    """What the core's gauges say (published a few times a second, and when asked)."""

    running: int = 0  # generations decoding or prefilling, and steps in progress
    waiting: int = 0  # requests queued behind their session's, or generations waiting for their turn
    kept: int = 0  # rows kept for prefix reuse
    iterations: int = 0  # loop iterations that ran the model
    decode_runs: int = 0  # the last such iteration's decode graph runs
    decode_rows: int = 0  # the rows those runs stepped
    most_decode_rows: int = 0  # the most rows one decode graph run has stepped so far
    most_decode_runs: int = 0  # the most decode graph runs one step has taken so far (one pool: 1)
    most_stop_steps: int = 0  # the most steps a stopped generation ran after its stop arrived, so far
    prefill_runs: int = 0  # the last iteration's prefill chunks
    step_tokens: int = 0  # the last iteration's new tokens
    step_seconds: float = 0.0  # the last iteration's engine time
    prefill_chunk_seconds: float = 0.0  # the engine time of the last iteration that ran a prefill chunk
    tokens_generated: int = 0  # since the start
    masked_rows: int = 0  # the last step's rows picked under a grammar's mask
    mask_fill_seconds: float = 0.0  # the time their masks took to fill (on the grammars' thread, beside the run)
    mask_wait_seconds: float = 0.0  # how much of it the loop waited for after the graph run (what it cost a step)
    prompt_tokens_reused: int = 0  # since the start: prompt ids a kept row saved


class EngineCore:
    """The loop over `engine` (static or concat): see the module."""

    def __init__(
        self,
        engine: StepEngine,
        settings: CoreSettings | None = None,
        publish: Callable[[CoreStats], None] | None = None,
    ) -> None:
        """`publish(stats)`: called from the loop's thread a few times a second when the stats changed."""
        self.engine, self.cfg = engine, engine.cfg
        self.settings = settings or CoreSettings()
        self._publish, self._published, self._sessions_published = publish, None, 0
        self._inbox: collections.deque[Request] = collections.deque()
        self._wake = threading.Condition()
        self._queues: dict[SequenceId, collections.deque[Request]] = {}
        self._work: dict[SequenceId, Work] = {}  # each session's request in progress
        self._ids: dict[SequenceId, TokenLog] = {}  # what each session holds, where known (a whole model's)
        self._prefix_ids: dict[tuple[str, str], np.ndarray] = {}
        self._kept = KeptRows(self.settings.kept_per_owner)
        self.stats = CoreStats()
        self._stopping = False
        self._next_tick = 0.0
        self._watched: list[GenerationWork] = []  # the running generations the watcher asks about
        self._watch_lock = threading.Lock()
        self._watch_changed = threading.Condition(self._watch_lock)  # the watcher sleeps on it while none runs
        self._thread: threading.Thread | None = None
        self._watcher: threading.Thread | None = None

    # --- lifecycle ----------------------------------------------------------------------------------------

    def start(self) -> EngineCore:
        self._thread = threading.Thread(target=self._loop, name="engine-core", daemon=True)
        self._watcher = threading.Thread(target=self._watch, name="engine-core-watcher", daemon=True)
        self._thread.start()
        self._watcher.start()
        return self

    def stop(self, timeout: float = 10.0) -> None:
        """Stop the loop; what is still queued or running is answered with an error."""
        with self._wake:
            self._stopping = True
            self._wake.notify()
        with self._watch_changed:
            self._watch_changed.notify()
        for thread in (self._thread, self._watcher):
            if thread is not None:
                thread.join(timeout)
        gone = errors.ServingError("the model is stopping: the request was not run")
        for request in [*self._inbox, *(r for queue in self._queues.values() for r in queue)]:
            request.responder.finish(error=gone)
        for work in self._work.values():
            if not work.done:
                work.request.responder.finish(error=gone)

    def submit(self, request: Request) -> None:
        """Hand a request to the loop (any thread)."""
        with self._wake:
            self._inbox.append(request)
            self._wake.notify()

    def _loop(self) -> None:
        while True:
            with self._wake:
                if self._stopping:
                    return
                if not self._inbox and not self._work and not self._ready_sessions():
                    self._wake.wait(max(0.001, self._next_tick - time.monotonic()))
                    if self._stopping:
                        return
            try:
                self.iterate()
            except Exception:  # a bug of ours: logged, and the loop goes on for every other request
                log.exception("engine core iteration failed")
            self._tick()

    def _ready_sessions(self) -> bool:
        return any(queue and sid not in self._work for sid, queue in self._queues.items())

    def _tick(self) -> None:
        """A few times a second: idle eviction and the gauges; the gauges at once when a session started or
        ended (a drain waits for the live sessions' count to reach 0)."""
        now = time.monotonic()
        if now < self._next_tick:
            if self._publish is not None and self.engine.sequences() != self._sessions_published:
                self._publish_stats()
            return
        self._next_tick = now + self.settings.tick_s
        for sid in self.engine.evict_idle():
            self._forget(sid)
            if sid in self._kept:
                self._kept.remove(sid)
        self._publish_stats()

    # --- one iteration --------------------------------------------------------------------------------------

    def iterate(self) -> bool:
        """One iteration of the loop (see the module); whether it ran the model."""
        self._take_inbox()
        self._begin_ready()
        planned = self._plan()
        if not planned:
            self._count()
            return False
        self._run(planned)
        self._count()
        return True

    def _take_inbox(self) -> None:
        with self._wake:
            taken, self._inbox = self._inbox, collections.deque()
        for request in taken:
            if isinstance(request, Stop):
                self._stop_generation(request)
            else:
                self._queues.setdefault(request.sequence_id, collections.deque()).append(request)

    def _stop_generation(self, stop: Stop) -> None:
        work = self._work.get(stop.sequence_id)
        if isinstance(work, GenerationWork):
            self.stopping(work)
        for queued in list(self._queues.get(stop.sequence_id, ())):
            if isinstance(queued, Generate):  # stopped before it began: nothing was stepped
                self._queues[stop.sequence_id].remove(queued)
                self._answer_final(queued, generation.CANCELLED, self.engine.length(stop.sequence_id), 0)
        stop.responder.finish({})

    def _begin_ready(self) -> None:
        """Each idle session's queued requests: operations and steps of no tokens run now; the first step of
        tokens or generation becomes the session's work (generations in order of priority, then arrival,
        within their owner's cap)."""
        running = self._running_by_owner()
        ready = sorted(
            (queue[0].priority, queue[0].arrival, sid)
            for sid, queue in self._queues.items()
            if queue and sid not in self._work
        )
        for _, _, sid in ready:
            queue = self._queues[sid]
            while queue and sid not in self._work:
                request = queue[0]
                if isinstance(request, Generate) and self._over_cap(request, running):
                    break
                queue.popleft()
                self._begin(request, running)
            if not queue:
                del self._queues[sid]

    def _running_by_owner(self) -> collections.Counter:
        return collections.Counter(
            work.request.owner for work in self._work.values() if isinstance(work, GenerationWork)
        )

    def _over_cap(self, request: Generate, running: collections.Counter) -> bool:
        cap = self.settings.generations_per_owner
        return bool(cap and request.owner and running[request.owner] >= cap)

    def _begin(self, request: Request, running: collections.Counter) -> None:
        if request.sequence_id in self._kept:  # a kept row's id is the core's own
            self.answer_error(request, errors.SequenceEnded(request.sequence_id))
            return
        try:
            if isinstance(request, Operate):
                self._operate(request)
            elif isinstance(request, Generate):
                self._work[request.sequence_id] = self._generation(request)
                running[request.owner] += 1
            elif _no_tokens(request.step):
                self._step_now(request)
            else:
                self._work[request.sequence_id] = StepWork(self, request)
        except (errors.ServingError, InputError) as error:
            self.answer_error(request, error)

    # --- what runs at once ----------------------------------------------------------------------------------

    def _step_now(self, request: Step) -> None:
        """A step of no tokens: a START (room taken now), an END, a length asked."""
        (result,) = self._execute_with_room([request.step])
        if isinstance(result, Exception):
            self.answer_error(request, result)
            return
        sid = request.step.sequence_id
        if request.step.start:
            self._ids[sid] = TokenLog() if self.cfg.whole else None
        if request.step.end:
            self._forget(sid)
        self.stepped(request, result, logged=True)

    def _operate(self, request: Operate) -> None:
        step, parameters = request.step, request.parameters
        name = parameters.get(names.OPERATION)
        source_ids = self._ids_before_operation(name, step, parameters)
        if name == names.SNAPSHOT_OPERATION:
            parameters = {**parameters, operations.TOKEN_IDS: self._known_ids(step.sequence_id)}
        answered = self._with_room(lambda: operations.run(self.engine, step, parameters))
        self._ids_after_operation(name, step, parameters, source_ids)
        held = np.array([[self.engine.length(step.sequence_id)]], np.int64)
        outputs = {names.model_output(self.cfg): no_result(self.cfg), names.HELD_LENGTH: held}
        request.responder.finish({**outputs, **answered})

    def _ids_before_operation(self, name: str, step: StepRequest, parameters: dict) -> TokenLog | None:
        """The ids an operation's new session will hold, where known (a fork's source's, a prefix's)."""
        if not self.cfg.whole:
            return None
        if name == names.FORK:
            source = self._ids.get(parameters.get(names.FORK_OF))
            return None if source is None else source.copy()
        if name == names.FROM_PREFIX:
            key = (parameters.get(names.OWNER, ""), parameters.get(names.PREFIX))
            ids = self._prefix_ids.get(key)
            return None if ids is None else TokenLog(ids)
        if name == names.RESTORE:
            found = operations.snapshot_token_ids(parameters.get(names.SNAPSHOT))
            return None if found is None else TokenLog(found)
        return None

    def _ids_after_operation(self, name: str, step: StepRequest, parameters: dict, source: TokenLog | None) -> None:
        sid = step.sequence_id
        if name in (names.FORK, names.FROM_PREFIX, names.RESTORE):
            self._ids[sid] = source
        elif name == names.REWIND and self._ids.get(sid) is not None:
            self._ids[sid].cut(self.engine.length(sid))
        elif name == names.PUT_PREFIX and self.cfg.whole:
            key = (parameters.get(names.OWNER, ""), parameters.get(names.PREFIX))
            self._prefix_ids[key] = real_tokens(step.hidden, step.mask)[0].astype(np.int32)
        elif name == names.DELETE_PREFIX:
            self._prefix_ids.pop((parameters.get(names.OWNER, ""), parameters.get(names.PREFIX)), None)

    def _known_ids(self, sid: SequenceId) -> np.ndarray | None:
        log_ = self._ids.get(sid)
        return None if log_ is None else log_.ids.copy()

    # --- generations ------------------------------------------------------------------------------------------

    def _generation(self, request: Generate) -> GenerationWork:
        """A generation's work, its session ready: started (a copy of a kept row when one shares its prompt),
        or rewound by one to step its last token again when it brings no ids; room taken for all it may hold."""
        work = GenerationWork(self, request)
        sid, asked = request.sequence_id, request.asked
        if asked.reuse_prefix and asked.session_start and asked.prompt_logprobs is None and len(request.prompt):
            self._from_kept(work)
        if not len(work.prompt):
            self._resume(work)
        held = 0 if work.start else max(self.engine.length(sid), 0)
        work.reserve = min(self.cfg.max_seq_len, held + len(work.prompt) + asked.max_new_tokens)
        self._watch_generation(work)
        return work

    def _from_kept(self, work: GenerationWork) -> None:
        """The longest kept row of the owner that shares the prompt's beginning: taken over where the prompt goes
        on from all it holds (a conversation's next turn: no copy; a copy would fault in a fresh row's pages,
        which took 10 ms of 25 for a 4,000-position next turn here, measured), copied and rewound where it parts
        earlier (it stays kept: `n` choices of one prompt each start from it)."""
        kept, shared = self._kept.longest(work.request.owner, work.prompt)
        if kept is None:
            return
        sid = work.sequence_id
        if shared == len(kept.ids) and self.engine.length(kept.sequence_id) == shared:
            self._kept.remove(kept.sequence_id)
            self.engine.rename(kept.sequence_id, sid, aside=False)
        else:
            try:
                self._with_room(lambda: self.engine.fork(kept.sequence_id, sid))
            except errors.SequenceError:  # evicted for idleness meanwhile: the prompt is prefilled whole
                self._kept.remove(kept.sequence_id)
                return
            self.engine.rewind(sid, shared)
        self._ids[sid] = TokenLog(kept.ids[:shared])
        work.prompt, work.cached, work.start = work.prompt[shared:], shared, False
        self.stats.prompt_tokens_reused += shared

    def _resume(self, work: GenerationWork) -> None:
        """No new ids: the session's last token stepped again gives the logits to go on from."""
        sid = work.sequence_id
        if work.start:
            raise InputError(names.INPUT_IDS, "a new session needs at least one token id to generate from")
        held = self.engine.length(sid)
        known = self._ids.get(sid)
        if held < 0:  # the engine says why it is gone (ended, evicted, never started)
            (gone,) = self.engine.execute([StepRequest(sid, False, False, np.zeros((1, 0), np.int64))])
            raise gone if isinstance(gone, Exception) else errors.UnknownSequence(sid)
        if held == 0 or known is None or known.length != held:
            raise InputError(
                names.INPUT_IDS,
                f"session {sid}: no token ids given, and the server does not know the ids the session holds "
                f"(it was restored from a snapshot that does not carry them, or holds none): send at least one",
            )
        last = int(known.ids[-1])
        self.engine.rewind(sid, held - 1)
        known.cut(held - 1)
        work.prompt = np.array([last], np.int64)

    def _watch_generation(self, work: GenerationWork) -> None:
        with self._watch_changed:
            self._watched.append(work)
            self._watch_changed.notify()

    def stopping(self, work: GenerationWork) -> None:
        """A generation asked to stop (its client's stop, or the watcher found it gone): it ends at the next step."""
        if not work.stopping:
            work.stopping, work.stopped_at = True, self.stats.iterations

    def finish_generation(self, work: GenerationWork, error: Exception | None = None) -> None:
        """The generation's end: its session ended (a stateless generation), kept for reuse, or left as it
        stands; then its final response."""
        work.done = True
        if work.stopped_at is not None:
            steps = self.stats.iterations - work.stopped_at
            self.stats.most_stop_steps = max(self.stats.most_stop_steps, steps)
        with self._watch_lock:
            self._watched = [watched for watched in self._watched if watched is not work]
        request, asked, sid = work.request, work.asked, work.sequence_id
        if error is not None and asked.session_end:
            self._end_quietly(sid)
        if error is not None:
            request.responder.finish(error=error)
            return
        held = self.engine.length(sid)
        if asked.session_end:
            if asked.reuse_prefix and held > 0 and self._keep_row(work):
                held = -1
            else:
                self._end_quietly(sid)
                held = -1
        self.stats.tokens_generated += work.produced
        self._answer_final(request, work.reason, held, work.cached)

    def _answer_final(self, request: Request, reason: str, held: int, cached: int) -> None:
        request.responder.finish(
            {
                generation.FINISH_REASON: np.array([reason.encode()], np.object_),
                names.HELD_LENGTH: np.array([held], np.int64),
                generation.CACHED_TOKENS: np.array([cached], np.int64),
            }
        )

    def _keep_row(self, work: GenerationWork) -> bool:
        """The ended generation's row kept for prefix reuse under its owner: renamed to a kept id (the client's
        id ends), the row moved aside from the live ones (StaticSessionEngine.rename); False when nothing is
        kept (none may be, or its ids are unknown)."""
        ids = self._ids.get(work.sequence_id)
        if self.settings.kept_per_owner == 0 or ids is None or ids.length != self.engine.length(work.sequence_id):
            return False
        kept_id = self._kept.new_id()
        self.engine.rename(work.sequence_id, kept_id)
        self._forget(work.sequence_id)
        kept = Kept(kept_id, work.request.owner, ids.ids.copy(), time.monotonic())
        for pushed in self._kept.add(kept):
            self._end_quietly(pushed)
        return True

    # --- the model run ---------------------------------------------------------------------------------------

    def _plan(self) -> list[tuple[Work, StepRequest]]:
        """This iteration's steps: every decoding work's one token, then prompt chunks in arrival order within
        the token budget (the oldest waiting prompt gets at least `min_chunk`: it must progress)."""
        planned: list[tuple[Work, StepRequest]] = []
        waiting: list[Work] = []
        for work in self._work.values():
            if isinstance(work, GenerationWork) and work.stopping and work.state == PREFILL and work.asked.session_end:
                work.reason = generation.CANCELLED  # a stateless generation's client left: nothing to keep
                self.finish_generation(work)
            elif work.decoding:
                step = work.next_step(1)
                if step is not None:
                    planned.append((work, step))
            else:
                waiting.append(work)
        budget = self.settings.step_tokens - len(planned)
        for rank, work in enumerate(sorted(waiting, key=lambda w: w.request.arrival)):
            allowed = max(budget, self.settings.min_chunk) if rank == 0 else budget
            if allowed <= 0:
                break
            tokens = min(work.waiting_tokens(), allowed)
            planned.append((work, work.next_step(tokens)))
            budget -= tokens
        self._work = {sid: work for sid, work in self._work.items() if not work.done}
        return planned

    def _run(self, planned: list[tuple[Work, StepRequest]]) -> None:
        runs = self.engine.runs
        before = (runs.decode_runs, runs.decode_rows, runs.prefill_runs)
        masking = self._masks_soon(planned)
        started = time.perf_counter()
        results = self._execute_with_room([step for _, step in planned])
        seconds = time.perf_counter() - started
        self._record(before, seconds, sum(step.hidden.shape[1] for _, step in planned))
        sampled: list[GenerationWork] = []
        for (work, _), result in zip(planned, results, strict=True):
            if isinstance(result, errors.CacheFull) and isinstance(work, GenerationWork) and self._waits(work):
                continue
            if work.took(result) and isinstance(work, GenerationWork):
                sampled.append(work)
        if sampled:
            self._sample(sampled, self._masks(masking, sampled))
        self._work = {sid: work for sid, work in self._work.items() if not work.done}

    def _masks_soon(self, planned: list[tuple[Work, StepRequest]]) -> tuple[list[GenerationWork], Any] | None:
        """The grammar masks of the constrained generations this iteration may sample (each decoding one with a
        token to step, each whose last prompt chunk runs now), filled on the grammars' thread while the graph
        runs (the mask of a token's successor needs only the token: llguidance releases the GIL)."""
        works = [
            work
            for work, _ in planned
            if isinstance(work, GenerationWork)
            and work.constraint is not None
            and (work.state == DECODE or (work.state == PREFILL and not len(work.prompt)))
        ]
        if not works:
            return None
        return works, grammar_masks.masks_soon([work.constraint for work in works])

    def _masks(self, masking: tuple[list[GenerationWork], Any] | None, sampled: list[GenerationWork]) -> list:
        """Each sampled generation's mask (None: unconstrained), from the fill `_masks_soon` began: every
        constrained generation that samples now was among those it filled for."""
        waited = time.perf_counter()
        rows, fill_seconds = {}, 0.0
        if masking is not None:
            works, future = masking
            filled, fill_seconds = future.result()
            rows = dict(zip(works, filled, strict=True))
        stats = self.stats
        stats.masked_rows = sum(work.constraint is not None for work in sampled)
        stats.mask_fill_seconds, stats.mask_wait_seconds = fill_seconds, time.perf_counter() - waited
        return [None if work.constraint is None else rows[work] for work in sampled]

    def _sample(self, sampled: list[GenerationWork], masks: list) -> None:
        """Every generation with logits picks its token, together; where the batch is refused (a row's logits
        not finite, an id outside the vocabulary), each row alone, and a refused one ends with its error."""
        try:
            logits = np.stack([work.logits for work in sampled])
            choices = sample(logits, [work.sampler for work in sampled], masks)
        except ValueError:  # LogitsError, InputError: one row's; no sampler moved
            for work, mask in zip(sampled, masks, strict=True):
                try:
                    (choice,) = sample(work.logits[None], [work.sampler], [mask])
                except ValueError as error:  # answered as its kind: a server fault, or the request's own
                    self.finish_generation(work, error=error)
                    continue
                self._picked(work, choice)
            return
        for work, choice in zip(sampled, choices, strict=True):
            self._picked(work, choice)

    def _picked(self, work: GenerationWork, choice: Pick) -> None:
        try:
            work.picked(choice)
        except errors.ServingError as error:  # its grammar refused the token its mask allowed
            self.finish_generation(work, error=error)

    def _waits(self, work: GenerationWork) -> bool:
        """A generation refused room for its prompt and tokens waits for other generations to end (its chunk
        goes back, to be sent again); False when none runs that would free any (it is then refused)."""
        if not any(isinstance(other, GenerationWork) and other is not work for other in self._work.values()):
            return False
        work.not_run()
        return True

    def _record(self, before: tuple[int, int, int], seconds: float, tokens: int) -> None:
        runs, stats = self.engine.runs, self.stats
        stats.iterations += 1
        stats.decode_runs = runs.decode_runs - before[0]
        stats.decode_rows = runs.decode_rows - before[1]
        stats.prefill_runs = runs.prefill_runs - before[2]
        stats.most_decode_rows = runs.most_decode_rows
        stats.most_decode_runs = max(stats.most_decode_runs, stats.decode_runs)
        stats.step_tokens, stats.step_seconds = tokens, seconds
        if stats.prefill_runs:
            stats.prefill_chunk_seconds = seconds

    def _execute_with_room(self, steps: list[StepRequest]) -> list:
        """engine.execute, where a step refused room for its START or growth is tried again after the least
        recently used kept rows are ended, while any are kept."""
        results = self.engine.execute(steps)
        while len(self._kept):
            full = [i for i, result in enumerate(results) if isinstance(result, errors.CacheFull)]
            if not full:
                break
            self._evict_kept()
            retried = self.engine.execute([steps[i] for i in full])
            for i, result in zip(full, retried, strict=True):
                results[i] = result
        return results

    def _with_room(self, run: Callable[[], Any]) -> Any:
        """`run()` (an operation), tried again after kept rows are ended while it is refused room."""
        while True:
            try:
                return run()
            except errors.CacheFull:
                if not len(self._kept):
                    raise
                self._evict_kept()

    def _evict_kept(self) -> None:
        sid = self._kept.victim()
        if sid is not None:
            self._end_quietly(self._kept.remove(sid))

    def _end_quietly(self, sid: SequenceId) -> None:
        self.engine.execute([StepRequest(sid, False, True, np.zeros((1, 0), self._token_dtype()))])
        self._forget(sid)

    def _token_dtype(self) -> Any:
        return np.int64 if self.cfg.whole else np.float32

    def _forget(self, sid: SequenceId) -> None:
        self._ids.pop(sid, None)

    # --- answers ---------------------------------------------------------------------------------------------

    def log_tokens(self, sid: SequenceId, ids: Sequence[int] | np.ndarray, start: bool = False) -> None:
        """`ids` went into the session (a generation's prompt chunk or token)."""
        if start:
            self._ids[sid] = TokenLog()
        known = self._ids.get(sid)
        if known is not None:
            known.extend(ids)

    def stepped(self, request: Step, output: np.ndarray, logged: bool = False) -> None:
        """A client's step answered: its output and the positions the session holds now."""
        step = request.step
        if not logged and self.cfg.whole:
            self.log_tokens(step.sequence_id, real_tokens(step.hidden, step.mask)[0], start=step.start)
        if step.end:
            self._forget(step.sequence_id)
        held = np.array([[self.engine.length(step.sequence_id)]], np.int64)
        request.responder.finish({names.model_output(self.cfg): output, names.HELD_LENGTH: held})

    def answer_error(self, request: Request, error: Exception) -> None:
        request.responder.finish(error=error)
        if isinstance(request, Step) and request.step is not None and request.step.end:
            self._forget(request.step.sequence_id)

    # --- gauges and the watcher ------------------------------------------------------------------------------

    def _count(self) -> None:
        self.stats.running = len(self._work)
        self.stats.waiting = sum(len(queue) for queue in self._queues.values())
        self.stats.kept = len(self._kept)

    def _publish_stats(self) -> None:
        """The core's stats and its engine's cache stats to `publish`, when either changed."""
        if self._publish is None:
            return
        now = (dataclasses.astuple(self.stats), self.engine.stats())
        self._sessions_published = now[1].sequences
        if now != self._published:
            self._published = now
            self._publish(dataclasses.replace(self.stats))

    def _watch(self) -> None:
        """Asks each running generation's client whether it left (Triton's is_cancelled costs a round trip to
        its process: 0.1 to 0.3 ms, GIL released), every `cancel_check_s`; one that left is stopped. Asleep
        while no generation runs (an idle server wakes for nothing)."""
        while not self._stopping:
            with self._watch_changed:
                while not self._watched and not self._stopping:
                    self._watch_changed.wait()
            time.sleep(self.settings.cancel_check_s)
            with self._watch_lock:
                watched = list(self._watched)
            for work in watched:
                if not work.done and not work.stopping and work.request.responder.cancelled():
                    with self._wake:  # the loop reads it at its next step
                        self.stopping(work)
                        self._wake.notify()


def _no_tokens(step: StepRequest) -> bool:
    """A step that computes nothing (a START or END alone, a length asked), or one missing its tokens (its
    check then says so)."""
    return step.hidden is None or step.hidden.ndim < 2 or step.hidden.shape[1] == 0


def token_outputs(choice: Pick) -> dict[str, np.ndarray]:
    """One token's response: its id, its logprob, and the top alternatives' where asked (`logprobs`): each
    tensor of a response is a trip through Triton's shared memory (4 tensors took about 1.5x one, measured)."""
    outputs = {
        generation.TOKEN_ID: np.array([choice.token], np.int64),
        generation.LOGPROB: np.array([choice.logprob], np.float32),
    }
    if choice.top:
        outputs[generation.TOP_TOKEN_IDS] = np.array([token for token, _ in choice.top], np.int64)
        outputs[generation.TOP_LOGPROBS] = np.array([logprob for _, logprob in choice.top], np.float32)
    return outputs
