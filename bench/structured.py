"""Structured outputs' cost: generation tokens/s under a JSON schema's constraint against without, in the engine
core in-process. Goal (issue 44): constrained at most 10% slower at 16 at once (reported, never asserted).

The model: the one trained here (models/fortunes) built to our artifact's fp32-static graph in `--work` (reused),
or any artifact with that graph and a tokenizer.json (`--artifact`). Each of `concurrency` generations prompts
`prompt` and samples at temperature 1, a seed of its own (a round's seeds the same for both candidates), until an
end id or `tokens`; `json-schema`'s under `schema` (serving/engine/constraint.py: a mask filled beside the graph
run), each constraint compiled before the round's clock starts, as the server compiles off the loop's thread.
tokens/s: every generated token over the round's wall time, median over interleaved rounds. A JSON answer ends
sooner than free text, so the batches empty at different paces: rows/step says how full the steps were, and the
full-batch ratio compares the loop's step time where every generation picked in the step and the one before.
Per step (the core's gauges): the graph run, the masks' fill and the loop's wait for them. Every constrained
answer is validated (jsonschema). Compiling: a fresh compiler's first schema (it reads the tokenizer), then each.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import itertools
import json
import threading
import time
from pathlib import Path

import numpy as np

from bench import results as output
from bench.plot import figure, gridded, grouped_bars, save
from bench.timing import Budget, interleaved, measure
from client.text import TextModel
from contract import files
from contract.config import ModelConfig
from contract.generation import FINISH_REASON, TOKEN_ID, GenerationRequest
from contract.grammar import Grammar
from contract.sampling import SamplingParams
from serving.engine.constraint import Grammars

UNCONSTRAINED, CONSTRAINED = "unconstrained", "json-schema"
CANDIDATES = (UNCONSTRAINED, CONSTRAINED)
VARIANT = "fp32-static"  # the graph sessions serves on the CPU
PROMPT = "Answer in JSON:"
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
    },
    "required": ["name", "age", "tags"],
}
GOAL_COUNT, GOAL_RATIO = 16, 0.9  # at 16 at once, constrained tokens/s at least 90% of unconstrained's
WARMUP_TOKENS = 8
SEQUENCES = itertools.count(1 << 40)


class BenchError(RuntimeError):
    """The benchmark cannot run as asked."""


@dataclasses.dataclass(frozen=True)
class Plan:
    prompt: str = PROMPT
    tokens: int = 96  # the most a generation answers: room for the schema's longest answer on fortunes
    concurrency: tuple[int, ...] = (1, 16)
    rounds: int = 5
    compile_repeats: int = 20
    seed: int = 0


@dataclasses.dataclass(frozen=True)
class Model:
    artifact: Path
    cfg: ModelConfig
    text: TextModel
    end_ids: tuple[int, ...]
    prompt: np.ndarray  # (T,) int64


@dataclasses.dataclass
class Step:
    """One core step that picked tokens: its gauges, read as its first token was answered (on the core's thread
    after the step's masks and graph run: `iterations` already counts it), and the tokens it picked."""

    iteration: int
    at: float
    masked_rows: int
    graph_s: float
    fill_s: float
    wait_s: float
    rows: int = 1


class Answer:
    """One generation's answers from the core (a core.Responder): its tokens, finish reason and end time; each
    token's step noted in `steps` (iteration -> Step), which the round's generations share."""

    def __init__(self, stats, steps: dict[int, Step]) -> None:
        self.stats, self.steps, self.tokens, self.reason, self.error = stats, steps, [], "", None
        self.ended, self.done = 0.0, threading.Event()

    def send(self, outputs) -> None:
        if TOKEN_ID not in outputs:
            return
        self.tokens.append(int(outputs[TOKEN_ID][0]))
        s = self.stats
        if s.iterations in self.steps:
            self.steps[s.iterations].rows += 1
        else:
            gauges = (s.masked_rows, s.step_seconds, s.mask_fill_seconds, s.mask_wait_seconds)
            self.steps[s.iterations] = Step(s.iterations, time.perf_counter(), *gauges)

    def finish(self, outputs=None, error=None) -> None:
        self.ended, self.error = time.perf_counter(), error
        if outputs is not None and FINISH_REASON in outputs:
            self.reason = outputs[FINISH_REASON][0].decode()
        self.done.set()

    def cancelled(self) -> bool:
        return False


@dataclasses.dataclass
class Round:
    tokens: list[list[int]]  # each generation's
    reasons: list[str]
    wall_s: float
    steps: list[Step]  # in the order the core ran them


def fortunes_artifact(work: Path) -> Path:
    """models/fortunes built to our artifact in `work` (only the VARIANT graph), reused when a finished build is
    there (its report is written last)."""
    from serving.triton.cli import export_trained

    artifact = work / files.TRAINED_MODEL_NAME
    if all((artifact / name).is_file() for name in ("report.json", files.model_filename(VARIANT), "tokenizer.json")):
        return artifact
    report = export_trained(work / "repository", artifact, variants=(VARIANT,))
    if not report["passed"]:
        raise BenchError(f"the build of {files.TRAINED_MODEL} failed: {json.dumps(report)[:1000]}")
    return artifact


def model_of(artifact: Path, plan: Plan) -> Model:
    """The artifact's model and the plan's prompt, checked to fit it."""
    if plan.tokens < 1 or plan.rounds < 1 or plan.compile_repeats < 1 or min(plan.concurrency) < 1:
        raise BenchError(f"tokens, rounds, compile repeats and concurrency must be at least 1, got {plan}")
    text, cfg = TextModel.from_folder(artifact), ModelConfig.load(artifact)
    if not text.eos_token_ids:
        raise BenchError(f"{artifact}'s tokenizer names no end id: a constrained generation ends at one")
    prompt = np.array(text.encode(plan.prompt), np.int64)
    room = cfg.max_seq_len - len(prompt)
    if plan.tokens > room:
        raise BenchError(f"a {len(prompt)}-id prompt leaves room for {room} tokens: give --tokens {room} or fewer")
    return Model(artifact, cfg, text, tuple(text.eos_token_ids), prompt)


def started_core(model: Model, most: int, threads: int):
    """The static session engine of the VARIANT graph under the engine core, as sessions runs them, a full row for
    each of `most` generations; no rows kept for reuse (the rounds repeat their prompt) and no cap on one owner's
    generations (they are all one owner's)."""
    from serving.engine import core, factory
    from serving.engine.settings import SessionSettings

    cfg, graph = model.cfg, model.artifact / files.model_filename(VARIANT)
    rows = cfg.kv_cache_bytes(most, cfg.max_seq_len)
    settings = SessionSettings(kv_cache_bytes=rows, threads=threads, min_row_positions=cfg.max_seq_len)
    engine = factory.session_engine({"cpu": graph}, cfg, settings, "bench-structured")
    return core.EngineCore(engine, core.CoreSettings(kept_per_owner=0, generations_per_owner=0)).start()


def generations(engine_core, model: Model, count: int, tokens: int, seed: int, constrain=None) -> Round:
    """`count` generations submitted at once; `constrain()`: a fresh (grammar, constraint) for each, compiled
    before the clock starts."""
    from serving.engine import core

    steps: dict[int, Step] = {}
    answers = [Answer(engine_core.stats, steps) for _ in range(count)]
    requests = []
    for row, answer in enumerate(answers):
        grammar, constraint = constrain() if constrain else (None, None)
        sampling = SamplingParams(temperature=1.0, seed=seed + row)
        asked = GenerationRequest(tokens, model.end_ids, sampling, True, True, grammar=grammar)
        requests.append(core.Generate(next(SEQUENCES), answer, prompt=model.prompt, asked=asked, constraint=constraint))
    started = time.perf_counter()
    for request in requests:
        engine_core.submit(request)
    for answer in answers:
        answer.done.wait()
    failed = [answer.error for answer in answers if answer.error is not None]
    if failed:
        raise BenchError(f"{len(failed)} of {count} generations failed: {failed[0]!r}") from failed[0]
    wall_s = max(answer.ended for answer in answers) - started
    return Round([a.tokens for a in answers], [a.reason for a in answers], wall_s, list(steps.values()))


def measure_all(engine_core, model: Model, grammar, plan: Plan) -> dict[tuple[str, int], list[Round]]:
    """(candidate, concurrency) -> its rounds, after a short warm-up of each (the graph's batch shapes, the
    grammars' threads)."""
    grammars = Grammars((model.artifact / "tokenizer.json").read_text(), model.cfg.vocab_size)
    constrain = {UNCONSTRAINED: None, CONSTRAINED: lambda: (grammar, grammars.compile(grammar, model.end_ids))}
    for name, count in itertools.product(CANDIDATES, plan.concurrency):
        generations(engine_core, model, count, min(WARMUP_TOKENS, plan.tokens), plan.seed, constrain[name])
    measured = collections.defaultdict(list)
    for turn, name in interleaved(plan.rounds, CANDIDATES):
        seed = plan.seed + turn * max(plan.concurrency)  # new seeds each round, the same for both candidates
        for count in plan.concurrency:
            measured[(name, count)].append(generations(engine_core, model, count, plan.tokens, seed, constrain[name]))
    return measured


def compile_times(model: Model, schemas: dict[str, dict], repeats: int) -> dict:
    """A fresh compiler's first compile (the tokenizer read, then the first schema), then each schema's `repeats`
    times: the tokenizer's share is the first compile less the first schema's median."""
    grammars = {name: Grammar.json_schema(schema) for name, schema in schemas.items()}
    fresh = Grammars((model.artifact / "tokenizer.json").read_text(), model.cfg.vocab_size)
    started = time.perf_counter()
    fresh.compile(next(iter(grammars.values())), model.end_ids)
    first_ms = (time.perf_counter() - started) * 1e3
    budget = Budget(seconds=0.0, min_runs=repeats, warmup=0)  # exactly `repeats` compiles each
    timed = {
        name: measure(lambda g=g: fresh.compile(g, model.end_ids), budget).to_dict() for name, g in grammars.items()
    }
    tokenizer_ms = max(first_ms - next(iter(timed.values()))["median_ms"], 0.0)
    return {"first_compile_ms": first_ms, "tokenizer_ms": tokenizer_ms, "schemas": timed}


def percentiles(seconds: list[float]) -> dict | None:
    if not seconds:
        return None
    ms = np.asarray(seconds) * 1e3
    return {"p50": float(np.percentile(ms, 50)), "p99": float(np.percentile(ms, 99)), "steps": len(ms)}


def summary(rounds: list[Round]) -> dict:
    rates = [sum(map(len, r.tokens)) / r.wall_s for r in rounds]
    steps = [step for r in rounds for step in r.steps]
    masked = [step for step in steps if step.masked_rows]
    # the loop's time a step (one step's first answer to the next's) where it and the one before picked a token
    # for every generation of the round: a full batch's
    full = [
        after.at - before.at
        for r in rounds
        for before, after in itertools.pairwise(r.steps)
        if after.iteration == before.iteration + 1 and before.rows == after.rows == len(r.tokens)
    ]
    return {
        "tokens_per_s": float(np.median(rates)),
        "tokens_per_s_rounds": rates,
        "tokens_per_generation": float(np.mean([len(t) for r in rounds for t in r.tokens])),
        "finish_reasons": dict(collections.Counter(reason for r in rounds for reason in r.reasons)),
        "rows_per_step": float(np.mean([step.rows for step in steps])),
        "full_step_ms": percentiles(full),
        "graph_ms": percentiles([step.graph_s for step in steps]),
        "mask_fill_ms": percentiles([step.fill_s for step in masked]),  # None where nothing was masked
        "mask_wait_ms": percentiles([step.wait_s for step in masked]),
    }


def checked_answers(rounds: list[Round], model: Model, schema: dict) -> dict:
    """How many answers parse as JSON and how many of those the schema takes (a trailing end id left out: the core
    also stops a generation whose grammar can only end, before it picks the end id)."""
    import jsonschema

    validator = jsonschema.validators.validator_for(schema)(schema)
    ended = [ids[:-1] if ids and ids[-1] in model.end_ids else ids for r in rounds for ids in r.tokens]
    texts = [model.text.decode(ids) for ids in ended]
    parsed, valid, refused = 0, 0, []
    for text in texts:
        try:
            ok = validator.is_valid(json.loads(text))
            parsed, valid = parsed + 1, valid + ok
        except ValueError:
            ok = False
        refused += [] if ok else [text]
    return {"answers": len(texts), "parsed": parsed, "valid": valid, "example": texts[0], "refused": refused[:3]}


def row_of(count: int, measured: dict, model: Model, schema: dict) -> dict:
    """Both candidates at `count`; ratio: constrained tokens/s over unconstrained's; full-batch ratio: the same
    from their full batches' step time (unconstrained's over constrained's)."""
    free, bound = (summary(measured[(name, count)]) for name in CANDIDATES)
    bound["answers"] = checked_answers(measured[(CONSTRAINED, count)], model, schema)
    full = (free["full_step_ms"] or {}).get("p50"), (bound["full_step_ms"] or {}).get("p50")
    return {
        "concurrency": count,
        "candidates": {UNCONSTRAINED: free, CONSTRAINED: bound},
        "ratio": bound["tokens_per_s"] / free["tokens_per_s"],
        "full_batch_ratio": full[0] / full[1] if all(full) else None,
    }


def benchmark(artifact: Path, schema: dict, plan: Plan, threads: int) -> dict:
    model = model_of(artifact, plan)
    with output.during(threads, "onnxruntime", "llguidance") as conditions:
        compiled = compile_times(model, {"bench": schema, "any object": {"type": "object"}}, plan.compile_repeats)
        engine_core = started_core(model, max(plan.concurrency), threads)
        try:
            measured = measure_all(engine_core, model, Grammar.json_schema(schema), plan)
        finally:
            engine_core.stop()
    rows = [row_of(count, measured, model, schema) for count in plan.concurrency]
    at_most = f">= {GOAL_RATIO:g}, at most {1 - GOAL_RATIO:.0%} slower"
    return {
        "model": {"artifact": str(artifact), "config": model.cfg.to_dict(), "end_ids": list(model.end_ids)},
        "plan": dataclasses.asdict(plan) | {"prompt_ids": len(model.prompt)},
        "schema": schema,
        "measured_at": output.commit(),
        "conditions": conditions,
        "compile": compiled,
        "rows": rows,
        "targets": {
            f"constrained_vs_unconstrained_C{row['concurrency']}": output.goal(row["ratio"], GOAL_RATIO, target=at_most)
            for row in rows
            if row["concurrency"] == GOAL_COUNT
        },
    }


def table(results: dict) -> str:
    plan, compiled, rows = results["plan"], results["compile"], results["rows"]
    heading = (
        f"{Path(results['model']['artifact']).name}: {plan['prompt']!r} ({plan['prompt_ids']} ids), up to "
        f"{plan['tokens']} tokens at temperature 1, {plan['rounds']} interleaved rounds, "
        f"{results['conditions']['threads']} threads, {results['measured_at']['text']}"
    )
    header = ["conc.", "candidate", "tokens/s", "ratio", "tok/gen", "rows/step", "full step", "graph"]
    cells = []
    for row in rows:
        for name, entry in row["candidates"].items():
            checks, full = entry.get("answers"), entry["full_step_ms"]
            rates = [f"{entry[key]:.1f}" for key in ("tokens_per_s", "tokens_per_generation", "rows_per_step")]
            ratio = f"{row['ratio']:.2f}x" if name == CONSTRAINED else ""
            masks = [
                f"{m['p50']:.3f}/{m['p99']:.3f}" if m else "-" for m in (entry["mask_fill_ms"], entry["mask_wait_ms"])
            ]
            steps = [f"{full['p50']:.2f}ms" if full else "-", f"{entry['graph_ms']['p50']:.2f}ms", *masks]
            answered = f"{checks['parsed']}/{checks['valid']}/{checks['answers']}" if checks else ""
            cells.append([row["concurrency"], name, rates[0], ratio, *rates[1:], *steps, answered])
    full_batch = ", ".join(f"{r['full_batch_ratio']:.2f}x at {r['concurrency']}" for r in rows if r["full_batch_ratio"])
    schemas = ", ".join(f"{name!r} {t['median_ms']:.2f} ms" for name, t in compiled["schemas"].items())
    lines = [
        output.table(heading, [*header, "fill p50/p99", "wait p50/p99", "parsed/valid/of"], cells),
        "tokens/s: generated tokens over the round's wall time (median over rounds); ratio: constrained over "
        "unconstrained; p50s of ms a step: the loop's at a full batch (every generation picking), the graph run's, "
        "the masks' fill (beside the graph run) and the loop's wait for them after it",
        f"constrained over unconstrained at a full batch (its step time): {full_batch or 'no full steps'}",
        f"compile: a fresh compiler's first {compiled['first_compile_ms']:.1f} ms (the tokenizer's share "
        f"{compiled['tokenizer_ms']:.1f} ms); each schema again, median: {schemas}",
        f"an answer: {rows[-1]['candidates'][CONSTRAINED]['answers']['example']}",
    ]
    missing = f"goal: not measured ({GOAL_COUNT} at once not run)"
    return "\n".join(lines + output.target_lines("goal:", results["targets"], "ratio", missing))


def plot(results: dict, path: Path) -> Path:
    rows = results["rows"]
    groups = [f"{row['concurrency']} at once ({row['ratio']:.2f}x)" for row in rows]
    drawn, (rates, step) = figure(2, (11, 4))
    series = {name: [row["candidates"][name]["tokens_per_s"] for row in rows] for name in CANDIDATES}
    grouped_bars(rates, groups, series, ylabel="generated tokens / s")
    parts = {"graph_ms": "graph run", "mask_fill_ms": "mask fill", "mask_wait_ms": "loop's wait for the masks"}
    series = {
        label: [(row["candidates"][CONSTRAINED][key] or {"p50": 0.0})["p50"] for row in rows]
        for key, label in parts.items()
    }
    grouped_bars(step, groups, series, ylabel=f"ms per step, p50 ({CONSTRAINED})")
    gridded(rates, step, which="major")
    drawn.suptitle(f"a JSON schema's constraint against none ({results['measured_at']['text']})")
    return save(drawn, path)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--artifact", type=Path, help=f"an artifact with {VARIANT} and a tokenizer (default: fortunes)")
    parser.add_argument("--schema", type=Path, help="a JSON schema file (default: a name, an age and tags)")
    parser.add_argument("--prompt", default=PROMPT, help="each generation's prompt text (default: %(default)r)")
    parser.add_argument("--tokens", type=int, default=Plan.tokens, help="most tokens a generation (default 96)")
    parser.add_argument("--concurrency", default="1,16", help="comma-separated generations at once (default 1,16)")
    output.rounds_argument(parser, Plan.rounds)
    parser.add_argument("--compile-repeats", type=int, default=Plan.compile_repeats, help="compiles timed a schema")
    output.threads_argument(parser, "the graph's threads")
    output.output_arguments(parser)


def run(args: argparse.Namespace) -> int:
    plan = Plan(args.prompt, args.tokens, output.counts(args.concurrency), args.rounds, args.compile_repeats)
    schema = json.loads(args.schema.read_text()) if args.schema else SCHEMA
    with output.work_folder(args.work, "bench-structured-") as root:
        results = benchmark(args.artifact or fortunes_artifact(root), schema, plan, args.threads)
    return output.report(results, args.out, "structured", plot, table(results))
