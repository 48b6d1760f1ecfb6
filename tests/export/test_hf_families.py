"""The checkpoints people have, imported WHOLE (token ids in, logits out): a Llama (sharded, Llama 3's
rotary scaling), a Mistral (a sliding window), a Qwen2 (q/k/v biases), a Qwen3 (q/k norms, its own
head_dim), a Phi-3 (packed qkv_proj and gate_up_proj, partial rotary) and a GPT-2 (LayerNorm with biases,
learned positions, Conv1D weights, a tied head), each made by transformers from a small config with random
weights (no download), its logits spread wide (the head scaled) so that the greedy token is clear, saved with
`save_pretrained`, imported through `python -m export build --weights FOLDER --layout hf`, and proven against
transformers' own *ForCausalLM: at import (report.json's source_check), through ONNX Runtime (the fp32-fused
graph, and the fp32-static graph through the serving engine's KVPool) over a left-padded batch prefill and
32 greedy decode steps (logits within 1e-5 of their scale, every greedy token the same), and through a real
Triton (a session and stateless calls). One family also imported `--attention-only`, its attention blocks
proven against transformers' attention classes as before."""

from __future__ import annotations

import concurrent.futures
import json
import multiprocessing
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers  # a dev dependency (make install): the source models, built from configs

from client import Client
from contract import files, names
from contract.config import ModelConfig
from contract.inputs import default_positions
from export.__main__ import main as export_main
from export.importers import import_weights
from serving.engine.kv_pool import KVPool
from serving.engine.ort import ort_runner, ort_session
from serving.host.launcher import start_triton
from serving.triton import config as triton_config
from serving.triton.config import FORWARD, SESSIONS, TRITON_CONFIG_FILENAME, ServingSettings
from serving.triton.repository import write_repository
from tests.fixtures.prebuilds import folder_job
from tests.fixtures.stops import stopped_later
from tests.fixtures.text import save_tokenizer
from tests.fixtures.triton import selected

VOCAB = 320  # a byte-level BPE tokenizer's (tests/fixtures/text.py): the byte alphabet, specials, merges
COMMON = {
    "hidden_size": 64,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "num_hidden_layers": 2,
    "intermediate_size": 96,
    "vocab_size": VOCAB,
    # short: the static form's pool rung at build decodes until its rows are full (export/parity.py); long
    # enough for a chat template's prompt of a 320-token vocabulary and its answer
    "max_position_embeddings": 160,
    "rms_norm_eps": 1e-5,
    "pad_token_id": 0,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "tie_word_embeddings": False,
}
LLAMA3 = {
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}
FAMILIES = {
    "llama": lambda: transformers.LlamaConfig(rope_parameters=LLAMA3, **COMMON),
    "mistral": lambda: transformers.MistralConfig(sliding_window=8, **COMMON),
    "qwen2": lambda: transformers.Qwen2Config(**COMMON),
    "qwen3": lambda: transformers.Qwen3Config(head_dim=32, **COMMON),
    "phi3": lambda: transformers.Phi3Config(  # 128 wide: a rotated width of 16, as GroupQueryAttention needs
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
        **(COMMON | {"hidden_size": 128}),
    ),
    "gpt2": lambda: transformers.GPT2Config(
        n_embd=64, n_head=4, n_layer=2, vocab_size=VOCAB, n_positions=160, bos_token_id=1, eos_token_id=2
    ),
}
CLASSES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "phi3": "Phi3ForCausalLM",
    "gpt2": "GPT2LMHeadModel",
}
BATCH, PREFILL, PADDING, STEPS = 2, 7, 3, 32
# the head scaled from transformers' init (std 0.02) so that logits spread to a scale of 20 to 50: greedy
# margins far above the 1e-5 of it the sides may differ by (export/parity.py, SCALE_BOUND)
HEAD_SCALE = 40.0
SETTINGS = ServingSettings(threads=1, kv_cache_bytes=4 << 20, max_batch_size=4)


