"""Constrained decoding in the engine (serving/engine/constraint.py, the sampler's masks, the engine core's
steps): 1,000 answers sampled at temperature 1.0 over ten schemas all parse and validate; the mask never moves
an allowed token (greedy with a grammar the greedy answer fits is that answer, in the core over a random-weight
model); a grammar the compiler refuses is an InputError naming `grammar` and why; objects that list their
properties are closed to others."""

from __future__ import annotations

import dataclasses
import json
import re

import jsonschema
import numpy as np
import pytest
import tokenizers

from contract import generation
from contract.files import TOKENIZER_FILENAME, TRAINED_MODEL
from contract.grammar import Grammar
from contract.inputs import InputError
from contract.sampling import SamplingParams
from serving.engine import core
from serving.engine.constraint import Grammars, closed, masks
from serving.engine.sampler import Sampler, sample
from tests.fixtures.schemas import SCHEMAS
from tests.serving.test_core import WHOLE, Answers, engine_of, generate, static_engine

FORTUNES_VOCAB, FORTUNES_EOS = 2048, 0  # models/fortunes/config.json
LOGIT_SCALE = 3.0  # random logits about as spread as a small model's (the fortunes model's: ~3)


@pytest.fixture(scope="module")
def fortunes() -> tuple[Grammars, tokenizers.Tokenizer]:
    text = (TRAINED_MODEL / TOKENIZER_FILENAME).read_text()
    return Grammars(text, FORTUNES_VOCAB), tokenizers.Tokenizer.from_str(text)


def sampled_answers(grammars: Grammars, grammars_asked: list[Grammar], count: int, seed: int, budget: int) -> list:
    """`count` answers to each grammar, all picked together at temperature 1.0 from random logits, each until its
    grammar ends or `budget` tokens (the engine core's path: the batch's masks filled together, then one
    `sample` over the batch); the answers grammar by grammar."""
    rng = np.random.default_rng(seed)
    constraints = [grammars.compile(grammar, [FORTUNES_EOS]) for grammar in grammars_asked for _ in range(count)]
    samplers = [Sampler(SamplingParams(temperature=1.0, seed=seed * 100_000 + row)) for row in range(len(constraints))]
    answers: list[list[int]] = [[] for _ in constraints]
    live = list(range(len(constraints)))
    for _ in range(budget):
        if not live:
            break
        logits = rng.standard_normal((len(live), grammars.vocab_size), dtype=np.float32)
        logits *= LOGIT_SCALE
        picked = sample(logits, [samplers[row] for row in live], masks([constraints[row] for row in live]))
        for row, choice in zip(live, picked, strict=True):
            constraints[row].consume(choice.token)
            answers[row].append(choice.token)
        live = [row for row in live if not constraints[row].stopped]
    return [answers[at * count : (at + 1) * count] for at in range(len(grammars_asked))]


def without_end(answer: list[int], end: int = FORTUNES_EOS) -> list[int]:
    """An answer's tokens but its end: the end token where the model picked it while the grammar could go
    on, none where the grammar itself was complete."""
    return answer[:-1] if answer and answer[-1] == end else answer


def test_every_answer_of_1000_sampled_at_temperature_one_over_ten_schemas_parses_and_validates(fortunes):
    grammars, tokenizer = fortunes
    asked = [Grammar.json_schema(schema) for schema in SCHEMAS.values()]
    answered = sampled_answers(grammars, asked, 100, seed=0, budget=600)
    assert sum(len(answers) for answers in answered) == 1000
    for schema, answers in zip(SCHEMAS.values(), answered, strict=True):
        validator = jsonschema.Draft202012Validator(schema)  # the schema checked once, not per answer
        for answer in answers:
            text = tokenizer.decode(without_end(answer))
            validator.validate(json.loads(text))  # raises, naming the schema's rule broken


def test_regex_choice_and_lark_answers_match_their_grammars(fortunes):
    grammars, tokenizer = fortunes
    lark = 'start: "(" item ("," item)* ")"\nitem: /[0-9]/'
    asked = [Grammar.regex(r"[A-Z][a-z]{2,5}-[0-9]{3}"), Grammar.choice(["yes", "no", "maybe so"]), Grammar.lark(lark)]
    patterns, choices, parts = sampled_answers(grammars, asked, 50, seed=11, budget=64)
    for answer in patterns:
        assert re.fullmatch(r"[A-Z][a-z]{2,5}-[0-9]{3}", tokenizer.decode(without_end(answer)))
    for answer in choices:
        assert tokenizer.decode(without_end(answer)) in ("yes", "no", "maybe so")
    for answer in parts:
        text = tokenizer.decode(without_end(answer))
        assert text.startswith("(") and text.endswith(")") and all(item.isdigit() for item in text[1:-1].split(","))


