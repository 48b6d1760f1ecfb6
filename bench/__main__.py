"""`python -m bench [COMMAND]`: run the benchmarks; with no command, every one of them.

python -m bench model            # PyTorch eager vs each ONNX variant on ONNX Runtime CPU
python -m bench model --quick    # a few small shapes, short budgets
python -m bench serving          # in-process vs Triton stateless vs stateful, gRPC and HTTP
python -m bench scale            # Envoy in front of 3 Triton replicas vs straight to one; 64 sessions' spread
python -m bench admission        # 2,000 opens on a 1,500-row KV budget: sequence slots from the budget vs 1,024
python -m bench idle             # a step and an open through the gateway beside 0 to 8,000 idle live sessions
python -m bench gateway          # 16 sessions stepping through the gateway (JSON, b64) vs the gRPC client direct
python -m bench sessions         # snapshot, restore, fork, rewind vs prefilling again, against the session's length
python -m bench durable          # a decode step with the session store (directory, Redis) vs without; a recovering step
python -m bench capacity         # 1,000-token sessions per GiB: fp32/int8/int4 caches, full vs sized rows; decode
python -m bench weights-int8     # int8 weights on ONNX Runtime vs fp32-fused and PyTorch (fp32, quantize_dynamic)
python -m bench generate         # 512-token prompts, 128 greedy tokens: served, gateway, in-process, genai, torch
python -m bench conversation     # the next turn of a 1k / 4k-token chat (forked KV) against a cold prefill: TTFT
python -m bench structured       # tokens/s under a JSON schema's constraint vs none, 1 and 16 at once; compile time
python -m bench gpu              # the GPU proof (a CUDA host with PyTorch and onnxruntime-gpu)
"""

from __future__ import annotations

import argparse
import sys
from types import ModuleType

from bench import (
    admission,
    capacity,
    conversation,
    durable,
    gateway,
    generate,
    gpu,
    idle,
    model,
    scale,
    serving,
    sessions,
    structured,
    weights_int8,
)

# name -> module with `add_arguments(parser)` and `run(args) -> int`; a benchmark registers here.
# `gpu` runs only when asked: it needs a CUDA host.
COMMANDS: dict[str, ModuleType] = {
    "model": model,
    "serving": serving,
    "scale": scale,
    "admission": admission,
    "idle": idle,
    "gateway": gateway,
    "sessions": sessions,
    "durable": durable,
    "capacity": capacity,
    "weights-int8": weights_int8,
    "generate": generate,
    "conversation": conversation,
    "structured": structured,
    "gpu": gpu,
}
DEFAULT_COMMANDS = (
    "model",
    "serving",
    "scale",
    "admission",
    "idle",
    "gateway",
    "sessions",
    "durable",
    "capacity",
    "weights-int8",
    "generate",
    "conversation",
    "structured",
)


def parser() -> argparse.ArgumentParser:
    root = argparse.ArgumentParser(prog="python -m bench", description=__doc__.splitlines()[0])
    commands = root.add_subparsers(dest="command")
    for name, module in COMMANDS.items():
        module.add_arguments(commands.add_parser(name, help=module.__doc__.splitlines()[0]))
    return root


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if args.command is None:  # every benchmark with its defaults
        return max(COMMANDS[name].run(parser().parse_args([name])) for name in DEFAULT_COMMANDS)
    return COMMANDS[args.command].run(args)


if __name__ == "__main__":
    sys.exit(main())
