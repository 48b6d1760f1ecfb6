"""Text in and out for a served model: its checkpoint's tokenizer (`tokenizer.json`, read by the `tokenizers`
library), its special tokens, its chat template rendered in jinja2's sandbox, and streamed text that never
takes back what it sent.

`TextModel` reads the text files a Hugging Face checkpoint carries (contract/files.py TEXT_FILES) and gives
the same ids and text as transformers' `AutoTokenizer` on that folder (`encode`, `decode`, `chat_ids`;
tests/client/test_text.py holds them against transformers) without importing transformers or torch.
`Detokenizer` turns generated ids into text one token at a time, holding back what is not final yet: the
bytes of a character a later token completes, and text that may be the start of a stop string.

This module is optional for the client (the `text` extra): `client/__init__.py` does not import it.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import re
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Tokenizer

from client import chat_template
from contract.files import (
    CHAT_TEMPLATE_FILENAME,
    GENERATION_CONFIG_FILENAME,
    MAX_TOKENIZER_BYTES,
    SPECIAL_TOKENS_FILENAME,
    TEXT_FILES,
    TOKENIZER_CONFIG_FILENAME,
    TOKENIZER_FILENAME,
)

REPLACEMENT_CHARACTER = "\ufffd"  # what a decode gives for bytes that are not (yet) a whole UTF-8 character
# transformers' named special tokens: the chat template sees each one the tokenizer sets, by this name
NAMED_SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
# the prompt's last tokens a Detokenizer decodes the first generated ones after (vLLM's
# INITIAL_INCREMENTAL_DETOKENIZATION_OFFSET): enough for a decoder whose output depends on the token before
PROMPT_CONTEXT_TOKENS = 5
# transformers copies a message's reasoning under each of these names: the first is the one templates read
REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")
# texts every tokenizer must encode, tried at the build and at the load (`tokenizer_probe_failure`): a long run of
# one character then another, which a backtracking regex of its pre-tokenizer or normalizer ("(a+)+$") cannot
# match within its limit (its panic then answered every such prompt with an error); the characters below and
# the letters and digits the tokenizer's own regexes name
PROBE_RUN = 4096
PROBE_CHARACTERS = "aA0 .\n-'"
PROBE_REGEX_LETTERS = 16  # the most letters and digits taken from the tokenizer's regexes


class TextError(Exception):
    """Base of every error this module raises."""


class TextUnavailable(TextError):
    """The model has no tokenizer: its `tokenizer.json` is missing (`.filename`)."""

    def __init__(self, message: str, filename: str) -> None:
        super().__init__(message)
        self.filename = filename


class TextFileInvalid(TextError):
    """One of the text files cannot be read: not UTF-8, not JSON, or a field of the wrong type (`.filename`)."""

    def __init__(self, message: str, filename: str) -> None:
        super().__init__(message)
        self.filename = filename


class ChatTemplateUnavailable(TextError):
    """The model has no chat template (or several and none named "default")."""


class EncodeFailed(TextError, ValueError):
    """The tokenizer failed on a text (its pre-tokenizer's regex past its backtracking limit, most often)."""


class ChatTemplateError(TextError, ValueError):
    """The chat template refused the conversation: its `raise_exception`, a sandbox violation, a syntax error
    in the template, or messages it cannot render (`.message` is the template's own message)."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


@dataclasses.dataclass(frozen=True)
class SpecialTokens:
    """The named special tokens as text, for the chat template and for the ids below."""

    named: dict[str, str]  # "bos_token" -> "<s>", ...: the standard names and the model's own `*_token` keys
    extra: tuple[str, ...]  # extra_special_tokens: special (skipped by decode) but not named


class TextModel:
    """A checkpoint's tokenizer, special tokens and chat template. Build it with `from_folder` or `from_files`."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        special: SpecialTokens,
        generation_config: Mapping[str, Any],
        chat_template: str | dict[str, str] | None,
        decoder: Mapping[str, Any] | None,
        clean_up_spaces: bool = False,
    ) -> None:
        self.tokenizer = tokenizer
        self.special = special
        self.chat_template = chat_template
        self._generation_config = dict(generation_config)
        self._token_bytes = _token_bytes_reader(tokenizer, decoder)
        # transformers cleans up "word ." into "word." on decode only where the model is not a BPE
        self._clean_up_spaces = clean_up_spaces and type(tokenizer.model).__name__ != "BPE"

    @functools.cached_property
    def longest_token_bytes(self) -> int:
        """The most bytes one token adds to a text: how long a text of n tokens can be (a body's bound)."""
        vocab = self.tokenizer.get_vocab_size(with_added_tokens=True)
        return max((len(self._token_bytes(token)) for token in range(vocab)), default=1)

    @classmethod
    def from_folder(cls, path: str | Path) -> TextModel:
        """Read the text files (contract/files.py TEXT_FILES) of a checkpoint, artifact or model version folder."""
        folder = Path(path)
        if not (folder / TOKENIZER_FILENAME).is_file():
            raise TextUnavailable(
                f"{folder} has no {TOKENIZER_FILENAME}: the model has no tokenizer", TOKENIZER_FILENAME
            )
        files = {name: (folder / name).read_bytes() for name in TEXT_FILES if (folder / name).is_file()}
        return cls.from_files(files)

    @classmethod
    def from_files(cls, files: Mapping[str, bytes]) -> TextModel:
        """Build from the text files' contents by file name; only `tokenizer.json` is required."""
        if TOKENIZER_FILENAME not in files:
            raise TextUnavailable(
                f"no {TOKENIZER_FILENAME} among the text files {sorted(files)}: the model has no tokenizer",
                TOKENIZER_FILENAME,
            )
        if len(files[TOKENIZER_FILENAME]) > MAX_TOKENIZER_BYTES:
            raise TextFileInvalid(
                f"{TOKENIZER_FILENAME} is {len(files[TOKENIZER_FILENAME]) >> 20} MiB, more than the "
                f"{MAX_TOKENIZER_BYTES >> 20} MiB a tokenizer is taken at",
                TOKENIZER_FILENAME,
            )
        tokenizer_json = _json_object(files, TOKENIZER_FILENAME)
        config = _json_object(files, TOKENIZER_CONFIG_FILENAME) if TOKENIZER_CONFIG_FILENAME in files else {}
        generation = _json_object(files, GENERATION_CONFIG_FILENAME) if GENERATION_CONFIG_FILENAME in files else {}
        special_map = _json_object(files, SPECIAL_TOKENS_FILENAME) if SPECIAL_TOKENS_FILENAME in files else {}
        try:
            tokenizer = Tokenizer.from_str(_text(files, TOKENIZER_FILENAME))
        except Exception as error:  # the tokenizers library raises bare Exceptions for a malformed model
            raise TextFileInvalid(f"{TOKENIZER_FILENAME} is not a tokenizer: {error}", TOKENIZER_FILENAME) from error
        if failed := tokenizer_probe_failure(tokenizer, tokenizer_json):
            raise TextFileInvalid(f"{TOKENIZER_FILENAME} {failed}", TOKENIZER_FILENAME)
        special = _special_tokens(config, special_map)
        _configure_like_transformers(tokenizer, config, special)
        return cls(
            tokenizer,
            special,
            generation,
            _chat_template(files, config),
            tokenizer_json.get("decoder"),
            clean_up_spaces=bool(config.get("clean_up_tokenization_spaces", False)),
        )

    # --- special tokens

    def token_id(self, name: str) -> int | None:
        """The id of a named special token ("bos_token", "eos_token", "pad_token", ...); None when unset."""
        text = self.special.named.get(name)
        return None if text is None else self.tokenizer.token_to_id(text)

    def token(self, name: str) -> str | None:
        """A named special token's text ("bos_token", "eos_token", "pad_token", ...): the tokenizer's, else the
        token of generation_config.json's id; None when neither sets it."""
        if name in self.special.named:
            return self.special.named[name]
        found = self._named_id(name)
        return None if found is None else self.tokenizer.id_to_token(found)

    @property
    def bos_token_id(self) -> int | None:
        return self._named_id("bos_token")

    @property
    def pad_token_id(self) -> int | None:
        return self._named_id("pad_token")

    @property
    def eos_token_id(self) -> int | None:
        """The tokenizer's end-of-text token (generation_config's first when the tokenizer names none)."""
        return self._named_id("eos_token")

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """Every id generation stops at: generation_config.json's `eos_token_id` (one or a list), then the
        tokenizer's eos token."""
        configured = self._generation_config.get("eos_token_id")
        ids = list(configured) if isinstance(configured, list) else [] if configured is None else [configured]
        tokenizer_eos = self.token_id("eos_token")
        if tokenizer_eos is not None:
            ids.append(tokenizer_eos)
        return tuple(dict.fromkeys(int(each) for each in ids))

    def _named_id(self, name: str) -> int | None:
        found = self.token_id(name)
        if found is not None:
            return found
        configured = self._generation_config.get(f"{name}_id")
        if isinstance(configured, list):
            configured = configured[0] if configured else None
        return None if configured is None else int(configured)

    # --- text <-> ids

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """The ids of `text`, as transformers' `tokenizer(text)["input_ids"]` (bos/eos where the model adds them)."""
        # encode_batch lets go of the GIL while it runs (encode holds it): a long text tokenized on a worker thread
        # does not stop the caller's other threads (the gateway's event loop)
        try:
            return self.tokenizer.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids
        except Exception as error:  # the library's errors are bare Exceptions
            raise EncodeFailed(f"the tokenizer cannot encode this text: {error}") from None
        except BaseException as error:  # its Rust panics (a regex past its backtracking limit) are BaseExceptions
            if type(error).__name__ != "PanicException":
                raise
            raise EncodeFailed(f"the tokenizer failed on this text: {error}") from None

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        """The text of `ids`, as transformers' `tokenizer.decode` (ids outside the vocabulary give nothing)."""
        text = self.tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)
        return _clean_up_tokenization(text) if self._clean_up_spaces else text

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes one token stands for (a byte-level token may hold part of a UTF-8 character)."""
        return self._token_bytes(token_id)

    def token_text(self, token_id: int) -> str:
        """A token as OpenAI's logprobs name it: its text, or, for bytes that are no whole UTF-8 text on their
        own, "bytes:" and their escapes ("bytes:\\xe4\\xbd"), the form OpenAI's API answers with."""
        data = self.token_bytes(token_id)
        try:
            return data.decode("utf-8")
        except UnicodeDecodeError:
            return "bytes:" + "".join(f"\\x{byte:02x}" for byte in data)

    @property
    def vocab_size(self) -> int:
        """The number of ids, added tokens included."""
        return self.tokenizer.get_vocab_size(with_added_tokens=True)

    # --- chat

    def render_chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
        documents: Sequence[Mapping[str, Any]] | None = None,
        **extra: Any,
    ) -> str:
        """The conversation as the chat template writes it, as transformers' `apply_chat_template(...,
        tokenize=False)`; `extra` are further template variables (they override the special tokens')."""
        try:
            return chat_template.render(*self.chat_call(messages, add_generation_prompt, tools, documents, **extra))
        except chat_template.TemplateFailed as error:
            raise ChatTemplateError(str(error)) from error

    def chat_call(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
        documents: Sequence[Mapping[str, Any]] | None = None,
        **extra: Any,
    ) -> tuple[str, dict[str, Any]]:
        """What `render_chat` renders: the template's source and its variables, plain data (JSON's types), which
        `client.chat_template.render` renders here or in another process (the gateway's, bounded)."""
        variables = _plain({**self.special.named, **extra})
        plain = {"messages": _messages(messages), "tools": _plain(tools), "documents": _plain(documents)}
        return self._template_for(tools), {**plain, "add_generation_prompt": add_generation_prompt, **variables}

    def chat_ids(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
        documents: Sequence[Mapping[str, Any]] | None = None,
        **extra: Any,
    ) -> list[int]:
        """The rendered conversation's ids, as transformers' `apply_chat_template(..., tokenize=True)
        ["input_ids"]`: the template writes the special tokens, so none is added around it."""
        text = self.render_chat(messages, add_generation_prompt, tools=tools, documents=documents, **extra)
        return self.encode(text, add_special_tokens=False)

    def _template_for(self, tools: object) -> str:
        if self.chat_template is None:
            raise ChatTemplateUnavailable(
                f"the model has no chat template (neither {CHAT_TEMPLATE_FILENAME} nor a chat_template in "
                f"{TOKENIZER_CONFIG_FILENAME})"
            )
        if isinstance(self.chat_template, str):
            return self.chat_template
        if tools is not None and "tool_use" in self.chat_template:
            return self.chat_template["tool_use"]
        if "default" not in self.chat_template:
            raise ChatTemplateUnavailable(
                f"the model has chat templates {sorted(self.chat_template)} and none is named 'default'"
            )
        return self.chat_template["default"]


