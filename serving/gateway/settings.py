"""The gateway's settings, read from the environment (prefix `SERVING_`) by pydantic-settings.

Every field is one environment variable: `api_keys` is `SERVING_API_KEYS`, `triton_url` is
`SERVING_TRITON_URL`, and so on. Values given to `Settings(...)` directly win over the
environment (the tests and `python -m serving` pass theirs that way).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Literal

from pydantic import Field, SecretStr, field_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from contract import names
from serving.gateway.model_server import checked_url

LOOPBACK = "127.0.0.1"


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="SERVING_", frozen=True, extra="ignore")

    # NoDecode: the variable is comma-separated text, not the JSON list pydantic-settings expects
    api_keys: Annotated[tuple[str, ...], NoDecode] = Field(
        default=(), description="accepted API keys, comma-separated; none configured = auth disabled"
    )
    api_keys_file: Path | None = Field(
        default=None, description="a file with one API key per line (blank lines and # comments ignored)"
    )
    triton_url: str = Field(default="127.0.0.1:8001", description="Triton's gRPC address, host:port")
    model: str = Field(default=names.MODEL, description="the stateless Triton model")
    session_model: str = Field(
        default=names.SESSION_MODEL, description="the session model (decoupled: its engine core keeps the sessions)"
    )
    generate_model: str | None = Field(
        default=None,
        description="the session model of a whole model whose engine generates for the OpenAI-compatible routes and "
        "POST /v1/generate (unset: session_model); a repository serving two model sets names the second here",
    )
    host: str = Field(default=LOOPBACK, description="address to bind; loopback unless told")
    port: int = Field(default=8080, ge=0, le=65535, description="the HTTP port (0: one the system picks)")
    max_body_bytes: int = Field(default=64 * 2**20, gt=0, description="larger request bodies get 413")
    request_timeout_s: float = Field(default=30.0, gt=0, description="per request, upstream included; past it 504")
    sessions_per_key: int = Field(default=16, ge=1, description="open sessions one API key may hold; past it 429")
    kv_bytes_per_key: int | None = Field(
        default=None,
        gt=0,
        description="bytes of KV cache one API key's sessions and named prefixes may hold together (a position "
        "counted as 2 x n_layers x n_kv_heads x head_dim x 4 bytes: the cache's dtype is not published, so "
        "float32, the widest); a step, generation, open or prefix past it gets 429 `quota_exceeded` (unset: "
        "kv_share_per_key of the session model's KV budget, which its config publishes)",
    )
    kv_share_per_key: float = Field(
        default=0.5,
        gt=0,
        le=1,
        description="when kv_bytes_per_key is unset, the share of the session model's KV budget one API key may "
        "hold: with 0.5 no key can take more than half, so no key can keep every other key out (a model that "
        "does not publish its budget: the share of the serving default, 2 GiB)",
    )
    prefixes_per_key: int = Field(
        default=8, ge=0, description="named prefixes one API key may hold; past it PUT /v1/prefixes gets 429"
    )
    prefix_bytes_per_key: int | None = Field(
        default=None,
        gt=0,
        description="bytes of KV cache one API key's named prefixes may hold, within kv_bytes_per_key (prefixes "
        "never expire, sessions do; unset: half the key's kv_bytes_per_key, the rest kept for its sessions)",
    )
    session_idle_s: float = Field(default=300.0, gt=0, description="a session unused this long is closed")
    session_store: str | None = Field(
        default=None,
        description="where sessions write checkpoints so that one whose Triton replica dies is rebuilt on another at "
        "its next step: a directory, or a redis:// URL; `none` or empty: sessions are not durable (unset: not "
        "durable either, but python -m serving gives a folder of its own, removed at its end)",
    )
    checkpoint_every: int = Field(
        default=256,
        ge=1,
        description="a durable session writes the positions it added to the store every this many positions (the "
        "steps since are replayed after a loss)",
    )
    session_secret: SecretStr | None = Field(
        default=None,
        description="signs session ids; give every gateway replica the same one and any of them serves any "
        "session (unset: a random secret, sessions belong to this process)",
    )
    integrity_secrets: SecretStr | None = Field(
        default=None,
        description="signs the snapshots handed out and the session store's entries (HMAC-SHA256), comma-separated "
        "for a rotation: the first signs, every one verifies; give every gateway sharing a store the same (unset: "
        "one derived from the session secret, so snapshots restore and stored sessions rebuild wherever that is "
        "shared, and only in this process when that is random)",
    )
    readiness_timeout_s: float = Field(
        default=3.0, gt=0, description="how long /readyz waits for Triton's answers to its probe"
    )
    attend_concurrency: int = Field(
        default=8, ge=1, description="/v1/attend requests in flight at once; past it 429 with Retry-After at once"
    )
    large_body_concurrency: int = Field(
        default=2,
        ge=1,
        description="requests with bodies over 8 MiB in flight at once (decoding megabytes of JSON numbers takes "
        "several times their size); past it 429 with Retry-After at once",
    )
    max_seq_len: int | None = Field(
        default=None,
        ge=1,
        description="the served model's max_seq_len, for the largest body a valid request can need (unset: what "
        "the model's config publishes); larger bodies get 413 before they are read",
    )
    max_request_tokens: int | None = Field(
        default=None,
        ge=1,
        description="/v1/attend: batch x new tokens one request may carry; past it 400 (unset: the served "
        "model's own cap, from its config; a value above the model's is lowered to it)",
    )
    http_server: Literal["uvicorn", "uvicorn-plain", "granian"] = Field(
        default="uvicorn",
        description="the HTTP server: uvicorn with httptools and uvloop, each answer written in one piece; uvicorn as "
        "it comes (uvicorn-plain); granian's ASGI server (measured slower here: docs/design.md)",
    )
    hot_routes: bool = Field(
        default=True,
        description="call the routes every token pays for directly, without FastAPI's per-request work "
        "(serving/gateway/hot_path.py; false: FastAPI dispatches every route, as measured against in docs/design.md)",
    )
    gc_freeze: bool = Field(
        default=False,
        description="gc.freeze() after start-up: what start-up made is left out of every later collection (measured "
        "as noise here: docs/design.md)",
    )
    workers: int = Field(
        default=1,
        ge=1,
        description="gateway processes on the one port (python -m serving.gateway, which python -m serving runs too); "
        "they share a session secret, so any of them steps any session, but each counts sessions per key and "
        "busy steps on its own",
    )
    served_model_name: str | None = Field(
        default=None,
        description="the model's id on the OpenAI-compatible routes (`model` in a request, GET /v1/models' "
        "`data[].id`); unset: the session model's name",
    )
    more_served_models: dict[str, str] = Field(
        default={},
        description="more whole models the OpenAI-compatible routes serve beside served_model_name: each id mapped "
        "to the Triton session model that generates for it, as JSON (`python -m serving FOLDER FOLDER...` sets it)",
    )
    template_workers: int = Field(
        default=2,
        ge=1,
        le=64,
        description="processes that render chat templates (a model folder's code), off the gateway's event loop",
    )
    template_timeout_s: float = Field(
        default=5.0, gt=0, description="one chat template render's time limit; past it a 400 and its worker killed"
    )
    template_memory_mib: int = Field(
        default=1024, ge=256, description="a template worker's address-space limit; a render needing more is a 400"
    )
    max_stop_strings: int = Field(
        default=64,
        ge=1,
        le=4096,
        description="stop strings one OpenAI request may give (OpenAI's own API takes 4; lm-eval sends more)",
    )
    tool_call_parser: Literal["template", "hermes", "llama3_json", "mistral"] = Field(
        default="template",
        description="how tool_choice 'auto' reads the calls in a model's text (serving/gateway/structured.py): "
        "hermes (<tool_call>, Qwen2.5/3), llama3_json (Llama 3.x), mistral ([TOOL_CALLS]); template: the format "
        "the model's chat template names",
    )
    triton_metrics_urls: Annotated[tuple[str, ...], NoDecode] = Field(
        default=(),
        description="Triton's Prometheus endpoints (http://host:port/metrics), comma-separated: where the KV cache "
        "utilization the gateway exports on /metrics is read; a host name is read at every address it resolves to "
        "(a headless Service's name: every replica); none: that gauge is left out",
    )
    log_level: str = Field(default="info", description="uvicorn's log level: critical, error, warning, info, debug")

    @field_validator("model", "session_model", "generate_model")
    @classmethod
    def _current_name(cls, value: str | None) -> str | None:
        # a deployment's environment may hold the names of before (SERVING_SESSION_MODEL=mha_session)
        return value and names.current_model_name(value)

    @field_validator("more_served_models")
    @classmethod
    def _current_names(cls, value: dict[str, str]) -> dict[str, str]:
        return {served: names.current_model_name(model) for served, model in value.items()}

    @field_validator("session_store", mode="before")
    @classmethod
    def _no_store(cls, value: object) -> object:
        return "" if isinstance(value, str) and value.strip().lower() == "none" else value

    @field_validator("api_keys", mode="before")
    @classmethod
    def _split_keys(cls, value: object) -> object:
        if isinstance(value, str):
            return tuple(key.strip() for key in value.split(",") if key.strip())
        return value

    @field_validator("triton_metrics_urls", mode="before")
    @classmethod
    def _split_urls(cls, value: object) -> object:
        if isinstance(value, str):
            value = [url.strip() for url in value.split(",") if url.strip()]
        if isinstance(value, (list, tuple)):
            return tuple(checked_url(url) if isinstance(url, str) else url for url in value)
        return value

    def accepted_keys(self) -> tuple[str, ...]:
        """Every accepted key: the list plus the file's lines (read now, so a rotated file is seen
        on the next start)."""
        keys = list(self.api_keys)
        if self.api_keys_file is not None:
            keys += read_keys_file(self.api_keys_file)
        return tuple(dict.fromkeys(keys))

    def given_integrity_secrets(self) -> list[str]:
        """SERVING_INTEGRITY_SECRETS, split at commas (none given: [])."""
        text = self.integrity_secrets.get_secret_value() if self.integrity_secrets else ""
        return [secret.strip() for secret in text.split(",") if secret.strip()]

    @property
    def auth_enabled(self) -> bool:
        return bool(self.accepted_keys())

    def bind_host(self) -> str:
        """Without keys the gateway serves loopback only, whatever `host` says: an open gateway
        must not be reachable from the network."""
        return self.host if self.auth_enabled else LOOPBACK


def read_keys_file(path: Path) -> list[str]:
    try:
        lines = path.read_text().splitlines()
    except OSError as error:
        raise ValueError(f"SERVING_API_KEYS_FILE {path}: cannot read it ({error.strerror})") from error
    return [line.strip() for line in lines if line.strip() and not line.lstrip().startswith("#")]


def settings_environment(settings: Settings) -> dict[str, str]:
    """The SERVING_* variables that make `settings` again in another process (`python -m serving`'s gateway
    process): every field that is not None, in the form its variable is read."""
    return {
        f"SERVING_{name.upper()}": _as_variable(value)
        for name in Settings.model_fields
        if (value := getattr(settings, name)) is not None
    }


def _as_variable(value: object) -> str:
    if isinstance(value, SecretStr):
        return value.get_secret_value()
    if isinstance(value, tuple):  # the NoDecode fields: comma-separated
        return ",".join(value)
    if isinstance(value, dict):
        return json.dumps(value)
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def settings_help() -> str:
    """Every setting as an environment variable with its default and meaning (`--help`, the guide)."""
    lines = []
    for name, field in Settings.model_fields.items():
        default = field.default if field.default not in ((), None) else "(none)"
        lines.append(f"  SERVING_{name.upper()}  default {default}: {field.description}")
    return "\n".join(lines)
