"""The parity ladder: every rung is driven over the same prefill and decode steps as the PyTorch
original, each feeding its own presents back, and every output and present is compared.

A rung reports, per tensor, the worst absolute error, that error relative to the tensor's scale
(its largest reference magnitude), where it is (step and index), and whether it passed.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator

import numpy as np

from contract import names
from contract.config import ModelConfig
from serving.engine.ort import Arrays, Forward


@dataclasses.dataclass(frozen=True)
class Tolerance:
    """An element passes when |actual - expected| <= atol + rtol * |expected| + scale * max|expected|,
    or, for a reduced-precision rung, when it is within `floor` times the largest error the rung's
    precision floor (`runners.rounded_runner`) makes on that tensor over the whole rung."""

    atol: float
    rtol: float
    scale: float
    why: str
    floor: float = 0.0

    def bound(self, expected: np.ndarray) -> np.ndarray:
        scale = float(np.abs(expected).max()) if expected.size else 0.0
        return self.atol + self.rtol * np.abs(expected) + self.scale * scale


# Why the fp16 bound follows the precision floor. fp16 keeps 11 significant bits: every value it stores
# moves by up to 2^-11 (4.9e-4) of itself. Most errors stay that size, but attention amplifies the ones
# in q and k: a logit q.k/sqrt(head_dim) of magnitude L moves by about L * 2^-11, and the softmax passes
# a logit error on as a relative error of the weights. Our init gives logits of magnitude ~1 (largest
# ~10) and errors of ~7e-4 of the output's scale; trained weights are larger: projections 4x our init
# give logits 16x (largest ~170-260) and errors that grow with them. That much is no fault of the graph:
# the PyTorch original itself, computed in fp64 on what an fp16 graph must hold in fp16 (its weights,
# inputs, caches and outputs), is off by the same order. That is the precision floor
# (`runners.rounded_runner`), driven beside the graph. The graph rounds at more places (normalized
# states, q, k and v, context, projections; its scores are fp32, export/fp16.py) and was measured at
# 1.0-1.2x the floor's output error on the ladder over norm x residual x projections scaled 1-4x
# (seed 0), and up to 2.5x for hidden states of magnitude 10-100 (tests/export/test_fp16.py prints
# them); 8x leaves over 3x that room. A conversion fault (scores or a LayerNorm statistic in fp16: an
# overflow, a clipped constant) costs far more than 8 roundings, or is not finite at all. Where q and
# k are so large that rounding k (the fp16 cache) flips which key a query attends, the floor itself is
# tens of percent off the fp32 original: the build then notes under its table that such a model is
# not one to serve in fp16 (export/report.py, docs/importing.md). A whole model adds its MLPs and its
# head in fp16: more roundings of the same size on the way (the MLP's hidden width, the normalized
# states before the head, the logits themselves) but no amplification like attention's, and the
# token ids go in exact (never cast: `cast_floats`). Measured on the ladder (TEST_CONFIGS "whole",
# Llama's block, and "whole-gpt2", seed 0): logits within 1.27e-3 (fp16-fused) and 1.37e-3
# (fp16-static) of their scale, 1.4-1.7x the floor's; GPT-2's 5.3e-4 and 7.2e-4, 1.0x its floor.
# Both under the fixed 2e-3, so the bound stays as it is.
FP16_FLOOR_FACTOR = 8.0


TOLERANCES: dict[str, Tolerance] = {
    "fp32": Tolerance(
        atol=1e-5,
        rtol=1e-5,
        scale=0.0,
        why="the same fp32 math as PyTorch; only the order of summation differs (measured about 1e-6)",
    ),
    "fp32-fused": Tolerance(
        atol=1e-5,
        rtol=1e-5,
        scale=0.0,
        why="fp32 like `fp32`: the Attention kernel only sums in another order and skips masked keys "
        "instead of weighing them exp(min - max) = 0 (measured 1e-6 to 7e-6, the same as `fp32`)",
    ),
    "fp16-fused": Tolerance(
        atol=0.0,
        rtol=0.0,
        scale=2e-3,
        floor=FP16_FLOOR_FACTOR,
        why="fp16 rounds every stored value to 2^-11 (4.9e-4) of its magnitude: the hidden states and "
        "weights going in, the residual stream and caches coming out; each layer's output adds a few such "
        "roundings, so the error is a small multiple of 4.9e-4 of the output's largest magnitude "
        "(measured about 7e-4 at our init, also at magnitude 1e3); 2e-3 (about 4 units) leaves room for "
        "more layers. Attention amplifies the rounding of q and k by the logits' magnitude, so for larger "
        "(trained) weights the bound is 8x the error of the precision floor where that is larger "
        "(export/parity.py, FP16_FLOOR_FACTOR, says why)",
    ),
    "fp32-static": Tolerance(
        atol=1e-5,
        rtol=1e-5,
        scale=0.0,
        why="fp32 like `fp32-fused`: GroupQueryAttention sums in another order and reads each row's real "
        "keys only (measured about 1e-7 on the pool rung, 256 decode steps included)",
    ),
    "fp32-trt": Tolerance(
        atol=1e-5,
        rtol=1e-5,
        scale=0.0,
        why="fp32 like `fp32-fused`: the same Attention op, its cache Concat outside the node",
    ),
}
# The fp16 forms round the same values as `fp16-fused` (inputs, weights, caches, outputs at 2^-11);
# only where attention runs differs, so they share its bound and its reason.
TOLERANCES["fp16-static"] = TOLERANCES["fp16-fused"]
TOLERANCES["fp16-trt"] = TOLERANCES["fp16-fused"]

# Why the quantized caches' bound follows their precision floor. An int8 code keeps a key or value to
# half a step of max|x| / 127 (int4: / 7), and a value beyond the calibration's max is clipped to it;
# attention passes both on to the output. How much that costs depends on the model and its inputs, not
# on the graph, so the bound is relative to what it costs the PyTorch original itself: the original
# with every key and value it caches fake-quantized with the graph's own scales, as the kernel
# quantizes (round half to even, clip to the codes' range, no zero point: export/kv_quant.py), which
# is the precision floor (`runners.quantized_cache_runner`), driven beside the graph. On one step the
# kernel matches it to fp32 rounding (tests/export/test_kv_quant.py); over the pool rung the graph's
# worst error was 1.000x the floor's on every tensor, int8 and int4, per tensor and per channel scales,
# TEST_CONFIGS["tiny"] and the seed preset (int8 per tensor: output 5.4e-2 and 4.3e-2, 9.9e-3 and
# 7.7e-3 of its scale). 2x leaves room for a code rounded on the other side of a half step (fp32
# arithmetic in another order); a kernel that quantized otherwise (another rounding, a zero point, a
# scale applied to the wrong head or channel, codes packed in another order) moves whole codes on every
# value and leaves the floor far behind. The int4 floor itself is 14-20% of the output's scale: the
# build passes such a graph for doing what int4 does and says under its table what that costs.
QUANTIZED_FLOOR_FACTOR = 2.0
for _name, _bits in (("fp32-static-int8kv", 8), ("fp32-static-int4kv", 4)):
    TOLERANCES[_name] = Tolerance(
        atol=1e-5,
        rtol=1e-5,
        scale=0.0,
        floor=QUANTIZED_FLOOR_FACTOR,
        why=f"fp32 with keys and values stored as {_bits}-bit codes: within {QUANTIZED_FLOOR_FACTOR:g}x what "
        "quantizing them with the same scales costs the PyTorch original (the precision floor) where "
        "that is larger than fp32's 1e-5 (export/parity.py, QUANTIZED_FLOOR_FACTOR, says why)",
    )


# Why every tensor is judged against its own scale too. fp32 rounds each stored value to 2^-24 (6e-8) of
# itself, and a sum of terms keeps the terms' rounding however much they cancel: an element that comes out
# near zero from terms of magnitude M carries an error of about M * 2^-24 * sqrt(terms), none of it relative
# to its own small value. Another order of summation (a fused kernel, another CPU's SIMD width: AVX2 against
# AVX-512) moves every element by that much. So an elementwise bound (atol + rtol * |x|) misjudges fp32
# noise as soon as a tensor's magnitude grows: trained-size activations (a Llama at initializer_range 0.2:
# logits of scale 8, keys and values of scale ~10) gave presents off by 1.7e-5 to 3.3e-5 absolute, 2.3e-6 to
# 4.3e-6 of their scale, on an AVX-512 Xeon, and were refused by 1e-5 + 1e-5 * |x| while the logits beside
# them passed. A tensor's noise scales with its largest magnitude, so each tensor (logits, hidden states,
# every layer's keys and values) also gets `SCALE_BOUND` of its scale besides the rung's own bound; a real
# fault (a wrong head, a mask off by one, a position skipped) moves elements by a large share of the scale.
# Measured: 2e-7 to 6e-7 of the scale for logits on the ladder and against transformers' CausalLM.
SCALE_BOUND = 1e-5


def scaled(tolerance: Tolerance) -> Tolerance:
    """The tolerance every tensor is held to: its rung's, and within SCALE_BOUND of its own scale."""
    if tolerance.scale >= SCALE_BOUND:
        return tolerance
    return dataclasses.replace(tolerance, scale=SCALE_BOUND)