class Detokenizer:
    """Generated ids to text, one token at a time, for a stream whose pieces join to the whole text.

    `push(id)` answers the text that is final now; `finish()` the rest once generation ends. A piece never
    ends inside a UTF-8 character (the bytes wait for the token that completes them) and never holds text
    that may begin a stop string (it waits until it is one or is not). Once a stop string appears `stopped`
    is true and the text ends right before it: the stop string and what follows are never sent.

    Joined, the pieces are `decode(generated ids)` (with prompt ids: the text the generated ids add after
    the prompt's), cut at the first stop string to complete. Each push decodes only a window of the last
    few tokens (vLLM's prefix_offset/read_offset): the tokens sent last, for decoders whose text depends on
    the token before, and those not sent yet. One known difference: SentencePiece's byte-fallback decode
    turns a run of byte tokens that is not UTF-8 into U+FFFDs, a valid byte at its start included, where the
    stream has sent that byte already ("A" then "\ufffdx" against "\ufffd\ufffdx"); a model that has
    its characters as tokens does not generate such runs.
    """

    def __init__(
        self,
        text_model: TextModel,
        prompt_ids: Sequence[int] = (),
        stop: Sequence[str] = (),
        skip_special_tokens: bool = True,
    ) -> None:
        empty = [index for index, each in enumerate(stop) if not each]
        if empty:
            raise ValueError(f"stop strings must not be empty: stop[{empty[0]}] of {list(stop)!r} is ''")
        self._model = text_model
        self._stop = tuple(stop)
        self._skip_special_tokens = skip_special_tokens
        self._window = self._context(prompt_ids)  # ids decoded together: what was sent last, then what was not
        self._read = len(self._window)  # _window[:_read] was sent (as _sent_text)
        self._sent_text = self._decode(self._window)
        self._held = ""  # decoded text not sent, since it may be the start of a stop string
        self.stopped = False
        self.text = ""  # everything sent so far

    def push(self, token_id: int) -> str:
        """Take the next generated id; answer the text that is final now (often "", never taken back)."""
        if self.stopped:
            return ""
        self._window.append(token_id)
        decoded = self._decode(self._window)
        if len(decoded) <= len(self._sent_text) or decoded.endswith(REPLACEMENT_CHARACTER):
            return ""  # nothing new yet, or the last bytes are part of a character a later token completes
        new_text = decoded[len(self._sent_text) :]
        self._window = self._window[self._read :]  # the tokens just decoded are the next window's context
        self._read = len(self._window)
        self._sent_text = self._decode(self._window)
        return self._release(new_text, final=False)

    def finish(self) -> str:
        """Generation ended: answer the rest, bytes that never became a character included (as U+FFFD)."""
        if self.stopped:
            return ""
        rest = self._decode(self._window)[len(self._sent_text) :]
        self._window, self._read, self._sent_text = [], 0, ""
        return self._release(rest, final=True)

    def _release(self, new_text: str, final: bool) -> str:
        held = self._held + new_text
        cut = first_stop(held, self._stop)
        if cut is not None:
            self.stopped = True
            piece, self._held = held[:cut], ""
        else:
            keep = 0 if final else _stop_prefix_length(held, self._stop)
            piece, self._held = held[: len(held) - keep], held[len(held) - keep :]
        self.text += piece
        return piece

    def _decode(self, ids: list[int]) -> str:
        return self._model.decode(ids, skip_special_tokens=self._skip_special_tokens)

    def _context(self, prompt_ids: Sequence[int]) -> list[int]:
        """The prompt's last ids, fewer where they end inside a character: a generated token that completes
        it would otherwise send text of the prompt's."""
        context = list(prompt_ids[-PROMPT_CONTEXT_TOKENS:])
        while context and self._decode(context).endswith(REPLACEMENT_CHARACTER):
            context.pop()
        return context


