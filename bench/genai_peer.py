"""onnxruntime-genai's Generator, greedy, driven in a process of its own (bench/whole_model.py's `GenaiPeer`).

onnxruntime-genai 0.18 brings its own onnxruntime (1.32), which must not meet the project's (1.31.1): this script
runs in a virtual environment of its own (`make bench-peers`) and imports nothing of the project. The parent writes
one JSON request a line on stdin and reads one JSON answer a line on stdout (an error: {"error": ...}, then exit 1):

    {"model": FOLDER, "threads": N}                     -> {"loaded": true, "version": "0.18.0"}
    {"prompts": [[id, ...], ...], "tokens": N}          -> {"prefill_ms": .., "step_ms": [..], "tokens": [[..], ..]}
    {"quit": true}                                      -> (exits)

prefill_ms: `append_tokens` and the first `generate_next_token`, the time to the first token; step_ms: each later
`generate_next_token`, one decode step and its greedy pick.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path


def configure(folder: Path, threads: int) -> None:
    """The builder's genai_config.json set for the benchmark: `threads` intra-op threads, greedy."""
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
    # min_length = max_length: no row stops at the end-of-sequence id (random weights choose it as any other;
    # onnxruntime-genai then keeps it from winning, transformers' loop does not: a rare difference)
    params.set_search_options(max_length=length, min_length=length, batch_size=len(ids), do_sample=False)
    generator = og.Generator(model, params)
    chosen, times_ms = [], []
    started = time.perf_counter()
    generator.append_tokens(ids)  # timed with the first pick: the prefill
    for _ in range(tokens):
        generator.generate_next_token()
        chosen.append(generator.get_next_tokens().copy())
        now = time.perf_counter()
        times_ms.append((now - started) * 1e3)
        started = now
    return {"prefill_ms": times_ms[0], "step_ms": times_ms[1:], "tokens": np.stack(chosen, axis=1).tolist()}


def answer(content: dict) -> None:
    sys.stdout.write(json.dumps(content) + "\n")
    sys.stdout.flush()


def main() -> int:
    try:
        import onnxruntime_genai as og

        model = None
        for line in sys.stdin:
            request = json.loads(line)
            if request.get("quit"):
                break
            if "model" in request:
                configure(Path(request["model"]), int(request["threads"]))
                model = og.Model(request["model"])
                answer({"loaded": True, "version": og.__version__})
            else:
                answer(generate(model, request["prompts"], int(request["tokens"])))
    except Exception as error:  # the parent reads the reason instead of a closed pipe
        answer({"error": f"{type(error).__name__}: {error}"})
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