def save_and_import(family: str, work: Path) -> None:
    """A family's checkpoint saved in `work`/checkpoint and imported by the documented command into
    `work`/artifact (run in a process of its own: `checkpoints` builds two families at a time)."""
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(FAMILIES[family](), attn_implementation="eager")
    with torch.no_grad():
        for parameter in model.parameters():
            if parameter.dim() == 1:  # norms and biases away from their initial ones and zeros
                parameter.add_(0.1 * torch.randn_like(parameter))
        model.get_output_embeddings().weight.mul_(HEAD_SCALE)  # GPT-2's is its token embeddings (tied)
    model.save_pretrained(work / "checkpoint", max_shard_size="100KB" if family == "llama" else "50MB")  # sharded
    save_tokenizer(work / "checkpoint", VOCAB, template="llama3" if family == "llama" else "chatml")
    argv = ["build", "--weights", str(work / "checkpoint"), "--layout", "hf", "--out", str(work / "artifact")]
    assert export_main([*argv, "--variants", "fp32-fused,fp32-static"]) == 0


class Checkpoint:
    """A family's checkpoint on disk, its artifact, and transformers' CausalLM read back from the folder."""

    def __init__(self, family: str, work: Path) -> None:
        self.family = family
        self.dir, self.artifact = work / "checkpoint", work / "artifact"
        self.cfg = ModelConfig.load(self.artifact / files.MODEL_CONFIG_FILENAME)
        self.source = transformers.AutoModelForCausalLM.from_pretrained(
            str(self.dir), dtype=torch.float32, attn_implementation="eager"
        ).eval()

    def greedy(self, ids: np.ndarray, mask: np.ndarray, steps: int) -> tuple[np.ndarray, np.ndarray]:
        """transformers over a (left-padded) prefill then `steps` greedy steps: every token fed (B, T + steps)
        and the logits at each (B, T + steps, vocab)."""
        tokens, logits, past, mask = [ids], [], None, torch.from_numpy(mask)
        step = torch.from_numpy(ids)
        with torch.no_grad():
            for _ in range(steps + 1):
                positions = torch.from_numpy(default_positions(mask.numpy(), step.shape[1]))
                out = self.source(input_ids=step, attention_mask=mask, position_ids=positions, past_key_values=past)
                past, step = out.past_key_values, out.logits[:, -1:].argmax(-1)
                logits.append(out.logits.numpy())
                tokens.append(step.numpy())
                mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
        return np.concatenate(tokens[:-1], axis=1), np.concatenate(logits, axis=1)


FAMILY_PARAMS = {"checkpoint", "family"}


def prebuild_jobs(item) -> dict:
    """The family this test takes, saved and imported ahead in the background (tests/fixtures/prebuilds.py)."""
    params = getattr(getattr(item, "callspec", None), "params", {})
    return {
        family_key(params[name]): folder_job(family_key(params[name]), save_and_import, params[name])
        for name in FAMILY_PARAMS & set(params)
    }


def family_key(family: str) -> str:
    return f"hf-{family}"


@pytest.fixture(scope="module")
def checkpoints(request, tmp_path_factory, prebuilds):
    """family -> its Checkpoint: the families this run's tests take, saved and imported ahead in the background
    (tests/fixtures/prebuilds.py) or, those not scheduled there, two at a time in processes of their own (each
    build is single-threaded: two fill two cores) from the module's start; each waited for when first asked for."""
    families = sorted(selected(request, "checkpoint") | selected(request, "family"))
    made: dict[str, Checkpoint] = {}
    work: dict[str, Path] = {}
    spawn = multiprocessing.get_context("spawn")  # a fork would copy this process's torch threads
    with concurrent.futures.ProcessPoolExecutor(2, mp_context=spawn) as pool:

        def build_here(family: str) -> concurrent.futures.Future:
            work[family] = tmp_path_factory.mktemp(family_key(family))
            return pool.submit(save_and_import, family, work[family])

        built = {family: build_here(family) for family in families if not prebuilds.scheduled(family_key(family))}

        def get(family: str) -> Checkpoint:
            if family not in made:
                ahead = prebuilds.wait(family_key(family))
                if ahead is not None:
                    work[family] = ahead
                else:
                    (built.get(family) or build_here(family)).result()
                made[family] = Checkpoint(family, work[family])
            return made[family]

        yield get