def first_stop(text: str, stop: Sequence[str]) -> int | None:
    """Where `text` is cut for the first stop string to complete in it (of those completing at the same
    character, the longest); None when none occurs."""
    found = [(start + len(each), start) for each in stop if (start := text.find(each)) >= 0]
    return min(found)[1] if found else None


def _stop_prefix_length(text: str, stop: Sequence[str]) -> int:
    """The length of the longest end of `text` that begins a stop string (0 when none does)."""
    longest = 0
    for each in stop:
        for length in range(min(len(each) - 1, len(text)), longest, -1):
            if text.endswith(each[:length]):
                longest = length
                break
    return longest


# --- reading the files


def tokenizer_probe_failure(tokenizer: Tokenizer, tokenizer_json: Mapping[str, Any]) -> str | None:
    """Why `tokenizer` cannot be served ("fails on ..."), or None: each probe (PROBE_CHARACTERS above) encoded, a
    Rust panic or error caught (the tokenizers library raises bare Exceptions, and panics as BaseExceptions)."""
    letters = [c for pattern in _regex_patterns(tokenizer_json) for c in pattern if c.isalnum()]
    for character in dict.fromkeys(PROBE_CHARACTERS + "".join(dict.fromkeys(letters))[:PROBE_REGEX_LETTERS]):
        text = character * PROBE_RUN + ("!" if character != "!" else "?")
        try:
            tokenizer.encode_batch([text])
        except BaseException as error:
            if not isinstance(error, Exception) and type(error).__name__ != "PanicException":
                raise
            return (
                f"fails on {character!r} x {PROBE_RUN} then {text[-1]!r}, a text any prompt may hold (a regex of "
                f"its pre-tokenizer or normalizer that backtracks past its limit?): {error}"
            )
    return None


