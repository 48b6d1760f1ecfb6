"""client/text.py against transformers, the oracle: the same ids for text and chats, the same text for ids,
over the folders tests/fixtures/text.py trains (two byte-level BPEs, one Llama 2-like SentencePiece BPE);
the Detokenizer's streamed pieces against the whole decode cut at its stop strings."""

from __future__ import annotations

import functools
import json
import shutil
from pathlib import Path

import jinja2
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers import AutoTokenizer, GenerationConfig

from client.text import (
    ChatTemplateError,
    ChatTemplateUnavailable,
    Detokenizer,
    TextFileInvalid,
    TextModel,
    TextUnavailable,
)
from contract.files import (
    CHAT_TEMPLATE_FILENAME,
    GENERATION_CONFIG_FILENAME,
    SPECIAL_TOKENS_FILENAME,
    TEXT_FILES,
    TOKENIZER_CONFIG_FILENAME,
    TOKENIZER_FILENAME,
)
from tests.fixtures.text import NON_ASCII_LINES, save_sentencepiece_tokenizer, save_tokenizer

# name -> (what writes the folder, the most ids it may have)
FOLDERS = {
    "chatml-320": (functools.partial(save_tokenizer, vocab_size=320, template="chatml"), 320),
    "llama3-512": (functools.partial(save_tokenizer, vocab_size=512, template="llama3"), 512),
    "sentencepiece-300": (functools.partial(save_sentencepiece_tokenizer, vocab_size=300), 300 + 256),
}
BYTE_LEVEL = ("chatml-320", "llama3-512")
EXAMPLES = settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck), database=None)

TEXTS = [
    "",
    "hello world",
    "def f(x):\n    return x  # a comment\n\n\n",
    "   leading and trailing spaces   ",
    *NON_ASCII_LINES,
    "mixed 你好 and 🙂 within ASCII, éàü",
    "<s>special tokens in text</s><|im_end|><|eot_id|>",
    "\ufffd a replacement character on purpose",
]

CONVERSATIONS = {
    "one user turn": [{"role": "user", "content": "Hello!"}],
    "system first": [
        {"role": "system", "content": "  You answer in French.  "},
        {"role": "user", "content": "What is 2+2?"},
    ],
    "several turns": [
        {"role": "user", "content": "你好"},
        {"role": "assistant", "content": "Bonjour 🙂"},
        {"role": "user", "content": "<|im_end|> markers typed by a user"},
    ],
    "content None": [
        {"role": "user", "content": "first"},
        {"role": "assistant", "content": None},
        {"role": "user", "content": "second", "name": None},
    ],
}


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    made = {}
    for name, (save, _) in FOLDERS.items():
        made[name] = tmp_path_factory.mktemp(name)
        save(made[name])
    return made


@pytest.fixture(scope="module")
def models(folders) -> dict[str, tuple[TextModel, object]]:
    """Ours and transformers' for each folder."""
    return {name: (TextModel.from_folder(path), AutoTokenizer.from_pretrained(path)) for name, path in folders.items()}


def copied(folder: Path, destination: Path) -> Path:
    shutil.copytree(folder, destination)
    return destination


def edit_json(path: Path, **changes) -> None:
    data = json.loads(path.read_text()) if path.exists() else {}
    data.update(changes)
    path.write_text(json.dumps(data))


# --- encode and decode


@pytest.mark.parametrize("name", FOLDERS)
@pytest.mark.parametrize("text", TEXTS)
def test_encode_equals_transformers(models, name, text):
    ours, theirs = models[name]
    assert ours.encode(text) == theirs(text)["input_ids"]
    assert ours.encode(text, add_special_tokens=False) == theirs(text, add_special_tokens=False)["input_ids"]


@pytest.mark.parametrize("name", FOLDERS)
def test_encode_equals_transformers_on_any_text(models, name):
    ours, theirs = models[name]

    @EXAMPLES
    @given(st.text(max_size=60))
    def check(text):
        assert ours.encode(text) == theirs(text)["input_ids"]

    check()


