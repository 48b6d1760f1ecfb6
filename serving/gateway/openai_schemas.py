"""The bodies of the OpenAI-compatible routes (`/v1/completions`, `/v1/chat/completions`), as OpenAI's API
reference defines them, with the extensions vLLM's server accepts (`top_k`, `min_p`, `repetition_penalty`,
`ignore_eos`) and ours (`session`). A field OpenAI defines that would change the answer and that we do not do
(`suffix`, `logit_bias`, ...) is refused by name (400), never ignored; other unknown fields (`user`, `metadata`,
`store`, ...) are accepted and change nothing, as OpenAI's own server does. Structured outputs and tools
(`response_format`, vLLM's `guided_*` and `structured_outputs`, `tools`, `tool_choice`, `parallel_tool_calls`)
are read from the extra fields by serving/gateway/structured.py."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StrictStr

from contract.sampling import LOGIT_BIAS_LIMIT, MAX_LOGPROBS, PENALTY_LIMIT

# fields that change what a request means, which these routes do not do: named in the 400
REFUSED = {
    "suffix": "insertion (a suffix after the completion) is not supported",
    "functions": "the deprecated functions are not supported: give them as `tools`",
    "function_call": "the deprecated function_call is not supported: use `tool_choice`",
    "audio": "audio output is not supported",
    "modalities": "only text output is supported",
    "prediction": "predicted outputs are not supported",
}

HARMLESS = {"modalities": (["text"],)}  # values of a refused field that ask what is done anyway


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: StrictBool = Field(default=False, description="a last chunk with `usage` and no choices")


class Common(BaseModel):
    """What both routes take."""

    model_config = ConfigDict(extra="allow")

    model: StrictStr = Field(description="the served model's id (GET /v1/models, `data[].id`)")
    temperature: StrictFloat | StrictInt = Field(default=1.0, ge=0, le=2, description="0: greedy")
    top_p: StrictFloat | StrictInt = Field(default=1.0, gt=0, le=1, description="nucleus sampling")
    n: StrictInt = Field(default=1, ge=1, le=16, description="choices of one prompt, sharing its KV cache by fork")
    stream: StrictBool = Field(default=False, description="Server-Sent Events, `data: [DONE]` at the end")
    stream_options: StreamOptions | None = None
    stop: StrictStr | list[StrictStr] | None = Field(
        default=None,
        description="strings (up to SERVING_MAX_STOP_STRINGS); the text ends before the first one met (left out)",
    )
    seed: StrictInt | None = Field(default=None, ge=0, lt=1 << 63, description="the same text for the same request")
    presence_penalty: StrictFloat | StrictInt = Field(default=0.0, ge=-PENALTY_LIMIT, le=PENALTY_LIMIT)
    frequency_penalty: StrictFloat | StrictInt = Field(default=0.0, ge=-PENALTY_LIMIT, le=PENALTY_LIMIT)
    logit_bias: dict[str, StrictFloat | StrictInt] | None = Field(
        default=None,
        description=f"token id (as a string) -> a bias in [-{LOGIT_BIAS_LIMIT}, {LOGIT_BIAS_LIMIT}] added to its logit "
        "before sampling (-100 bans it, 100 all but forces it)",
    )
    # vLLM's extensions
    top_k: StrictInt | None = Field(default=None, ge=-1, description="keep the k most likely tokens (-1, 0: all)")
    min_p: StrictFloat | StrictInt | None = Field(default=None, ge=0, le=1)
    repetition_penalty: StrictFloat | StrictInt = Field(default=1.0, gt=0)
    ignore_eos: StrictBool = Field(default=False, description="go on past the end-of-text token")
    # structured outputs (serving/gateway/structured.py): OpenAI's, then vLLM's
    response_format: dict[str, Any] | None = Field(
        default=None,
        description='{"type": "text" | "json_object"} or {"type": "json_schema", "json_schema": {"name", "schema", '
        '"strict"}}: the text constrained to a JSON object, or to a JSON value of the schema',
    )
    guided_json: dict[str, Any] | StrictStr | None = Field(default=None, description="vLLM's: a JSON schema")
    guided_regex: StrictStr | None = Field(default=None, description="vLLM's: a regular expression")
    guided_choice: list[StrictStr] | None = Field(default=None, description="vLLM's: one of these strings")
    guided_grammar: StrictStr | None = Field(default=None, description="vLLM's: a Lark (or GBNF) grammar")
    structured_outputs: dict[str, Any] | None = Field(
        default=None, description='vLLM\'s newer form: {"json" | "regex" | "choice" | "grammar" | "json_object": ...}'
    )
    # ours
    session: StrictStr | None = Field(
        default=None,
        description="a session this key holds (POST /v1/sessions): the request goes on in it, sending only the "
        "tokens its prompt adds to what the session holds (rewound to where they part)",
    )

    def stops(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    def refused(self) -> list[tuple[str, str]]:
        """(field, why) for each field given that these routes do not do."""
        extra = self.model_extra or {}
        return [
            (name, why)
            for name, why in REFUSED.items()
            if extra.get(name) not in (None, [], {}, "", *HARMLESS.get(name, ()))
        ]


class CompletionBody(Common):
    """POST /v1/completions."""

    prompt: StrictStr | list[StrictStr] | list[StrictInt] | list[list[StrictInt]] = Field(
        description="text, texts (a choice set each), token ids or lists of token ids"
    )
    max_tokens: StrictInt | None = Field(default=16, ge=0, description="new tokens at most (0 with echo: score only)")
    max_completion_tokens: StrictInt | None = Field(
        default=None, ge=0, description="as max_tokens, and taken before it (chat's name, sent by some clients)"
    )
    best_of: StrictInt | None = Field(default=None, ge=1, description="equal to n: each choice is answered")
    logprobs: StrictInt | None = Field(
        default=None, ge=0, le=MAX_LOGPROBS, description="each token's logprob and the top N alternatives'"
    )
    echo: StrictBool = Field(default=False, description="the prompt before the completion (its logprobs too)")


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")  # `name`, tool fields: passed to the chat template as given

    role: StrictStr
    content: StrictStr | list[dict[str, Any]] | None = None


class ChatBody(Common):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage] = Field(min_length=1, description="the conversation, rendered by the chat template")
    max_tokens: StrictInt | None = Field(default=None, ge=0, description="deprecated by OpenAI: max_completion_tokens")
    max_completion_tokens: StrictInt | None = Field(default=None, ge=0, description="new tokens at most")
    logprobs: StrictBool = Field(default=False, description="each token's logprob")
    top_logprobs: StrictInt | None = Field(default=None, ge=0, le=MAX_LOGPROBS, description="and the top N's")
    add_generation_prompt: StrictBool = Field(default=True, description="end with the assistant's header")
    tools: list[dict[str, Any]] | None = Field(
        default=None,
        description='functions the model may call: [{"type": "function", "function": {"name", '
        '"description", "parameters"}}], given to the chat template',
    )
    tool_choice: StrictStr | dict[str, Any] | None = Field(
        default=None,
        description='"none", "auto" (the default with tools: read in the model\'s own format), "required" (the text '
        'constrained to calls) or {"type": "function", "function": {"name": ...}}',
    )
    parallel_tool_calls: StrictBool | None = Field(default=None, description="false: at most one call (default true)")
    chat_template_kwargs: dict[str, Any] | None = Field(default=None, description="more variables for the template")