def _regex_patterns(node: Any) -> Iterable[str]:
    """Every `{"Regex": pattern}` in a tokenizer.json, at any depth."""
    if isinstance(node, dict):
        if isinstance(node.get("Regex"), str):
            yield node["Regex"]
        for value in node.values():
            yield from _regex_patterns(value)
    elif isinstance(node, list):
        for value in node:
            yield from _regex_patterns(value)


def _text(files: Mapping[str, bytes], name: str) -> str:
    try:
        return files[name].decode("utf-8")
    except UnicodeDecodeError as error:
        raise TextFileInvalid(f"{name} is not UTF-8 text: {error}", name) from error


def _json_object(files: Mapping[str, bytes], name: str) -> dict[str, Any]:
    try:
        value = json.loads(_text(files, name))
    except json.JSONDecodeError as error:
        raise TextFileInvalid(f"{name} is not JSON: {error}", name) from error
    if not isinstance(value, dict):
        raise TextFileInvalid(f"{name} holds a JSON {type(value).__name__}, expected an object", name)
    return value


def _token_content(value: Any, key: str, filename: str) -> str | None:
    """A special token as a config writes it: a string, or an AddedToken-like object with its "content"."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    raise TextFileInvalid(f"{filename}: {key} is {value!r}, expected a string or an object with a 'content'", filename)


def _special_tokens(config: Mapping[str, Any], special_map: Mapping[str, Any]) -> SpecialTokens:
    """The named special tokens as transformers resolves them: tokenizer_config.json's, overridden by
    special_tokens_map.json's when the config predates `added_tokens_decoder` (transformers' legacy path)."""
    sources = [(config, TOKENIZER_CONFIG_FILENAME)]
    if "added_tokens_decoder" not in config:
        sources.append((special_map, SPECIAL_TOKENS_FILENAME))
    named: dict[str, str] = {}
    extra: list[str] = []
    for source, filename in sources:
        for key, value in source.items():
            if key in NAMED_SPECIAL_TOKENS:
                content = _token_content(value, key, filename)
                if content is not None:
                    named[key] = content
            elif key.endswith("_token") and isinstance(value, str):  # a model's own named token (Gemma's boi_token)
                named[key] = value
            elif key in ("extra_special_tokens", "additional_special_tokens"):
                extra += _extra_tokens(value, key, filename, named)
    return SpecialTokens(named=named, extra=tuple(dict.fromkeys(extra)))


def _extra_tokens(value: Any, key: str, filename: str, named: dict[str, str]) -> list[str]:
    """extra_special_tokens: a list of tokens, or a dict of named ones (those join `named`)."""
    if isinstance(value, dict):
        for name, token in value.items():
            content = _token_content(token, f"{key}.{name}", filename)
            if content is not None:
                named[name] = content
        return []
    if not isinstance(value, list):
        raise TextFileInvalid(f"{filename}: {key} is {value!r}, expected a list or an object", filename)
    return [content for token in value if (content := _token_content(token, key, filename)) is not None]


def _configure_like_transformers(tokenizer: Tokenizer, config: Mapping[str, Any], special: SpecialTokens) -> None:
    """What transformers' TokenizersBackend changes in the tokenizer.json it loads, so that ids match."""
    tokenizer.no_truncation()
    tokenizer.no_padding()
    _add_config_tokens(tokenizer, config.get("added_tokens_decoder") or {})
    # transformers registers every named and extra special token as special, adding those the vocab lacks
    contents = [*special.named.values(), *special.extra]
    tokenizer.add_special_tokens([AddedToken(content, special=True, normalized=False) for content in contents])
    tokenizer.encode_special_tokens = bool(config.get("split_special_tokens", False))
    # add_bos_token/add_eos_token in the config are left alone: with a tokenizer.json transformers ignores
    # them too, and the post-processor saved in it adds what the model's text starts and ends with