@pytest.mark.parametrize("name", FOLDERS)
def test_decode_equals_transformers_on_any_ids(models, name):
    ours, theirs = models[name]

    @EXAMPLES
    @given(st.lists(st.integers(0, ours.vocab_size + 3), max_size=40), st.booleans())  # a few unknown ids
    def check(ids, skip):
        assert ours.decode(ids, skip_special_tokens=skip) == theirs.decode(ids, skip_special_tokens=skip)

    check()


def test_the_fixture_vocabulary_fits_and_splits_characters(models):
    for name, (_, most_ids) in FOLDERS.items():
        ours, theirs = models[name]
        assert ours.vocab_size == len(theirs) <= most_ids
        assert [ours.token_id(key) for key in ("bos_token", "eos_token")] == [1, 2]
    # tokens that end inside a character: what the detokenizer must hold back
    for name in ("chatml-320", "sentencepiece-300"):
        ours, _ = models[name]
        ids = ours.encode("".join(NON_ASCII_LINES))
        assert any(ours.token_text(token).startswith("bytes:") for token in ids)


@pytest.mark.parametrize("name", FOLDERS)
@pytest.mark.parametrize("text", TEXTS)
def test_token_bytes_join_to_the_text_and_token_text_names_them(models, name, text):
    """A token's text is what it adds after another token ("a"): with the space a decode strips from the
    first token of a SentencePiece text."""
    ours, theirs = models[name]
    ids = ours.encode(text, add_special_tokens=False)
    before = theirs.convert_tokens_to_ids("a")

    def added_text(ids: list[int]) -> str:
        return theirs.decode([before, *ids], skip_special_tokens=False).removeprefix("a")

    assert b"".join(ours.token_bytes(token) for token in ids) == added_text(ids).encode("utf-8")
    if name in BYTE_LEVEL:
        assert added_text(ids) == text
    for token in ids:
        data, shown = ours.token_bytes(token), ours.token_text(token)
        if shown.startswith("bytes:"):  # OpenAI's form for bytes that are no text alone: "bytes:\xe4\xbd"
            assert bytes.fromhex(shown.removeprefix("bytes:").replace("\\x", "")) == data
            assert "\ufffd" in added_text([token])
        else:
            assert shown == added_text([token]) == data.decode("utf-8")


# --- chat templates


@pytest.mark.parametrize("name", FOLDERS)
@pytest.mark.parametrize("conversation", CONVERSATIONS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_equals_transformers(models, name, conversation, add_generation_prompt):
    ours, theirs = models[name]
    messages = CONVERSATIONS[conversation]
    if conversation == "content None" and name.startswith("chatml"):
        # ChatML reads every message's content: transformers leaves a None out, and the template misses it
        with pytest.raises(jinja2.TemplateError) as refused:
            theirs.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=False)
        with pytest.raises(ChatTemplateError) as raised:
            ours.render_chat(messages, add_generation_prompt=add_generation_prompt)
        assert raised.value.message == str(refused.value) == "'dict object' has no attribute 'content'"
        return
    expected_text = theirs.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=False)
    expected_ids = theirs.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)["input_ids"]
    assert ours.render_chat(messages, add_generation_prompt=add_generation_prompt) == expected_text
    assert ours.chat_ids(messages, add_generation_prompt=add_generation_prompt) == expected_ids
    bos_in_template = "bos_token" in ours.chat_template
    assert expected_ids.count(ours.token_id("bos_token")) == bos_in_template  # and no second one from encode


def test_chat_with_tools_and_template_variables_equals_transformers(models):
    ours, theirs = models["llama3-512"]
    messages = CONVERSATIONS["system first"]
    tools = [{"type": "function", "function": {"name": "add", "parameters": {"a": "<int>", "b": "é"}}}]
    expected = theirs.apply_chat_template(messages, tools=tools, date_string="26 Nov 2026", tokenize=False)
    rendered = ours.render_chat(messages, add_generation_prompt=False, tools=tools, date_string="26 Nov 2026")
    assert rendered == expected
    assert '"b": "é"' in rendered and "<int>" in rendered  # tojson as transformers': no ASCII or HTML escapes