@dataclasses.dataclass(frozen=True)
class Scenario:
    """A left-padded prefill followed by single-token decode steps."""

    batch: int = 3
    prefill: int = 7
    steps: int = 16
    padding: tuple[int, ...] = (0, 2, 5)  # left padding of each row in the prefill
    past: int = 0  # a random cache the prefill starts from (0 = an empty past)
    scale: float = 1.0  # magnitude of the hidden states (a whole model's new tokens are random ids instead)
    seed: int = 0

    def __post_init__(self) -> None:
        assert len(self.padding) == self.batch, "one padding length per row"
        assert all(0 <= p < self.prefill for p in self.padding), "every row keeps a real token"


def scenario_steps(cfg: ModelConfig, scenario: Scenario) -> Iterator[tuple[Arrays, np.ndarray]]:
    """Yield (new inputs, which query rows are real) per step; the past is the caller's to carry."""
    rng = np.random.default_rng(scenario.seed)
    B = scenario.batch
    mask = np.ones((B, scenario.past + scenario.prefill), dtype=np.int64)  # (B, P+T)
    for row, pad in enumerate(scenario.padding):
        mask[row, scenario.past : scenario.past + pad] = 0
    for step in range(scenario.steps + 1):
        new = scenario.prefill if step == 0 else 1
        if step:
            mask = np.concatenate([mask, np.ones((B, 1), dtype=np.int64)], axis=1)  # (B, P+T+1)
        tokens = new_tokens(cfg, rng, (B, new), scenario.scale)  # (B, T, d) or ids (B, T)
        yield {names.model_input(cfg): tokens, names.ATTENTION_MASK: mask.copy()}, mask[:, -new:].astype(bool)