@pytest.fixture(scope="module", params=list(FAMILIES))
def checkpoint(request, checkpoints):
    return checkpoints(request.param)


def left_padded(seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Random token ids (BATCH, PREFILL) and their mask, row 0's first PADDING positions padding."""
    ids = np.random.default_rng(seed).integers(0, VOCAB, (BATCH, PREFILL), dtype=np.int64)
    mask = np.ones((BATCH, PREFILL), np.int64)
    mask[0, :PADDING] = 0
    return ids, mask


def real_positions(width: int) -> np.ndarray:
    """(BATCH, width) True where a position is a token, not padding."""
    real = np.ones((BATCH, width), bool)
    real[0, :PADDING] = False
    return real


def assert_same_logits(actual: np.ndarray, expected: np.ndarray, what: str) -> None:
    """Within 1e-5 of the logits' scale, and the greedy token the same at every position."""
    scale = float(np.abs(expected).max())
    error = float(np.abs(actual.astype(np.float64) - expected).max())
    print(f"{what}: max abs error {error:.2e} on logits of scale {scale:.1f} ({error / scale:.1e} of it)")
    assert error <= 1e-5 * scale, what
    np.testing.assert_array_equal(actual.argmax(-1), expected.argmax(-1), err_msg=what)


def test_the_import_was_proven_against_the_causal_lm_at_build(checkpoint):
    report = json.loads((checkpoint.artifact / files.REPORT_FILENAME).read_text())
    check = report["source_check"]
    assert check["checked"] and check["passed"], check
    assert check["relative"] <= 1e-5 and check["greedy_different"] == 0, check
    assert CLASSES[checkpoint.family] in check["module"]
    assert report["weights"]["whole"] and "left_out" not in report["weights"]
    assert checkpoint.cfg.whole and checkpoint.cfg.vocab_size == VOCAB
    if checkpoint.family == "llama":
        assert len(report["weights"]["shards"]) > 1
    print(f"{checkpoint.family} at import: {check['max_abs']:.2e} of scale {check['scale']:.1f}")


def test_the_fused_graph_equals_the_causal_lm_over_a_left_padded_prefill_and_greedy_steps(checkpoint):
    ids, mask = left_padded(seed=1)
    tokens, expected = checkpoint.greedy(ids, mask, STEPS)
    run = ort_runner(ort_session(checkpoint.artifact / files.model_filename("fp32-fused")))
    feeds = {names.INPUT_IDS: ids, names.ATTENTION_MASK: mask}
    logits = []
    for t in range(PREFILL, PREFILL + STEPS + 1):
        feeds[names.POSITION_IDS] = default_positions(feeds[names.ATTENTION_MASK], feeds[names.INPUT_IDS].shape[1])
        result = run(feeds)
        logits.append(result[names.LOGITS])
        feeds = {n.replace("present", "past_key_values"): v for n, v in result.items() if n.startswith("present.")}
        feeds[names.INPUT_IDS] = tokens[:, t : t + 1]
        feeds[names.ATTENTION_MASK] = np.ones((BATCH, t + 1), np.int64)
        feeds[names.ATTENTION_MASK][0, :PADDING] = 0
    real = real_positions(PREFILL + STEPS)
    actual = np.concatenate(logits, axis=1)
    assert_same_logits(actual[real], expected[real], f"{checkpoint.family} fp32-fused")


def test_the_static_graph_in_the_serving_pool_equals_the_causal_lm(checkpoint):
    """The engine's KVPool: each row's real tokens alone (no padding), positions counted from its length:
    the left-padded row's logits are transformers' at its real positions."""
    ids, mask = left_padded(seed=2)
    tokens, expected = checkpoint.greedy(ids, mask, STEPS)
    session = ort_session(checkpoint.artifact / files.model_filename("fp32-static"))
    pool = KVPool(session, checkpoint.cfg, rows=BATCH, capacity=checkpoint.cfg.max_seq_len)
    firsts = {row: PADDING if row == 0 else 0 for row in range(BATCH)}
    results = pool.run({row: tokens[row, first:PREFILL] for row, first in firsts.items()})
    logits = {row: [results[row]] for row in firsts}
    for t in range(PREFILL, PREFILL + STEPS):
        for row, result in pool.run({row: tokens[row, t : t + 1] for row in firsts}).items():
            logits[row].append(result)
    for row, first in firsts.items():
        actual = np.concatenate(logits[row], axis=0)  # (T_row, vocab)
        assert_same_logits(actual, expected[row, first:], f"{checkpoint.family} fp32-static row {row}")


def test_attention_only_keeps_the_attention_blocks_proven_and_lists_the_rest(tmp_path):
    """The import `--attention-only` makes (export/importers.py; the CLI passes the flag through, and
    tests/serving/test_imported_models.py builds and serves one): the attention blocks of a whole checkpoint,
    proven against the family's attention classes, the rest listed."""
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(FAMILIES["qwen3"](), attn_implementation="eager")
    model.save_pretrained(tmp_path / "checkpoint")
    imported = import_weights(tmp_path / "checkpoint", "hf", attention_only=True)
    check = imported.source_check
    assert check["passed"] and "Qwen3Attention" in check["module"] and check["max_abs"] <= 1e-5, check
    assert {"model.embed_tokens", "lm_head", "model.norm", "model.layers.{i}.mlp"} <= set(imported.weights["left_out"])
    assert not imported.model.cfg.whole


def served_name(model: str, family: str) -> str:
    return f"{model}-{family}"


@pytest.fixture(scope="module")
def served(request, checkpoints, tmp_path_factory):
    """One real Triton for the module, serving every family's `forward` and `sessions` as its repository has
    them, each pair under the family's name (`forward-llama`, `sessions-llama`): the config's name is the
    folder's; the rest is what `write_repository` wrote (Triton starts and stops in seconds: once)."""
    work = tmp_path_factory.mktemp("hf-served")
    repository = work / "repository"
    for family in sorted(selected(request, "checkpoint") | selected(request, "family")):
        own = write_repository(checkpoints(family).artifact, work / family, SETTINGS, models=(FORWARD, SESSIONS))
        for model in (FORWARD, SESSIONS):  # the session model generates too
            target = shutil.copytree(own / model, repository / served_name(model, family))
            config = triton_config.parse((target / TRITON_CONFIG_FILENAME).read_text())
            config.name = target.name
            (target / TRITON_CONFIG_FILENAME).write_text(triton_config.to_text(config))
    with stopped_later(start_triton(repository, log_path=work / "triton.log")) as server:
        yield server


@pytest.mark.served
def test_served_a_session_and_stateless_calls_equal_the_causal_lm(checkpoint, served):
    """One row (no padding), a prefill then greedy steps: the session's logits and a stateless call over
    the whole sequence against transformers'."""
    ids = np.random.default_rng(3).integers(0, VOCAB, (1, PREFILL), dtype=np.int64)
    tokens, expected = checkpoint.greedy(ids, np.ones_like(ids), STEPS)
    family = checkpoint.family
    with Client(served.grpc_url, **served_models(family)) as client:
        with client.session() as session:
            logits = [session.step(tokens[:, :PREFILL])]
            logits += [session.step(tokens[:, t : t + 1]) for t in range(PREFILL, PREFILL + STEPS)]
        assert_same_logits(np.concatenate(logits, axis=1), expected, f"{family} served session")
        stateless = client.infer(tokens).output  # (1, PREFILL + STEPS, vocab)
        assert_same_logits(stateless, expected, f"{family} served stateless")


def served_models(family: str) -> dict[str, str]:
    """The client's model names for a family served under its own names."""
    return {"model": served_name(FORWARD, family), "session_model": served_name(SESSIONS, family)}


GENERATED = 24


@pytest.mark.served
@pytest.mark.parametrize("family", ["llama", "gpt2"])  # a sharded Llama folder and a GPT-2 folder (issue 31)
def test_served_generation_is_transformers_greedy_generate(family, checkpoints, served):
    """`session.generate(ids, max_new_tokens=24, temperature=0.0)` on the server yields exactly the tokens of
    transformers' own `generate(do_sample=False)` (its EOS a stop token on both sides); the session then
    holds the prompt and every generated token, and a stateless generation gives the same."""
    checkpoint = checkpoints(family)
    ids = np.random.default_rng(5).integers(3, VOCAB, (1, PREFILL), dtype=np.int64)
    with torch.no_grad():
        expected = checkpoint.source.generate(
            torch.from_numpy(ids),
            attention_mask=torch.ones_like(torch.from_numpy(ids)),
            max_new_tokens=GENERATED,
            do_sample=False,
            eos_token_id=2,
            pad_token_id=0,
        )[0, PREFILL:].tolist()
    with Client(served.grpc_url, **served_models(checkpoint.family)) as client:
        with client.session() as session:
            generated = session.generate(ids, max_new_tokens=GENERATED, temperature=0.0, stop_token_ids=[2])
            assert list(generated) == expected, checkpoint.family
            assert generated.finish_reason == ("stop" if expected[-1] == 2 else "length")
            assert session.length == generated.held_length == PREFILL + len(expected)
        stateless = client.generate(ids[0], max_new_tokens=GENERATED, stop_token_ids=[2])
        assert list(stateless) == expected


# --- text in, text out: the OpenAI-compatible routes over the served folders (issue 32) -----------------------

KEY = "hf-key"


@pytest.fixture(scope="module")
def gateways(served):
    """family -> a real gateway (uvicorn on a free port) in front of the module's Triton, serving the family's
    models under the OpenAI id `family`; started when first asked for."""
    from serving.gateway import Settings
    from serving.gateway.server import run_gateway

    started = {}

    def get(family: str):
        if family not in started:
            models = served_models(family)
            settings = Settings(
                port=0,
                log_level="warning",
                api_keys=(KEY,),
                triton_url=served.grpc_url,
                served_model_name=family,
                **models,
            )
            started[family] = run_gateway(settings)
        return started[family]

    yield get
    for gateway in started.values():
        gateway.stop()


def openai_client(gateway):
    import openai

    return openai.OpenAI(base_url=f"{gateway.url}/v1", api_key=KEY, max_retries=0, timeout=60)


def tokenizer_of(checkpoint: Checkpoint):
    return transformers.AutoTokenizer.from_pretrained(str(checkpoint.dir))


def greedy_text(checkpoint: Checkpoint, ids: list[int], new: int) -> tuple[str, list[int]]:
    """transformers' greedy `generate` after `ids`, its EOS a stop (as the served model's generation_config
    says), decoded by the checkpoint's own tokenizer: (the text, the ids generated)."""
    prompt = torch.tensor([ids])
    with torch.no_grad():
        out = checkpoint.source.generate(
            prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=new, do_sample=False, pad_token_id=0
        )[0, len(ids) :].tolist()
    return tokenizer_of(checkpoint).decode(out, skip_special_tokens=True), out


PROMPT = "The quick brown fox jumps over"
CONVERSATION = [
    {"role": "system", "content": "You answer briefly."},
    {"role": "user", "content": "Where is São Paulo? 你好"},
]
NEW = 12


@pytest.mark.served
@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_openai_completions_and_chat_are_transformers_greedy_text(family, checkpoints, gateways):
    """Done when of issue 32: `/v1/completions` (plain and streamed) and `/v1/chat/completions` at temperature 0,
    through the official openai SDK, return exactly the text of transformers' greedy generate decoded by the
    same tokenizer (the chat prompt rendered by transformers' apply_chat_template), with its usage."""
    checkpoint = checkpoints(family)
    client = openai_client(gateways(family))
    ids = tokenizer_of(checkpoint)(PROMPT)["input_ids"]
    expected, generated = greedy_text(checkpoint, ids, NEW)
    answer = client.completions.create(model=family, prompt=PROMPT, max_tokens=NEW, temperature=0)
    assert answer.choices[0].text == expected
    assert answer.choices[0].finish_reason == ("stop" if generated[-1] == 2 else "length")
    assert (answer.usage.prompt_tokens, answer.usage.completion_tokens) == (len(ids), len(generated))
    stream = client.completions.create(
        model=family, prompt=PROMPT, max_tokens=NEW, temperature=0, stream=True, stream_options={"include_usage": True}
    )
    chunks = list(stream)
    assert "".join(chunk.choices[0].text for chunk in chunks if chunk.choices) == expected
    assert chunks[-1].usage.completion_tokens == len(generated) and not chunks[-1].choices

    chat_ids = tokenizer_of(checkpoint).apply_chat_template(CONVERSATION, add_generation_prompt=True)
    chat_ids = list(chat_ids["input_ids"] if isinstance(chat_ids, dict) or hasattr(chat_ids, "keys") else chat_ids)
    expected_reply, _ = greedy_text(checkpoint, chat_ids, NEW)
    reply = client.chat.completions.create(model=family, messages=CONVERSATION, max_tokens=NEW, temperature=0)
    assert reply.choices[0].message.content == expected_reply and reply.choices[0].message.role == "assistant"
    assert reply.usage.prompt_tokens == len(chat_ids)


@pytest.mark.served
@pytest.mark.parametrize("family", ["llama"])  # the families the module serves
def test_openai_next_turn_forks_the_last_turns_kv_and_answers_what_a_cold_prefill_does(family, checkpoints, gateways):
    """Turn 2 re-sends turn 1 and its answer: the gateway forks turn 1's kept session (cached_tokens: every token
    the two share) and prefills only the rest, and the reply is transformers' greedy reply to the whole prompt."""
    checkpoint = checkpoints("llama")
    client = openai_client(gateways("llama"))
    opening = [{"role": "user", "content": "Name a city."}]  # no earlier request of this key began so
    first = client.chat.completions.create(model="llama", messages=opening, max_tokens=6, temperature=0)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    turn = [*opening, {"role": "assistant", "content": first.choices[0].message.content}]
    turn.append({"role": "user", "content": "And Łódź?"})
    ids = list(tokenizer_of(checkpoint).apply_chat_template(turn, add_generation_prompt=True)["input_ids"])
    second = client.chat.completions.create(model="llama", messages=turn, max_tokens=6, temperature=0)
    assert second.usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens
    assert second.choices[0].message.content == greedy_text(checkpoint, ids, 6)[0]


@pytest.mark.served
@pytest.mark.parametrize("family", ["gpt2"])  # the families the module serves
def test_openai_stop_strings_n_seeds_and_streaming_add_up(family, checkpoints, gateways):
    """Sampled text: a seeded request repeats; its streamed pieces concatenate to the text answered whole; a
    stop string cuts the text before it (left out); `n` choices of one prompt each follow their own seed."""
    client = openai_client(gateways("gpt2"))
    asked = {"model": "gpt2", "prompt": PROMPT, "max_tokens": 16, "temperature": 1.0, "seed": 7}
    whole = client.completions.create(**asked).choices[0].text
    assert client.completions.create(**asked).choices[0].text == whole
    streamed = "".join(chunk.choices[0].text for chunk in client.completions.create(**asked, stream=True))
    assert streamed == whole
    stop = whole[3:5] if len(whole) >= 5 else whole[-1:]
    cut = client.completions.create(**asked, stop=[stop]).choices[0]
    assert cut.text == whole[: whole.index(stop)] and cut.finish_reason == "stop"
    streamed_cut = client.completions.create(**asked, stop=stop, stream=True)
    assert "".join(chunk.choices[0].text for chunk in streamed_cut) == cut.text
    both = client.completions.create(**asked, n=2)
    assert [choice.index for choice in both.choices] == [0, 1]
    assert both.choices[0].text == whole  # choice i draws with seed + i: choice 0 is the single request's
    assert both.usage.prompt_tokens == len(tokenizer_of(checkpoints("gpt2"))(PROMPT)["input_ids"])


@pytest.mark.served
@pytest.mark.parametrize("family", ["llama"])  # the families the module serves
def test_openai_echo_with_logprobs_scores_the_prompt_as_transformers_does(family, checkpoints, gateways):
    """`echo` with `logprobs` and max_tokens 0 (how perplexity tools call a server): the prompt's text and each
    prompt token's logprob given the ones before it, within 2e-5 of the logits' scale of transformers' own
    log_softmax (the fp32 graphs match its logits to 1e-5 of their scale, export/parity.py; a log_softmax
    moves by at most twice its inputs' error), the first token's None."""
    checkpoint = checkpoints("llama")
    client = openai_client(gateways("llama"))
    ids = tokenizer_of(checkpoint)(PROMPT)["input_ids"]
    answer = client.completions.create(model="llama", prompt=PROMPT, max_tokens=0, echo=True, logprobs=2)
    choice = answer.choices[0]
    assert choice.text == tokenizer_of(checkpoint).decode(ids)
    with torch.no_grad():
        logits = checkpoint.source(torch.tensor([ids])).logits[0].double()
    expected = torch.log_softmax(logits[:-1], -1).gather(1, torch.tensor(ids[1:])[:, None])[:, 0].numpy()
    scores = choice.logprobs.token_logprobs
    assert scores[0] is None and len(scores) == len(ids)
    np.testing.assert_allclose(scores[1:], expected, rtol=0, atol=2e-5 * float(logits.abs().max()))
    assert all(len(top) == 2 for top in choice.logprobs.top_logprobs[1:])


@pytest.mark.served
@pytest.mark.parametrize("family", ["gpt2"])  # the families the module serves
def test_openai_errors_are_openais_shape_and_leave_the_gateway_serving(family, checkpoints, gateways):
    import openai

    gateway = gateways("gpt2")
    client = openai_client(gateway)
    with pytest.raises(openai.NotFoundError) as missing:
        client.completions.create(model="gpt-4o", prompt=PROMPT)
    assert missing.value.body["type"] == "not_found_error" and missing.value.body["param"] == "model"
    with pytest.raises(openai.BadRequestError) as hot:
        client.completions.create(model="gpt2", prompt=PROMPT, temperature=3.5)
    assert hot.value.body["param"] == "temperature"
    with pytest.raises(openai.BadRequestError) as suffix:
        client.completions.create(model="gpt2", prompt=PROMPT, suffix="!")
    assert "suffix" in suffix.value.body["message"]
    with pytest.raises(openai.BadRequestError) as long:
        client.completions.create(model="gpt2", prompt=PROMPT, max_tokens=4096)
    assert "max_seq_len" in long.value.body["message"] and long.value.body["param"] == "max_tokens"
    # 2 prompts x 9 choices: 18 sessions at once, the key may hold 16: never servable, so a 400, not a 429 that
    # the SDK would retry
    with pytest.raises(openai.BadRequestError) as many:
        client.completions.create(model="gpt2", prompt=[PROMPT, PROMPT], n=9, max_tokens=1)
    assert "run 18 sessions at once, more than the 16" in many.value.body["message"]
    assert many.value.body["param"] == "prompt"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{gateway.url}/v1", api_key="wrong", max_retries=0).models.list()
    listed = client.models.list()
    assert [model.id for model in listed.data] == ["gpt2"]
    assert client.completions.create(model="gpt2", prompt=PROMPT, max_tokens=2).choices[0].text is not None


@pytest.mark.served
@pytest.mark.parametrize("family", ["llama"])  # the families the module serves
def test_openai_a_request_bound_to_a_session_sends_only_what_its_prompt_adds(family, checkpoints, gateways):
    """The `session` extension: requests go on in a session the caller holds; the second turn reuses what the
    first left in it (cached_tokens), and the session ends with the caller's DELETE."""
    import httpx

    gateway = gateways("llama")
    client = openai_client(gateway)
    with httpx.Client(base_url=gateway.url, headers={"Authorization": f"Bearer {KEY}"}) as api:
        session = api.post("/v1/sessions").json()["id"]
        first = client.chat.completions.create(
            model="llama", messages=CONVERSATION, max_tokens=4, temperature=0, extra_body={"session": session}
        )
        turn = [*CONVERSATION, {"role": "assistant", "content": first.choices[0].message.content}]
        turn.append({"role": "user", "content": "Thanks"})
        second = client.chat.completions.create(
            model="llama", messages=turn, max_tokens=4, temperature=0, extra_body={"session": session}
        )
        assert second.usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens
        assert api.delete(f"/v1/sessions/{session}").status_code == 204