def _add_config_tokens(tokenizer: Tokenizer, added: Any) -> None:
    """tokenizer_config.json's added_tokens_decoder: the tokens it describes otherwise than tokenizer.json."""
    if not isinstance(added, dict):
        raise TextFileInvalid(
            f"{TOKENIZER_CONFIG_FILENAME}: added_tokens_decoder is {added!r}, expected an object of tokens by id",
            TOKENIZER_CONFIG_FILENAME,
        )
    present = {repr(token) for token in tokenizer.get_added_tokens_decoder().values()}
    for index, fields in sorted(added.items(), key=lambda item: _token_index(item[0])):
        try:
            token = AddedToken(**{key: value for key, value in fields.items() if key != "__type"})
        except (TypeError, AttributeError) as error:
            raise TextFileInvalid(
                f"{TOKENIZER_CONFIG_FILENAME}: added_tokens_decoder[{index}] is {fields!r}, expected an AddedToken's "
                f"fields: {error}",
                TOKENIZER_CONFIG_FILENAME,
            ) from error
        if repr(token) not in present:
            tokenizer.add_tokens([token])


def _token_index(key: str) -> int:
    try:
        return int(key)
    except ValueError as error:
        raise TextFileInvalid(
            f"{TOKENIZER_CONFIG_FILENAME}: added_tokens_decoder has the key {key!r}, expected token ids",
            TOKENIZER_CONFIG_FILENAME,
        ) from error