def new_tokens(cfg: ModelConfig, rng: np.random.Generator, shape: tuple[int, ...], scale: float = 1.0) -> np.ndarray:
    """Random new tokens of `shape` (B, T) or (T,): a whole model's token ids, int64 uniform in [0, vocab),
    else hidden states (..., d_model) float32 of magnitude `scale`."""
    if cfg.whole:
        return rng.integers(0, cfg.vocab_size, shape, dtype=np.int64)
    return (scale * rng.standard_normal((*shape, cfg.d_model))).astype(np.float32)


def cast_floats(cast: Callable[[np.ndarray], np.ndarray], inputs: Arrays) -> Arrays:
    """`inputs` with the float ones converted by `cast` (a reduced-precision rung's dtype); token ids,
    masks and positions stay int64."""
    return {name: cast(array) if array.dtype.kind == "f" else array for name, array in inputs.items()}


def initial_past(cfg: ModelConfig, scenario: Scenario) -> Arrays:
    rng = np.random.default_rng(scenario.seed + 1)
    shape = (scenario.batch, cfg.n_kv_heads, scenario.past, cfg.head_dim)
    return {name: rng.standard_normal(shape).astype(np.float32) for name in names.past_names(cfg.n_layers)}


@dataclasses.dataclass
class TensorError:
    name: str
    max_abs: float = -np.inf  # raised by the first update
    max_rel: float = 0.0  # max_abs relative to the reference tensor's largest magnitude
    step: int = 0
    index: tuple[int, ...] = ()
    finite: bool = True
    beyond_bound: float = 0.0  # the largest error of an element outside the tolerance's fixed bound
    floor_abs: float | None = None  # the precision floor's largest error (reduced-precision rungs)
    floor_rel: float | None = None  # the same, relative to the reference tensor's largest magnitude then
    floor_factor: float = 0.0  # an element outside the fixed bound may reach this many times floor_abs

    def update(
        self,
        step: int,
        actual: np.ndarray,
        expected: np.ndarray,
        valid: np.ndarray,
        tol: Tolerance,
        floor: np.ndarray | None = None,
    ) -> None:
        """Compare one step; `floor` is the precision floor's value of the same tensor, if the rung has one."""
        self.finite &= bool(np.isfinite(actual).all())
        actual64, expected64 = actual.astype(np.float64), expected.astype(np.float64)
        error = np.where(valid, np.abs(actual64 - expected64), 0.0)
        beyond = error > tol.bound(np.where(valid, expected64, 0.0))
        self.beyond_bound = max(self.beyond_bound, float(error[beyond].max()) if beyond.any() else 0.0)
        scale = float(np.abs(np.where(valid, expected64, 0.0)).max())
        if floor is not None:
            floor_error = float(np.where(valid, np.abs(floor.astype(np.float64) - expected64), 0.0).max())
            if floor_error > (self.floor_abs or 0.0):
                self.floor_abs, self.floor_rel = floor_error, floor_error / scale if scale else 0.0
            self.floor_factor = tol.floor
        worst = np.unravel_index(int(np.argmax(error)), error.shape)
        if error[worst] > self.max_abs:
            self.max_abs, self.step, self.index = float(error[worst]), step, tuple(int(i) for i in worst)
            self.max_rel = self.max_abs / scale if scale else 0.0

    @property
    def passed(self) -> bool:
        """Finite, and every element within the fixed bound or within floor_factor times the floor."""
        return self.finite and self.beyond_bound <= self.floor_factor * (self.floor_abs or 0.0)

    def to_dict(self) -> dict:
        return {**dataclasses.asdict(self), "passed": self.passed}


