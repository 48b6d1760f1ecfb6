"""What the routes of one app share: the `GatewayState` (settings, accepted keys, the asyncio Triton
client, the served models' metadata, the session store, the metrics), kept on `app.state.gateway`."""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import dataclasses
import logging
import secrets
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Iterator
from typing import Any, TypeVar

from client import AsyncClient, ClientError, ModelInfo
from client.text import TextError, TextModel
from contract import names
from contract.files import TOKENIZER_FILENAME
from contract.integrity import Keyring, derived_secret
from serving.gateway import upstream
from serving.gateway.auth import owner_of
from serving.gateway.errors import (
    ApiError,
    InvalidInput,
    ModelNotFound,
    Overloaded,
    TooManySessions,
    UpstreamFailed,
)
from serving.gateway.limits import TEXT_ROUTES, request_deadline, restore_bound
from serving.gateway.metrics import Metrics
from serving.gateway.quotas import Quotas
from serving.gateway.sessions import GatewaySession, GatewaySessions, SessionIds, tag
from serving.gateway.settings import Settings
from serving.gateway.templates import TemplateWorkers
from serving.gateway.validated import body_bound, text_body_bound

log = logging.getLogger(__name__)
T = TypeVar("T")
CLOSE_TIMEOUT_S = 5.0  # ending a session upstream is best effort: Triton's own idle timeout is the backstop
# until the stateless model's config is known (a Triton that does not answer yet): the old default cap
DEFAULT_REQUEST_TOKENS = 4096
LEARN_INTERVAL_S, LEARN_INTERVAL_MAX_S = 2.0, 60.0  # how often the models' metadata is asked for until Triton answers
OFFLOAD_BYTES = 1 << 20  # bodies (and answers) over this are decoded (encoded) on a worker thread
ENCODE_INLINE_CHARS = 16 << 10  # longer texts are tokenized on a worker thread (about a millisecond's work)


def limit_tokens(setting: int | None, info: ModelInfo) -> int:
    """The gateway's cap on a stateless request's tokens: the model's own (its config publishes it),
    or the setting when that is lower; a setting above the model's cannot be honoured and says so."""
    model = info.facts.get("max_request_tokens")
    if model is None:
        return setting or DEFAULT_REQUEST_TOKENS
    if setting is not None and setting > model:
        log.warning("SERVING_MAX_REQUEST_TOKENS=%d is above the model's own cap of %d tokens: using it", setting, model)
    elif setting is not None and setting < model:
        log.warning(
            "SERVING_MAX_REQUEST_TOKENS=%d is below the model's own cap of %d tokens: longer requests get 400 here",
            setting,
            model,
        )
    return min(setting or model, model)


@dataclasses.dataclass(frozen=True)
class WholeModel:
    """A whole model the OpenAI-compatible routes serve: its id there, the client of the session model that
    generates for it, that model's metadata and its tokenizer."""

    id: str
    client: AsyncClient
    info: ModelInfo
    text: TextModel

    @property
    def max_seq_len(self) -> int:
        return int(self.info.facts.get("max_seq_len", 1 << 30))