def _chat_template(files: Mapping[str, bytes], config: Mapping[str, Any]) -> str | dict[str, str] | None:
    """chat_template.jinja (transformers 5's file), else tokenizer_config.json's chat_template: a string, or
    named ones (a list of {"name", "template"}, or an object) of which "default" is used."""
    if CHAT_TEMPLATE_FILENAME in files:
        return _text(files, CHAT_TEMPLATE_FILENAME)
    template = config.get("chat_template")
    if template is None or isinstance(template, str):
        return template
    if isinstance(template, dict) and all(
        isinstance(key, str) and isinstance(value, str) for key, value in template.items()
    ):
        return template
    if isinstance(template, list) and all(
        isinstance(each, dict) and isinstance(each.get("name"), str) and isinstance(each.get("template"), str)
        for each in template
    ):
        return {each["name"]: each["template"] for each in template}
    raise TextFileInvalid(
        f"{TOKENIZER_CONFIG_FILENAME}: chat_template is {template!r}, expected a string, a list of "
        '{"name", "template"} objects or an object of named templates',
        TOKENIZER_CONFIG_FILENAME,
    )


# --- tokens' bytes


@functools.cache
def _byte_level_chars() -> dict[str, int]:
    """GPT-2's byte-level alphabet: the printable character each byte is written as in the vocabulary."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars = {byte: chr(byte) for byte in printable}
    unprintable = [byte for byte in range(256) if byte not in chars]
    chars.update({byte: chr(256 + index) for index, byte in enumerate(unprintable)})
    return {char: byte for byte, char in chars.items()}


_BYTE_FALLBACK_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def _decoder_steps(decoder: Mapping[str, Any] | None) -> list[Mapping[str, Any]]:
    """tokenizer.json's decoder as a flat list of its steps (a Sequence's, in order)."""
    if not decoder:
        return []
    if decoder.get("type") == "Sequence":
        return [step for inner in decoder.get("decoders") or [] for step in _decoder_steps(inner)]
    return [decoder]


def _space_replacements(steps: list[Mapping[str, Any]]) -> list[tuple[str, str]]:
    """The strings a SentencePiece-like decoder writes back as text: its Replace steps' ("▁" -> " ") and
    Metaspace's replacement character."""
    replacements = []
    for step in steps:
        pattern = step.get("pattern")
        if step.get("type") == "Replace" and isinstance(pattern, dict) and isinstance(pattern.get("String"), str):
            replacements.append((pattern["String"], str(step.get("content", ""))))
        elif step.get("type") == "Metaspace":
            replacements.append((str(step.get("replacement", "\u2581")), " "))
    return replacements