def test_transformers_template_extras_render_alike(folders, tmp_path):
    """{% generation %} (training masks), strftime_now, dict(), loop controls and a model's own variables."""
    folder = copied(folders["chatml-320"], tmp_path / "extras")
    (folder / CHAT_TEMPLATE_FILENAME).write_text(
        "{% set seen = dict(count=0) %}{{ strftime_now('%Y') }}|{{ eos_token }}|{{ dict.fromkeys(['a']) | tojson }}"
        "{% for m in messages %}{% if loop.index > 2 %}{% break %}{% endif %}"
        "{% if m.role == 'assistant' %}{% generation %}[{{ m.content }}]{% endgeneration %}"
        "{% else %}{{ m.content }}{% endif %}{% endfor %}{{ persona | default('none') }}"
    )
    ours, theirs = TextModel.from_folder(folder), AutoTokenizer.from_pretrained(folder)
    messages = CONVERSATIONS["several turns"]
    for extra in ({}, {"persona": "pirate"}):
        expected = theirs.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **extra)
        assert ours.render_chat(messages, **extra) == expected
    assert ours.render_chat(messages).endswith('|</s>|{"a": null}你好[Bonjour 🙂]none')


def test_a_template_that_raises_gives_its_message(models):
    ours, theirs = models["llama3-512"]
    messages = [{"role": "tool", "content": "42"}]
    with pytest.raises(jinja2.TemplateError, match="got tool") as expected:
        theirs.apply_chat_template(messages, tokenize=False)
    with pytest.raises(ChatTemplateError) as raised:
        ours.chat_ids(messages)
    assert raised.value.message == str(expected.value) == "Conversation roles must be user or assistant, got tool"


@pytest.mark.parametrize(
    "template",
    [
        "{{ ''.__class__.__mro__ }}",  # climbing to object's subclasses
        "{{ raise_exception.__globals__['json'] }}",
        "{{ dict.__call__.__globals__.keys() }}",
        "{% set seen = [] %}{{ seen.append(1) }}",  # the sandbox is immutable
        "{% set ns = namespace(_hidden=1) %}{{ ns._hidden }}",
    ],
)
def test_the_sandbox_refuses_escapes(folders, tmp_path, template):
    folder = copied(folders["chatml-320"], tmp_path / "escape")
    (folder / CHAT_TEMPLATE_FILENAME).write_text(template)
    with pytest.raises(ChatTemplateError):
        TextModel.from_folder(folder).render_chat(CONVERSATIONS["one user turn"])


def test_the_sandbox_shows_no_internals(folders, tmp_path):
    folder = copied(folders["chatml-320"], tmp_path / "peek")
    (folder / CHAT_TEMPLATE_FILENAME).write_text("[{{ messages.__class__ }}{{ raise_exception.__globals__ }}]")
    assert TextModel.from_folder(folder).render_chat(CONVERSATIONS["one user turn"]) == "[]"


def test_a_template_that_does_not_compile_is_a_chat_template_error(folders, tmp_path):
    folder = copied(folders["chatml-320"], tmp_path / "broken")
    (folder / CHAT_TEMPLATE_FILENAME).write_text("{% for message in messages %}{{ message.content }}")
    ours = TextModel.from_folder(folder)  # the model still encodes text: only chats need the template
    assert ours.encode("hi") == TextModel.from_folder(folders["chatml-320"]).encode("hi")
    with pytest.raises(ChatTemplateError, match="does not compile: line 1"):
        ours.render_chat(CONVERSATIONS["one user turn"])


@pytest.mark.parametrize("messages", [[], "hello", [{"role": "user", "content": "a"}, "b"]])
def test_messages_that_are_no_conversation_are_refused(models, messages):
    ours, _ = models["chatml-320"]
    with pytest.raises(ChatTemplateError, match="messages"):
        ours.render_chat(messages)