def test_a_mask_never_moves_a_token_it_allows(fortunes):
    """Greedy under a mask is the unconstrained argmax whenever the mask allows it (and else an allowed token),
    and the logprob reported is the token's under the masked distribution."""
    grammars, _ = fortunes
    rng = np.random.default_rng(5)
    constraints = [grammars.compile(Grammar.json_schema(SCHEMAS["nested"]), [FORTUNES_EOS]) for _ in range(32)]
    allowed_argmax = 0
    for _ in range(20):
        live = [c for c in constraints if not c.stopped]
        logits = (LOGIT_SCALE * rng.standard_normal((len(live), FORTUNES_VOCAB))).astype(np.float32)
        allowed = masks(live)
        picked = sample(logits, [Sampler(SamplingParams(logprobs=2)) for _ in live], allowed)
        for row, (constraint, choice) in enumerate(zip(live, picked, strict=True)):
            best = int(np.argmax(logits[row]))
            assert allowed[row][choice.token]
            if allowed[row][best]:
                allowed_argmax += 1
                assert choice.token == best
            masked = np.where(allowed[row], logits[row].astype(np.float64), -np.inf)
            expected = masked[choice.token] - np.log(np.exp(masked - masked.max()).sum()) - masked.max()
            assert choice.logprob == pytest.approx(expected, abs=1e-5)
            assert all(allowed[row][token] for token, _ in choice.top)
            constraint.consume(choice.token)
    assert allowed_argmax > 0  # the case the test is about happened


@pytest.mark.parametrize(
    ("grammar", "why"),
    [
        (Grammar.json_schema({"type": "objekt"}), "Invalid type: objekt"),
        (Grammar.regex("(?<=a)b"), "look-around"),
        (Grammar.lark("start: missing"), 'unknown name: "missing"'),
        (Grammar("xml", "<a/>"), "expected one of the kinds"),
        (Grammar.choice([]), "non-empty strings"),
    ],
)
def test_a_grammar_the_compiler_refuses_is_an_input_error_naming_why(fortunes, grammar, why):
    with pytest.raises(InputError, match="input 'grammar'") as refused:
        fortunes[0].compile(grammar, [FORTUNES_EOS])
    assert why in str(refused.value)


def test_a_grammar_needs_an_end_token_and_a_tokenizer(fortunes):
    with pytest.raises(InputError, match="needs stop_token_ids"):
        fortunes[0].compile(Grammar.json_object(), [])
    with pytest.raises(InputError, match="serves no tokenizer"):
        Grammars(None, 64).compile(Grammar.json_object(), [2])
    with pytest.raises(InputError, match="needs stop_token_ids"):
        generation.GenerationRequest(grammar=Grammar.json_object()).check(vocab_size=64, max_seq_len=64)


def test_a_grammar_travels_as_one_request_parameter_and_back():
    asked = generation.GenerationRequest(stop_token_ids=(2,), grammar=Grammar.json_schema(SCHEMAS["enum"]))
    assert generation.GenerationRequest.from_parameters(asked.to_parameters()) == asked
    with pytest.raises(InputError, match="input 'grammar': expected an object of one key"):
        generation.GenerationRequest.from_parameters({"grammar": '{"regex": "a", "lark": "b"}'})


def test_objects_that_list_their_properties_are_closed_to_others_and_nothing_else_changes():
    schema = {
        "type": "object",
        "properties": {"properties": {"type": "object", "properties": {"a": {"type": "integer"}}}},
        "$defs": {"open": {"type": "object", "properties": {}, "additionalProperties": True}},
        "anyOf": [{"type": "object"}, {"properties": {"b": {"const": {"properties": {}}}}}],
    }
    assert closed(schema) == {
        "type": "object",
        "properties": {
            "properties": {"type": "object", "properties": {"a": {"type": "integer"}}, "additionalProperties": False}
        },
        "$defs": {"open": {"type": "object", "properties": {}, "additionalProperties": True}},
        "anyOf": [
            {"type": "object"},
            {"properties": {"b": {"const": {"properties": {}}}}, "additionalProperties": False},
        ],
        "additionalProperties": False,
    }


# --- in the engine core, over the random-weight whole model ---------------------------------------------------