def _token_bytes_reader(tokenizer: Tokenizer, decoder: Mapping[str, Any] | None):
    """A function from a token id to the bytes it adds to a text: by the byte-level alphabet, a byte-fallback
    token's byte, a SentencePiece piece with its spaces (the leading one a decode strips included), or else
    the token's decoded text."""
    steps = _decoder_steps(decoder)
    types = {step.get("type") for step in steps}
    replacements = _space_replacements(steps)
    chars = _byte_level_chars()

    def token_bytes(token_id: int) -> bytes:
        token = tokenizer.id_to_token(token_id)
        if token is None:
            return b""
        if "ByteLevel" in types:  # an added token outside the alphabet is decoded as its own UTF-8
            in_alphabet = all(char in chars for char in token)
            return bytes(chars[char] for char in token) if in_alphabet else token.encode("utf-8")
        if "ByteFallback" in types and (byte := _BYTE_FALLBACK_TOKEN.fullmatch(token)):
            return bytes([int(byte.group(1), 16)])
        if replacements:
            for pattern, content in replacements:
                token = token.replace(pattern, content)
            return token.encode("utf-8")
        return tokenizer.decode([token_id], skip_special_tokens=False).encode("utf-8")

    return token_bytes


def _clean_up_tokenization(text: str) -> str:
    """transformers' `clean_up_tokenization`: the spaces a word-piece decode leaves before punctuation."""
    for spaced, joined in ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"), (" n't", "n't")):
        text = text.replace(spaced, joined)
    for spaced, joined in ((" 'm", "'m"), (" 's", "'s"), (" 've", "'ve"), (" 're", "'re")):
        text = text.replace(spaced, joined)
    return text


# --- the conversation as the template takes it


def _messages(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """The conversation as transformers hands it to the template: plain data, keys whose value is None left
    out, a message's reasoning under each of REASONING_FIELDS."""
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence) or not messages:
        raise ChatTemplateError(f"messages must be a non-empty list of message objects, got {messages!r}")
    plain = []
    for index, given in enumerate(messages):
        if not isinstance(given, Mapping):
            raise ChatTemplateError(f"messages[{index}] is {given!r}, expected an object with 'role' and 'content'")
        message = {key: value for key, value in _plain(given).items() if value is not None}
        reasoning = next((message[key] for key in REASONING_FIELDS if key in message), None)
        if reasoning is not None:
            message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        plain.append(message)
    return plain


def _plain(value: Any, depth: int = 0) -> Any:
    """Only JSON's types reach the template (anything else as a placeholder naming its type): an object's
    methods are code the sandbox does not know to be dangerous. Nested at most MAX_TEMPLATE_DEPTH deep: no
    chat needs more, and Python's stack (the template's recursion too) would not take much more."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    for base, exact in _SCALARS:  # subclasses (enums, numpy scalars) lose their methods
        if isinstance(value, base):
            return exact(value)
    if depth >= MAX_TEMPLATE_DEPTH and isinstance(value, (Mapping, list, tuple)):
        raise ChatTemplateError(f"the messages are nested more than {MAX_TEMPLATE_DEPTH} deep (objects in lists ...)")
    if isinstance(value, Mapping):
        return {_plain(key, depth + 1): _plain(item, depth + 1) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        items = [_plain(item, depth + 1) for item in value]
        return items if isinstance(value, list) else tuple(items)
    return f"<{type(value).__name__}>"


MAX_TEMPLATE_DEPTH = 64
_SCALARS = ((str, str.__str__), (int, int.__int__), (float, float.__float__))