def test_a_model_without_a_chat_template_says_so(folders, tmp_path):
    folder = copied(folders["chatml-320"], tmp_path / "plain")
    (folder / CHAT_TEMPLATE_FILENAME).unlink()
    ours = TextModel.from_folder(folder)
    assert ours.chat_template is None
    with pytest.raises(ChatTemplateUnavailable, match="no chat template"):
        ours.chat_ids(CONVERSATIONS["one user turn"])


def test_templates_in_tokenizer_config_equal_transformers(folders, tmp_path):
    """Older saves: the template in tokenizer_config.json, one string or a list of named ones."""
    single = copied(folders["llama3-512"], tmp_path / "single")
    template = (single / CHAT_TEMPLATE_FILENAME).read_text()
    (single / CHAT_TEMPLATE_FILENAME).unlink()
    edit_json(single / TOKENIZER_CONFIG_FILENAME, chat_template=template)
    named = copied(single, tmp_path / "named")
    tool_use = "{{ bos_token }}tools: {{ tools | length }}{% for m in messages %}{{ m.content }}{% endfor %}"
    edit_json(
        named / TOKENIZER_CONFIG_FILENAME,
        chat_template=[{"name": "default", "template": template}, {"name": "tool_use", "template": tool_use}],
    )
    messages = CONVERSATIONS["several turns"][:2]
    tools = [{"type": "function", "function": {"name": "noop"}}]
    for folder in (single, named):
        ours, theirs = TextModel.from_folder(folder), AutoTokenizer.from_pretrained(folder)
        for with_tools in (None, tools):
            assert (
                ours.chat_ids(messages, tools=with_tools)
                == (theirs.apply_chat_template(messages, add_generation_prompt=True, tools=with_tools)["input_ids"])
            )
    assert TextModel.from_folder(named).render_chat(messages, tools=tools) == "<s>tools: 1你好Bonjour 🙂"


# --- special tokens, generation config and the files


def test_eos_token_ids_join_generation_config_and_tokenizer(folders, tmp_path):
    folder = copied(folders["chatml-320"], tmp_path / "eos")
    assert TextModel.from_folder(folder).eos_token_ids == (2,)
    GenerationConfig(eos_token_id=[4, 2], bos_token_id=1, pad_token_id=0).save_pretrained(folder)
    ours = TextModel.from_folder(folder)
    assert ours.eos_token_ids == (4, 2)
    GenerationConfig(eos_token_id=4).save_pretrained(folder)
    assert TextModel.from_folder(folder).eos_token_ids == (4, 2)


def test_ids_come_from_generation_config_where_the_tokenizer_names_none(folders, tmp_path):
    folder = copied(folders["chatml-320"], tmp_path / "ids")
    config = json.loads((folder / TOKENIZER_CONFIG_FILENAME).read_text())
    for key in ("bos_token", "eos_token", "pad_token"):
        config.pop(key)
    (folder / TOKENIZER_CONFIG_FILENAME).write_text(json.dumps(config))
    GenerationConfig(eos_token_id=[4, 7], bos_token_id=3, pad_token_id=0).save_pretrained(folder)
    ours = TextModel.from_folder(folder)
    assert (ours.bos_token_id, ours.eos_token_id, ours.pad_token_id, ours.eos_token_ids) == (3, 4, 0, (4, 7))