@dataclasses.dataclass
class RungResult:
    tensors: dict[str, TensorError]
    step_errors: list[float]  # worst absolute error of `output` per step: drift shows here

    @property
    def passed(self) -> bool:
        return all(error.passed for error in self.tensors.values())

    def to_dict(self) -> dict:
        return {
            "passed": self.passed,
            "tensors": {name: error.to_dict() for name, error in self.tensors.items()},
            "output_error_per_step": self.step_errors,
        }


def compare_rung(
    cfg: ModelConfig,
    reference: Forward,
    candidate: Forward,
    scenario: Scenario,
    tolerance: Tolerance,
    cast: Callable[[np.ndarray], np.ndarray] = lambda a: a,
    on_step: Callable[[int], None] | None = None,
    floor: Forward | None = None,
    maps: bool = False,
) -> RungResult:
    """Drive both runners through the scenario and compare every output at every step.

    `cast` converts float inputs to the candidate's dtype (identity for fp32 rungs; a whole model's token
    ids are never cast); `floor`, for a
    reduced-precision candidate, is its precision floor (`runners.rounded_runner`), driven like it.
    `maps`: both runners also answer each layer's attention weights `attention.{i}` (B, n_heads, T,
    P+T), compared on real queries only: a padded query's row is unspecified (the op gives zeros, the
    original a uniform row); every key of a real query is compared (padding weighs 0 in both).
    """
    map_names = names.attention_map_names(cfg.n_layers) if maps else []
    tensors = {name: TensorError(name) for name in names.output_names(cfg) + map_names}
    step_errors = []
    output = names.model_output(cfg)
    ref_past = initial_past(cfg, scenario) if scenario.past else {}
    cand_past = {name: cast(array) for name, array in ref_past.items()}
    floor_past, floor_out = dict(cand_past), {}
    for step, (inputs, real_rows) in enumerate(scenario_steps(cfg, scenario)):
        expected = reference({**inputs, **ref_past})
        cand_inputs = cast_floats(cast, inputs)
        actual = candidate({**cand_inputs, **cand_past})
        if floor:
            floor_out = floor({**cand_inputs, **floor_past})
            floor_past = _as_past(floor_out, cfg.n_layers)
        # a padded query's output is unspecified (docs/design.md, "Model math"), and so is what the layers after
        # the first cache at its position: only real queries and real key positions are compared
        real_keys = inputs[names.ATTENTION_MASK].astype(bool)[:, None, :, None]  # (B, 1, P+T, 1)
        for name, error in tensors.items():
            valid = real_rows[:, :, None] if name == output else real_keys
            if name in map_names:
                valid = real_rows[:, None, :, None]  # (B, 1, T, 1): real queries, every key
            error.update(step, actual[name], expected[name], valid, scaled(tolerance), floor_out.get(name))
        output_error = np.abs(actual[output].astype(np.float64) - expected[output])
        step_errors.append(float(np.where(real_rows[:, :, None], output_error, 0.0).max()))
        ref_past, cand_past = _as_past(expected, cfg.n_layers), _as_past(actual, cfg.n_layers)
        if on_step:
            on_step(step)
    return RungResult(tensors, step_errors)


def _layer_kind(present: str) -> tuple[int, str]:
    _, layer, kind = present.split(".")
    return int(layer), kind