@pytest.fixture
def whole_core(artifact_dir) -> core.EngineCore:
    engine_core = core.EngineCore(engine_of(artifact_dir, kv_rows=16)).start()
    yield engine_core
    engine_core.stop()


@pytest.fixture(scope="module")
def whole_text(artifact_dir) -> tuple[Grammars, tokenizers.Tokenizer, int]:
    folder = artifact_dir(WHOLE)
    text = (folder / TOKENIZER_FILENAME).read_text()
    tokenizer = tokenizers.Tokenizer.from_str(text)
    return Grammars(text, tokenizer.get_vocab_size()), tokenizer, tokenizer.token_to_id("</s>")


def constrained(engine_core, grammars: Grammars, sid, prompt, grammar: Grammar, end: int, **sampling) -> Answers:
    """A stateless constrained generation submitted to the core, its grammar compiled as sessions does."""
    answers = Answers()
    max_new_tokens = sampling.pop("max_new_tokens", 60)
    request = generation.GenerationRequest(
        max_new_tokens=max_new_tokens, stop_token_ids=(end,), sampling=SamplingParams(**sampling), grammar=grammar
    )
    request = dataclasses.replace(request, session_start=True, session_end=True)
    constraint = grammars.compile(grammar, (end,))
    prompt = np.asarray(prompt, np.int64)
    engine_core.submit(core.Generate(sid, answers, prompt=prompt, asked=request, constraint=constraint))
    return answers


SHORT_SCHEMAS = ("enum", "bounded_array", "pattern", "deep")  # answers that fit the whole model's 64 positions


def test_constrained_generations_decoded_together_in_the_core_answer_valid_json_and_stop(whole_core, whole_text):
    grammars, tokenizer, end = whole_text
    engine_core = whole_core
    asked = {
        (name, seed): constrained(
            engine_core,
            grammars,
            1000 + 10 * at + seed,
            [5, 6, 7],
            Grammar.json_schema(SCHEMAS[name]),
            end,
            temperature=1.0,
            seed=seed,
        )
        for at, name in enumerate(SHORT_SCHEMAS)
        for seed in range(6)
    }
    for (name, _), answers in asked.items():
        answers.wait()
        assert answers.error is None and answers.reason == generation.STOP, (name, answers.error)
        jsonschema.validate(json.loads(tokenizer.decode(without_end(answers.tokens, end))), SCHEMAS[name])
    assert engine_core.stats.mask_fill_seconds > 0  # the masks were filled (beside the graph runs)


@pytest.fixture
def fortunes_core(trained_artifact) -> core.EngineCore:
    """The engine core over the shipped fortunes model's static engine, in process."""
    engine_core = core.EngineCore(static_engine(trained_artifact, kv_rows=4)).start()
    yield engine_core
    engine_core.stop()


def literal(text: str) -> str:
    """`text` as a regular expression (Rust's syntax) that matches it alone."""
    return "".join(char if char.isalnum() or char == " " else f"\\x{{{ord(char):X}}}" for char in text)


def test_greedy_with_a_grammar_its_answer_fits_is_the_unconstrained_greedy(fortunes_core, fortunes):
    """The mask never changes an allowed token: the fortunes model's greedy text, given back as a regular
    expression it matches (itself, then any words), is generated token for token as it was without a grammar,
    its end included."""
    grammars, tokenizer = fortunes
    compared = 0
    for seed, start in enumerate(STARTS):
        prompt = tokenizer.encode(start).ids
        free = generate(fortunes_core, 2000 + seed, prompt, max_new_tokens=24, stop_token_ids=(FORTUNES_EOS,))
        words = tokenizer.decode(without_end(free.wait().tokens))
        if len(without_end(free.tokens)) < 4:  # a fortune that ends at once says little
            continue
        pattern = Grammar.regex(literal(words) + r"[\w ]*")
        forced = constrained(fortunes_core, grammars, 3000 + seed, prompt, pattern, FORTUNES_EOS, max_new_tokens=24)
        assert forced.wait().tokens[: len(free.tokens)] == free.tokens, (words, tokenizer.decode(forced.tokens))
        compared += 1
    assert compared >= 3, "too few greedy answers of four tokens or more to compare"


STARTS = (
    "The meaning of life is",
    "Q: Why did the chicken cross the road?\nA:",
    "A fool and his money",
    "Never trust a",
    "You will be",
    "The only thing",
    "It is a truth universally",
    "Once upon a time there",
)