def test_special_tokens_written_as_objects_and_explicit_bos_equal_transformers(folders, tmp_path):
    """A transformers 4 save: AddedToken objects for special tokens, add_bos_token/add_eos_token flags (which
    transformers 5 ignores beside a tokenizer.json), a special_tokens_map.json that overrides the config's."""
    folder = copied(folders["chatml-320"], tmp_path / "v4")
    edit_json(
        folder / TOKENIZER_CONFIG_FILENAME,
        eos_token={"__type": "AddedToken", "content": "<|im_end|>", "lstrip": False, "rstrip": False},
        add_bos_token=True,
        add_eos_token=True,
    )
    edit_json(folder / SPECIAL_TOKENS_FILENAME, bos_token={"content": "<|im_start|>", "special": True})
    ours, theirs = TextModel.from_folder(folder), AutoTokenizer.from_pretrained(folder)
    assert (ours.bos_token_id, ours.eos_token_id) == (theirs.bos_token_id, theirs.eos_token_id) == (3, 4)
    for text in TEXTS[:4]:
        assert ours.encode(text) == theirs(text)["input_ids"]
    messages = CONVERSATIONS["system first"]
    assert ours.chat_ids(messages) == theirs.apply_chat_template(messages, add_generation_prompt=True)["input_ids"]


def test_special_tokens_by_name(models):
    ours, theirs = models["llama3-512"]
    for name in ("bos_token", "eos_token", "pad_token", "unk_token"):
        assert ours.token(name) == getattr(theirs, name)
        assert ours.token_id(name) == getattr(theirs, f"{name}_id")
    assert (ours.bos_token_id, ours.eos_token_id, ours.pad_token_id) == (1, 2, 0)


def test_added_tokens_equal_transformers(folders, tmp_path):
    """Tokens the config adds to tokenizer.json's: extra special ones (skipped by decode), and those of
    added_tokens_decoder, special or not."""
    folder = copied(folders["chatml-320"], tmp_path / "extra")
    fields = {"lstrip": False, "rstrip": False, "normalized": False, "single_word": False}
    edit_json(
        folder / TOKENIZER_CONFIG_FILENAME,
        extra_special_tokens=["<tool>"],
        added_tokens_decoder={
            "321": {"content": "<think>", "special": False, **fields},
            "320": {"content": "<call>", "special": True, **fields},
        },
    )
    ours, theirs = TextModel.from_folder(folder), AutoTokenizer.from_pretrained(folder)
    text = "a <tool> b <call> c <think> d"
    ids = theirs(text)["input_ids"]
    assert ours.encode(text) == ids
    assert ours.vocab_size == len(theirs) == 323
    for skip in (True, False):
        assert ours.decode(ids, skip_special_tokens=skip) == theirs.decode(ids, skip_special_tokens=skip)
    assert ours.decode(ids) == "a  b  c <think> d"


def test_from_files_equals_from_folder(folders):
    for folder in folders.values():
        files = {name: (folder / name).read_bytes() for name in TEXT_FILES if (folder / name).exists()}
        from_files, from_folder = TextModel.from_files(files), TextModel.from_folder(folder)
        text = " ".join(TEXTS)
        assert from_files.encode(text) == from_folder.encode(text)
        assert from_files.special == from_folder.special
        assert from_files.chat_template == from_folder.chat_template
        messages = CONVERSATIONS["several turns"]
        assert from_files.chat_ids(messages) == from_folder.chat_ids(messages)


def test_a_missing_tokenizer_is_unavailable(folders, tmp_path):
    with pytest.raises(TextUnavailable, match=TOKENIZER_FILENAME) as raised:
        TextModel.from_folder(tmp_path)
    assert raised.value.filename == TOKENIZER_FILENAME
    files = {CHAT_TEMPLATE_FILENAME: (folders["chatml-320"] / CHAT_TEMPLATE_FILENAME).read_bytes()}
    with pytest.raises(TextUnavailable, match=TOKENIZER_FILENAME):
        TextModel.from_files(files)


