"""onnxruntime-genai, the peer `bench/whole_model.py` measures against, driven in a process of its own.

onnxruntime-genai 0.18 brings its own onnxruntime (1.32), which must not meet the project's (1.31.1):
it lives in a virtual environment of its own (`make bench-peers`, or `ensure_venv`) and runs this
file as a script there, which imports nothing of the project. The parent writes one JSON request a
line on stdin and reads one JSON answer a line on stdout:

    {"model": FOLDER, "threads": N}                     -> {"loaded": true, "version": "0.18.0"}
    {"prompts": [[id, ...], ...], "tokens": N}          -> {"prefill_ms": .., "step_ms": [..], "tokens": [[..], ..]}
    {"quit": true}                                      -> (exits)

A generation is greedy, as onnxruntime-genai's Generator runs it: `append_tokens` (the prompt's
prefill) then `generate_next_token` per token. The prefill's time is the time to the first token
(append_tokens and the first generate_next_token); each later generate_next_token is one decode
step: the last token through the model over the cache, and the greedy choice.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path


def configure(folder: Path, threads: int) -> None:
    """The builder's genai_config.json, set for the benchmark: `threads` intra-op threads, greedy."""
    path = folder / "genai_config.json"
    config = json.loads(path.read_text())
    options = config["model"]["decoder"]["session_options"]
    options["intra_op_num_threads"], options["inter_op_num_threads"] = threads, 1
    config["search"].update(do_sample=False, num_beams=1, top_k=1)
    path.write_text(json.dumps(config, indent=4) + "\n")


def generate(model, prompts: list[list[int]], tokens: int) -> dict:
    import numpy as np
    import onnxruntime_genai as og

    ids = np.asarray(prompts, dtype=np.int32)
    params = og.GeneratorParams(model)
    length = ids.shape[1] + tokens
    # min_length = max_length: no row stops at the end-of-sequence id (random weights choose it as any
    # other; onnxruntime-genai then keeps it from winning, transformers' loop does not: a rare difference)
    params.set_search_options(max_length=length, min_length=length, batch_size=ids.shape[0], do_sample=False)
    generator = og.Generator(model, params)
    chosen, step_ms = [], []
    started = time.perf_counter()
    generator.append_tokens(ids)
    generator.generate_next_token()
    chosen.append(generator.get_next_tokens().copy())
    prefill_ms = (time.perf_counter() - started) * 1e3
    for _ in range(tokens - 1):
        t0 = time.perf_counter()
        generator.generate_next_token()
        chosen.append(generator.get_next_tokens().copy())
        step_ms.append((time.perf_counter() - t0) * 1e3)
    return {"prefill_ms": prefill_ms, "step_ms": step_ms, "tokens": np.stack(chosen, axis=1).tolist()}


def serve(lines, answer) -> None:
    import onnxruntime_genai as og

    model = None
    for line in lines:
        request = json.loads(line)
        if request.get("quit"):
            return
        if "model" in request:
            configure(Path(request["model"]), int(request["threads"]))
            model = og.Model(request["model"])
            answer({"loaded": True, "version": og.__version__})
        else:
            answer(generate(model, request["prompts"], int(request["tokens"])))


def main() -> int:
    def answer(content: dict) -> None:
        sys.stdout.write(json.dumps(content) + "\n")
        sys.stdout.flush()

    try:
        serve(sys.stdin, answer)
    except Exception as error:  # the parent reads the reason instead of a closed pipe
        answer({"error": f"{type(error).__name__}: {error}"})
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