class GatewayState:
    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.keys = [key.encode() for key in settings.accepted_keys()]
        # the KV usage of every model set the gateway sends to (the session routes', the OpenAI routes' models)
        model_sets = (settings.session_model, settings.generate_model, *settings.more_served_models.values())
        self.metrics = Metrics(settings.triton_metrics_urls, tuple(dict.fromkeys(m for m in model_sets if m)))
        given = settings.session_secret.get_secret_value() if settings.session_secret else None
        self.secret = given or secrets.token_urlsafe(32)
        # signs the snapshots handed out and the store's entries; its own secret, or one of the session secret's
        self.keyring = Keyring(settings.given_integrity_secrets() or derived_secret(self.secret))
        self.sessions = GatewaySessions(
            settings.sessions_per_key,
            settings.session_idle_s,
            SessionIds(self.secret),
            lambda claim: self.client.session(
                claim.sequence_id, claim.replica, owner=claim.owner, store_key=claim.store_key or None
            ),
            shared=given is not None,
        )
        self.metrics.active_sessions.set_function(lambda: len(self.sessions))
        # the largest body taken: the configured limit, lowered to what the served model can need once
        # its sizes are known (validated.body_bound)
        self.body_limit = settings.max_body_bytes
        # a restore's (POST /v1/sessions): the largest snapshot the session model can produce, once its sizes are
        # known (limits.restore_bound)
        self.restore_limit = settings.max_body_bytes
        # the routes that take text (limits.TEXT_ROUTES) -> their largest body, once every served model's tokenizer
        # is known (validated.text_body_bound); until then the body limit above
        self.text_limits: dict[str, int] = {}
        self.request_tokens = settings.max_request_tokens or DEFAULT_REQUEST_TOKENS  # the model's once learned
        self.large_bodies = 0  # requests with a body over LARGE_BODY_BYTES in flight
        self.responses: Any = None  # the stored responses (responses_api.Records), made at their first use
        self._infos: dict[str, ModelInfo] = {}
        self._owners: dict[str, str] = {}  # accepted key -> owner_of(key): only configured keys get here
        self._client: AsyncClient | None = None
        self._tasks: set[asyncio.Task] = set()  # the sweeper, the models' metadata, ENDs sent after a request
        self._attending = 0  # /v1/attend requests in flight (everything runs on the event loop)
        self.started = int(time.time())  # OpenAI's `created` of the served model
        self.quotas = Quotas(settings)  # what each key's sessions and prefixes hold of the KV cache
        self._texts: dict[str, TextModel] = {}  # per generating session model
        self._text_fetch = asyncio.Lock()
        self._generation_client: AsyncClient | None = None
        self._generators: dict[str, AsyncClient] = {}  # model id on the OpenAI-compatible routes -> its client
        self.openai_sessions: dict[str, int] = {}  # per key: sessions the OpenAI routes' requests hold now
        self.templates = TemplateWorkers(
            settings.template_workers, settings.template_timeout_s, settings.template_memory_mib
        )

    @property
    def client(self) -> AsyncClient:
        assert self._client is not None, "the gateway is not started"
        return self._client

    @property
    def model_id(self) -> str:
        """The served model's id on the OpenAI-compatible routes (`model`, GET /v1/models' `data[].id`)."""
        return self.settings.served_model_name or self.settings.session_model

    def owner(self, key: str) -> str:
        """Who a (valid) key is, as sessions record it; hashed once per key."""
        owner = self._owners.get(key)
        if owner is None:
            owner = self._owners[key] = owner_of(key, self.secret)
        return owner

    async def start(self) -> None:
        s = self.settings
        # few retries: the caller is waiting, and the deadline below bounds the whole call anyway;
        # validate=False: every request was checked once at the edge (validated.py)
        self._client = AsyncClient(
            s.triton_url,
            "grpc",
            s.model,
            s.session_model,
            timeout=s.request_timeout_s,
            retries=2,
            backoff=0.05,
            validate=False,
            session_store=s.session_store or None,
            store_secret=self.keyring.secrets,
            checkpoint_every=s.checkpoint_every,
            recovery_timeout=s.request_timeout_s,  # the request's deadline bounds it anyway
        )
        generating = s.generate_model or s.session_model
        self._generation_client = self._client if generating == s.session_model else self._client.sibling(generating)
        self._generators = {self.model_id: self._generation_client}
        for name, model in s.more_served_models.items():
            self._generators.setdefault(name, self._client.sibling(model))
        self.spawn(self._sweep())
        self.spawn(self._learn_models())
        self.spawn(self._learn_texts())

    async def stop(self) -> None:
        sweeping = [t for t in self._tasks if not t.get_name().startswith("end-")]
        for task in sweeping:
            task.cancel()
        await asyncio.gather(*sweeping, return_exceptions=True)
        await asyncio.gather(*(self.end_upstream(s) for s in self.sessions.drain()))
        await asyncio.gather(*self._tasks, return_exceptions=True)  # ENDs already on their way
        for generator in {id(c): c for c in self._generators.values() if c is not self._client}.values():
            await generator.close()
        await self.client.close()
        self.templates.close()

    def spawn(self, coroutine: Coroutine[Any, Any, Any], name: str | None = None) -> None:
        """Run `coroutine` beside the requests, outside the context of the one that started it (its
        deadline is not the task's); kept until it ends (asyncio holds tasks weakly)."""
        task = asyncio.create_task(coroutine, name=name or coroutine.__name__, context=contextvars.Context())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def model_info(self, model: str) -> ModelInfo:
        """A served model's metadata, asked of Triton once (a model keeps its tensors across reloads)."""
        info = self._infos.get(model)
        if info is None:
            info = await self.call(self.client.metadata(model), f"metadata of '{model}'")
            self._learned(model, info)
        return info

    def _learned(self, model: str, info: ModelInfo) -> None:
        self._infos[model] = info
        self.quotas.learn(model, info)
        if model == self.settings.model:
            s = self.settings
            self.request_tokens = limit_tokens(s.max_request_tokens, info)
            max_seq_len = s.max_seq_len or info.facts.get("max_seq_len") or self.request_tokens
            self.body_limit = min(s.max_body_bytes, body_bound(info, self.request_tokens, max_seq_len))
        if model == self.settings.session_model:
            max_seq_len = self.settings.max_seq_len or info.facts.get("max_seq_len")
            bound = restore_bound(info.facts, max_seq_len) if isinstance(max_seq_len, int) else None
            self.restore_limit = min(self.settings.max_body_bytes, bound or self.settings.max_body_bytes)

    async def _learn_models(self) -> None:
        """Both models' metadata as soon as Triton answers, so that the body bound holds from the first
        request on; a request that needs one before then asks for it itself. While Triton does not
        answer, asked less and less often (each failed ask logs the client's retries)."""
        interval = LEARN_INTERVAL_S
        while True:
            for model in (self.settings.model, self.settings.session_model):
                with contextlib.suppress(ClientError, TimeoutError):
                    async with asyncio.timeout(self.settings.request_timeout_s):
                        if model not in self._infos:
                            self._learned(model, await self.client.metadata(model))
            if len(self._infos) == 2:
                return
            await asyncio.sleep(interval)
            interval = min(2 * interval, LEARN_INTERVAL_MAX_S)

    async def _learn_texts(self) -> None:
        """Every served model's context and tokenizer as soon as Triton answers, then the text routes' body
        limits; a model that takes no text (an attention model, no tokenizer) bounds none of them."""
        interval, pending, sizes = LEARN_INTERVAL_S, set(self.generators()), []
        while True:
            for model_id in sorted(pending):
                try:
                    async with asyncio.timeout(self.settings.request_timeout_s):
                        whole = await self.whole_model(model_id)
                except InvalidInput:  # it takes no text: nothing to bound
                    pending.discard(model_id)
                    continue
                except UpstreamFailed:  # its text files cannot be read: its bodies' bound is not known
                    return
                except (ApiError, ClientError, TimeoutError):  # Triton does not answer yet
                    continue
                longest = await asyncio.to_thread(lambda text=whole.text: text.longest_token_bytes)
                sizes.append((whole.max_seq_len, longest, whole.text.tokenizer.get_vocab_size()))
                pending.discard(model_id)
            if not pending:
                break
            await asyncio.sleep(interval)
            interval = min(2 * interval, LEARN_INTERVAL_MAX_S)
        for path, prompts in TEXT_ROUTES.items() if sizes else ():
            most = max(text_body_bound(*size, prompts(self.settings)) for size in sizes)
            self.text_limits[path] = min(self.settings.max_body_bytes, most)

    async def encode(self, text: TextModel, string: str, add_special_tokens: bool = True) -> list[int]:
        """`text.encode(string)`, on a worker thread when the string is long (the tokenizer lets go of the GIL
        there: a 10 MB prompt takes seconds, and the event loop goes on meanwhile)."""
        if len(string) > ENCODE_INLINE_CHARS:
            return await asyncio.to_thread(text.encode, string, add_special_tokens)
        return text.encode(string, add_special_tokens)

    async def offload(self, nbytes: int, fn: Callable[..., T], *args: Any) -> T:
        """`fn(*args)`, in a worker thread when it works on a large body (megabytes of JSON take the
        event loop for a while: /healthz and the other requests go on meanwhile), inline otherwise."""
        if nbytes > OFFLOAD_BYTES:
            return await asyncio.to_thread(fn, *args)
        return fn(*args)

    @contextlib.asynccontextmanager
    async def attend_slot(self) -> AsyncIterator[None]:
        """One of `attend_concurrency` places for a stateless request, or 429 at once: a queue here
        would only turn overload into timeouts (a 4,096-token request holds the model for seconds)."""
        if self._attending >= self.settings.attend_concurrency:
            raise Overloaded(
                f"{self._attending} stateless requests are in flight, the most this gateway lets through "
                f"(SERVING_ATTEND_CONCURRENCY); retry shortly"
            )
        self._attending += 1
        try:
            yield
        finally:
            self._attending -= 1

    async def call(self, awaitable: Awaitable[T], what: str) -> T:
        """An upstream call within what is left of the request's time (SERVING_REQUEST_TIMEOUT_S)."""
        timeout_s = self.settings.request_timeout_s
        deadline = request_deadline.get() or asyncio.get_running_loop().time() + timeout_s
        return await upstream.call(awaitable, deadline=deadline, timeout_s=timeout_s, metrics=self.metrics, what=what)

    def end_later(self, session: GatewaySession) -> None:
        """Send the session's END beside the request, which does not wait for it: a hung Triton must not
        hold an answer past its deadline."""
        self.spawn(self.end_upstream(session), name=f"end-{tag(session.id)}")

    async def end_upstream(self, session: GatewaySession) -> None:
        """Send the session's END to Triton; failures are logged, not raised (the caller is done with it)."""
        self.quotas.release(session.upstream)  # at once: the key's share is free before the END's answer
        await self._end(session.upstream, f"session {tag(session.id)}")

    async def _end(self, upstream, what: str) -> None:
        loop = asyncio.get_running_loop()
        deadline = min(loop.time() + CLOSE_TIMEOUT_S, request_deadline.get() or float("inf"))  # within a request's
        try:
            async with asyncio.timeout_at(deadline):
                await upstream.close()
        except (ClientError, TimeoutError) as error:
            log.warning("ending %s upstream failed (Triton will expire it): %r", what, error)

    async def generation_client(self) -> AsyncClient:
        """The client of the session model that generates (SERVING_GENERATE_MODEL): the session routes' own, or
        another of the same settings when the repository serves a second model set beside theirs (`python -m
        serving`: the trained model beside the default one)."""
        assert self._generation_client is not None, "the gateway is not started"
        return self._generation_client

    @property
    def generate_model(self) -> str:
        return self.settings.generate_model or self.settings.session_model

    def generators(self) -> dict[str, AsyncClient]:
        """Each model id of the OpenAI-compatible routes -> the client of the session model that generates."""
        assert self._generators, "the gateway is not started"
        return self._generators

    @contextlib.contextmanager
    def in_flight(self, owner: str, sessions: int) -> Iterator[None]:
        """A request's sessions (an OpenAI request's choices, a stateless generation) counted against the key's
        SERVING_SESSIONS_PER_KEY while it runs, beside the sessions the key holds (the rows the server keeps for
        prefix reuse do not: it ends them when it needs the room); 429 past it."""
        in_flight, limit = self.openai_sessions, self.settings.sessions_per_key
        held = self.sessions.held_by(owner) + in_flight.get(owner, 0)
        if held + sessions > limit:
            raise TooManySessions(
                f"this request needs {sessions} session(s) while it runs; this API key holds {held} (open sessions "
                f"and requests in flight), the limit is {limit}: retry when one ends"
            )
        in_flight[owner] = in_flight.get(owner, 0) + sessions
        try:
            yield
        finally:
            left = in_flight[owner] - sessions
            if left:
                in_flight[owner] = left
            else:
                del in_flight[owner]

    def generating_models(self) -> list[str]:
        """The session models that generate for the OpenAI-compatible routes beside the session routes' own."""
        own = self.settings.session_model
        return list(dict.fromkeys(c.session_model for c in self.generators().values() if c.session_model != own))

    def generator(self, model_id: str) -> AsyncClient:
        """The client of the session model that generates for `model_id`; 404 for an id not served here."""
        generators = self.generators()
        # an id of before, where the session model's name is the id (`mha_session`), is today's (`sessions`)
        client = generators.get(model_id) or generators.get(names.current_model_name(model_id))
        if client is None:
            served = ", ".join(f"'{name}'" for name in generators)
            raise ModelNotFound(f"model: no model '{model_id}' here; this gateway serves {served}", param="model")
        return client

    async def whole_model(self, model_id: str) -> WholeModel:
        """The whole model the OpenAI-compatible routes serve as `model_id`: 404 for an id not served here, 400
        for an attention model (hidden states in and out) or one without a tokenizer."""
        client = self.generator(model_id)
        info = await self.model_info(client.session_model)
        if info.vocab_size is None:
            raise InvalidInput(
                f"model: '{model_id}' is an attention model (hidden states in and out): only a whole model (token "
                "ids in, logits out) with a tokenizer takes text",
                param="model",
            )
        return WholeModel(model_id, client, info, await self.text(client))

    async def text(self, client: AsyncClient | None = None) -> TextModel:
        """The tokenizer (client/text.py) of a generating model (the default one's unless `client` names
        another), fetched once and checked against the digest its config publishes; 400 when it serves none."""
        client = client or await self.generation_client()
        async with self._text_fetch:  # the first requests at once: one fetch
            if client.session_model not in self._texts:
                self._texts[client.session_model] = await self._fetched_text(client)
        return self._texts[client.session_model]

    async def _fetched_text(self, client: AsyncClient) -> TextModel:
        fetched = await self.call(client.text_files(), "the model's tokenizer files")
        if fetched is None:
            raise InvalidInput(
                f"'{client.session_model}' serves no tokenizer (its checkpoint had no "
                f"{TOKENIZER_FILENAME}): it takes token ids (POST /v1/generate), not text"
            )
        digest, files = fetched
        try:
            return await asyncio.to_thread(TextModel.from_files, files)
        except TextError as error:
            raise UpstreamFailed(f"the model's text files (digest {digest[:12]}) cannot be read: {error}") from None

    async def _sweep(self) -> None:
        interval = min(self.settings.session_idle_s / 2, 10.0)
        while True:
            await asyncio.sleep(interval)
            expired = self.sessions.idle()
            if expired:
                log.info("closing %d idle session(s)", len(expired))
                await asyncio.gather(*(self.end_upstream(s) for s in expired))
            if self.sessions.shared:  # idle sessions are forgotten here without an END: their shares too
                self.quotas.forget_idle(self.settings.session_idle_s)