@pytest.mark.parametrize(
    ("filename", "content", "says"),
    [
        (TOKENIZER_FILENAME, b'{"model": ', "not JSON"),
        (TOKENIZER_FILENAME, b'{"model": {"type": "BPE", "vocab": 3}}', "not a tokenizer"),
        (TOKENIZER_CONFIG_FILENAME, b"[1, 2]", "expected an object"),
        (TOKENIZER_CONFIG_FILENAME, b'{"eos_token": 7}', "eos_token is 7"),
        (TOKENIZER_CONFIG_FILENAME, b'{"added_tokens_decoder": {"9": "<x>"}}', r"added_tokens_decoder\[9\]"),
        (TOKENIZER_CONFIG_FILENAME, b'{"added_tokens_decoder": {"x": {}}}', "the key 'x'"),
        (TOKENIZER_CONFIG_FILENAME, b'{"chat_template": [{"template": "x"}]}', "chat_template is"),
        (GENERATION_CONFIG_FILENAME, b"\xff\xfe{}", "not UTF-8"),
        (SPECIAL_TOKENS_FILENAME, b"{", "not JSON"),
    ],
)
def test_a_broken_file_is_named(folders, filename, content, says):
    folder = folders["chatml-320"]
    # without chat_template.jinja, whose template would stand in for the config's
    files = {name: (folder / name).read_bytes() for name in (TOKENIZER_FILENAME, TOKENIZER_CONFIG_FILENAME)}
    with pytest.raises(TextFileInvalid, match=says) as raised:
        TextModel.from_files({**files, filename: content})
    assert raised.value.filename == filename
    assert filename in str(raised.value)


# --- the detokenizer


def streamed(model: TextModel, ids, **options) -> tuple[list[str], Detokenizer]:
    detokenizer = Detokenizer(model, **options)
    pieces = [detokenizer.push(token) for token in ids]
    pieces.append(detokenizer.finish())
    return pieces, detokenizer


def cut_at_first_stop(text: str, stop: list[str]) -> tuple[str, bool]:
    """The text before the first stop string to complete (the longest of those completing together)."""
    for end in range(1, len(text) + 1):
        completed = [each for each in stop if text[:end].endswith(each)]
        if completed:
            return text[: end - max(map(len, completed))], True
    return text, False


@st.composite
def generations(draw, model: TextModel, byte_level: bool):
    """Generated ids, prompt ids, and stop strings drawn from the decoded text (spanning tokens and characters)
    or made up. The ids are random over the vocabulary, or the ids of text; a SentencePiece model's never
    random byte tokens (its byte-fallback decode turns a valid byte before invalid ones into U+FFFD too, so
    a text sent early would differ from the whole decode), nor random prompts."""
    if draw(st.booleans()):
        ids = draw(st.lists(st.integers(0, model.vocab_size - 1), max_size=30))
        if not byte_level:
            ids = [token for token in ids if not model.tokenizer.id_to_token(token).startswith("<0x")]
    else:
        line = draw(st.sampled_from([*NON_ASCII_LINES, "plain ASCII text, for once."]))
        ids = model.encode(line[draw(st.integers(0, len(line))) :], add_special_tokens=False)
    if byte_level:
        prompt = draw(st.lists(st.integers(0, model.vocab_size - 1), max_size=8))
    else:
        prompt = model.encode(draw(st.sampled_from(["", "Hello", "你好 world", "<s>"])))
    skip = draw(st.booleans())
    text = model.decode(ids, skip_special_tokens=skip)
    stop = []
    for _ in range(draw(st.integers(0, 3))):
        if text and draw(st.booleans()):
            start = draw(st.integers(0, len(text) - 1))
            stop.append(text[start : start + draw(st.integers(1, 6))])
        else:
            stop.append(draw(st.text(alphabet="ab 你好🙂\ufffd", min_size=1, max_size=3)))
    return ids, prompt, stop, skip


def text_after_prompt(model: TextModel, prompt: list[int], ids: list[int], skip: bool) -> str:
    """What the ids add to the prompt's text: a byte-level decode depends on no token before, a
    SentencePiece one keeps the first generated token's space only after a prompt."""
    whole, before = model.decode([*prompt, *ids], skip), model.decode(prompt, skip)
    assert whole.startswith(before)
    return whole[len(before) :]