def _as_past(outputs: Arrays, n_layers: int) -> Arrays:
    """A step's presents as the next step's past."""
    return {names.past_name(*_layer_kind(n)): outputs[n] for n in names.present_names(n_layers)}


# --- the static-cache rung: a pool of rows driven the way the session engine drives it ------------


def pool_schedule(max_length: int, decode_steps: int = 256) -> list[dict[int, int]]:
    """Steps over a pool of 4 rows, each step {row: new tokens}: prefills into empty rows, ragged rows
    decoding in one run, rows of length 0 inside the decode window beside long ones, a chunked
    prefill onto a past, a prefill in the same step as decodes, and a late row joining the decode.
    Sized so that no row exceeds `max_length` positions (fewer decode steps for a short context)."""
    prefill_0, prefill_3, chunk, prefill_2 = (7, 5, 4, 6) if max_length >= 32 else (2, 2, 2, 2)
    assert max_length >= MIN_POOL_LENGTH, f"the pool rung needs {MIN_POOL_LENGTH} positions, got {max_length}"
    steps: list[dict[int, int]] = [{0: prefill_0}, {3: prefill_3}]  # rows 1 and 2 stay empty between them
    steps += [{0: 1, 3: 1}] * 3
    steps += [{3: chunk}, {0: 1, 2: prefill_2, 3: 1}]
    longest = prefill_3 + 3 + chunk + 1  # row 3 before the decode steps
    decode_steps = max(0, min(decode_steps, max_length - longest))
    for step in range(decode_steps):
        steps.append({0: 1, 2: 1, 3: 1} | ({1: 1} if step >= decode_steps // 2 else {}))
    return steps


MIN_POOL_LENGTH = 8  # the short schedule's longest row before it decodes
POOL_ROWS = 4


def compare_pool_rung(
    cfg: ModelConfig,
    reference: Forward,
    pool,
    schedule: list[dict[int, int]],
    tolerance: Tolerance,
    seed: int = 0,
    on_step: Callable[[int], None] | None = None,
    floor: Forward | None = None,
    dequantize: Callable[[str, np.ndarray], np.ndarray] | None = None,
) -> RungResult:
    """Drive `pool` (an export.kv_pool.KVPool) and the PyTorch original, one sequence per row, through
    `schedule`; compare every output as it comes and every row's cache at the end. `floor` as in
    `compare_rung`; `dequantize` (past name, codes) -> floats reads a quantized pool's cache."""
    rng = np.random.default_rng(seed)
    tensors = {name: TensorError(name) for name in names.output_names(cfg)}
    first, output = names.model_input(cfg), names.model_output(cfg)
    ref_past: dict[int, Arrays] = {}
    floor_past: dict[int, Arrays] = {}
    step_errors = []
    for step, schedule_step in enumerate(schedule):
        hidden = {row: new_tokens(cfg, rng, (new,)) for row, new in schedule_step.items()}  # (T_row[, d])
        actual = pool.run({row: h if cfg.whole else h.astype(pool.dtype) for row, h in hidden.items()})
        failed = {row: out for row, out in actual.items() if isinstance(out, Exception)}
        if failed:
            raise next(iter(failed.values()))
        worst = 0.0
        for row, h in hidden.items():
            expected = reference({first: h[None], **ref_past.get(row, {})})
            floor_output = None
            if floor:
                floor_tokens = h[None] if cfg.whole else h[None].astype(pool.dtype)
                floored = floor({first: floor_tokens, **floor_past.get(row, {})})
                floor_past[row], floor_output = _as_past(floored, cfg.n_layers), floored[output]
            tensors[output].update(
                step,
                actual[row][None],
                expected[output],
                np.ones((1, 1, 1), bool),
                scaled(tolerance),
                floor_output,
            )
            worst = max(worst, float(np.abs(actual[row].astype(np.float64) - expected[output][0]).max()))
            ref_past[row] = _as_past(expected, cfg.n_layers)
        step_errors.append(worst)
        if on_step:
            on_step(step)
    for row, past in ref_past.items():
        cached = pool.read(row)
        for name, expected in past.items():
            present = names.present_name(*_layer_kind(name))
            floor_cache = floor_past[row][name] if floor else None
            actual = dequantize(name, cached[name]) if dequantize else cached[name]
            tensors[present].update(
                len(schedule), actual, expected, np.ones((1, 1, 1, 1), bool), tolerance, floor_cache
            )
    return RungResult(tensors, step_errors)