@pytest.mark.parametrize("name", FOLDERS)
def test_streamed_pieces_join_to_the_decoded_text_cut_at_the_first_stop(models, name):
    ours, _ = models[name]

    @EXAMPLES
    @given(generations(ours, byte_level=name in BYTE_LEVEL))
    def check(generation):
        ids, prompt, stop, skip = generation
        pieces, detokenizer = streamed(ours, ids, prompt_ids=prompt, stop=stop, skip_special_tokens=skip)
        text = ours.decode(ids, skip) if name in BYTE_LEVEL else text_after_prompt(ours, prompt, ids, skip)
        expected, stopped = cut_at_first_stop(text, stop)
        assert "".join(pieces) == detokenizer.text == expected
        assert detokenizer.stopped == stopped

    check()


def test_a_sentencepiece_space_comes_after_a_prompt_and_not_without_one(models):
    ours, _ = models["sentencepiece-300"]
    prompt, answer = ours.encode("Hello"), ours.encode("world", add_special_tokens=False)
    assert ours.token_text(answer[0]).startswith(" ")
    assert "".join(streamed(ours, answer, prompt_ids=prompt)[0]) == " world"
    assert "".join(streamed(ours, answer)[0]) == ours.decode(answer) == "world"


def test_a_character_split_across_tokens_comes_out_whole(models):
    ours, _ = models["chatml-320"]
    text = "你好，世界！🙂"
    ids = ours.encode(text)
    assert len(ids) > len(text)  # several tokens per character here
    pieces, _ = streamed(ours, ids)
    assert "".join(pieces) == text
    assert all("\ufffd" not in piece for piece in pieces)
    assert [piece for piece in pieces if piece] == list(text)  # each character as soon as it is whole


def test_text_that_begins_a_stop_string_waits_until_it_is_none(models):
    ours, _ = models["chatml-320"]
    detokenizer = Detokenizer(ours, stop=["世界和平"])
    sent = [detokenizer.push(token) for token in ours.encode("你好世界")]
    assert "".join(sent) == "你好"  # 世界 may begin the stop string
    sent = [detokenizer.push(token) for token in ours.encode("很好")]
    assert "".join(sent) == "世界很好" and not detokenizer.stopped


def test_a_stop_string_across_tokens_ends_the_text_before_it(models):
    ours, _ = models["chatml-320"]
    detokenizer = Detokenizer(ours, stop=["café déjà"])
    pieces = [detokenizer.push(token) for token in ours.encode("Emoji: café déjà vu, naïve")]
    assert "".join(pieces) == "Emoji: " and detokenizer.stopped
    assert detokenizer.push(ours.encode("more")[0]) == "" and detokenizer.finish() == ""


def test_the_prompt_is_context_not_text(models):
    ours, _ = models["llama3-512"]
    prompt, answer = ours.encode("你好，世界"), ours.encode("！今天天气很好", add_special_tokens=False)
    pieces, _ = streamed(ours, answer, prompt_ids=prompt)
    assert "".join(pieces) == "！今天天气很好"


def test_each_push_decodes_a_window_not_the_whole_text(models):
    """O(new tokens) per push: the ids decoded at once stay few however long the text grows."""
    ours, _ = models["chatml-320"]

    class CountingModel(TextModel):
        longest = 0

        def decode(self, ids, skip_special_tokens=True):
            ids = list(ids)
            CountingModel.longest = max(CountingModel.longest, len(ids))
            return super().decode(ids, skip_special_tokens)

    counting = CountingModel(ours.tokenizer, ours.special, {}, None, {"type": "ByteLevel"})
    ids = ours.encode(" ".join(NON_ASCII_LINES) * 10)
    pieces, _ = streamed(counting, ids, prompt_ids=ids[:50])
    assert "".join(pieces) == ours.decode(ids)
    assert CountingModel.longest <= 8, CountingModel.longest


def test_an_empty_stop_string_is_refused(models):
    with pytest.raises(ValueError, match=r"stop\[1\]"):
        Detokenizer(models["chatml-320"][0], stop=["a", ""])
