"""ONNX Runtime as every session of the product wants it: the session and run options, where a
session keeps its tensors, its float dtype, and a session as a runner (named arrays in and out).

The export's parity ladder and the served engines open their sessions here, so a graph is proven on
the settings it is served with.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import numpy as np

from contract import names
from contract.deployment import CPU, CUDA  # where tensors live: ONNX Runtime's device names

Arrays = dict[str, np.ndarray]
Forward = Callable[[Mapping[str, np.ndarray]], Arrays]

CPU_PROVIDER = "CPUExecutionProvider"
CUDA_PROVIDER = "CUDAExecutionProvider"
TRT_PROVIDER = "TensorrtExecutionProvider"


def session_options(threads: int = 0, arena: bool = True, spinning: bool = True):
    """ONNX Runtime session options as every session here wants them: full graph optimizations,
    errors only in the log. `spinning=False`: idle pool threads sleep (a server whose sessions run
    one after another must not let one session's spinning pool steal the next one's cores)."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    if threads:
        options.intra_op_num_threads = threads
    if not spinning:
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    options.enable_cpu_mem_arena = arena
    options.log_severity_level = 3  # errors only: a missing CUDA library is not our user's concern here
    return options


def run_options(entries: dict[str, str]):
    """ONNX Runtime run options with these config entries."""
    import onnxruntime as ort

    options = ort.RunOptions()
    for key, value in entries.items():
        options.add_run_config_entry(key, value)
    return options


def ort_session(path: str | Path, providers: Sequence | None = None, threads: int | None = None):
    """An ONNX Runtime session with full graph optimizations; CPU unless providers say otherwise."""
    import onnxruntime as ort

    options = session_options(threads or 0)
    return ort.InferenceSession(str(path), sess_options=options, providers=list(providers or [CPU_PROVIDER]))


def session_device(session) -> str:
    """Where a session keeps its tensors: CUDA when its first provider is a GPU one."""
    return CUDA if session.get_providers()[0] in (CUDA_PROVIDER, TRT_PROVIDER) else CPU


def uses_cuda_graphs(session) -> bool:
    """Whether the session was made with ONNX Runtime's CUDA graphs on (CUDA provider option)."""
    options = session.get_provider_options().get(CUDA_PROVIDER, {})
    return options.get("enable_cuda_graph") == "1"


def session_float_dtype(session) -> type:
    """The float dtype of a graph's first output (`output`, or a whole model's `logits`), which is its
    hidden states' and its float caches' (a whole model's first input is int64 token ids)."""
    first = session.get_outputs()[0]
    return np.float16 if first.type == "tensor(float16)" else np.float32


def ort_runner(session) -> Forward:
    """An ONNX Runtime session as a runner; a left-out past or mask is filled as the original reads it."""
    from contract.inputs import with_defaults

    input_names = [i.name for i in session.get_inputs()]
    output_names = [o.name for o in session.get_outputs()]
    sizes, cache_dtype = graph_sizes(session), session_float_dtype(session)

    def run(inputs: Mapping[str, np.ndarray]) -> Arrays:
        feeds = dict(inputs)
        if any(name not in feeds for name in input_names):
            filled = with_defaults(sizes, feeds, cache_dtype)
            feeds.update({name: filled[name] for name in input_names if name not in feeds})
        return dict(zip(output_names, session.run(output_names, feeds), strict=True))

    return run


def graph_sizes(session) -> names.GraphSizes:
    """The sizes a graph's inputs are made of, read from the session. A whole model's (its first input
    `input_ids`) d_model is inside the graph, not on its inputs: 0 there; its vocabulary is the width of
    its `logits`."""
    specs = {i.name: i.shape for i in session.get_inputs()}
    n_layers = names.layer_count(list(specs))
    _, n_kv_heads, _, head_dim = specs[names.past_name(0, names.KEY)] if n_layers else (0, 0, 0, 0)
    positioned = names.POSITION_IDS in specs
    if names.INPUT_IDS in specs:
        vocab_size = next(o.shape[-1] for o in session.get_outputs() if o.name == names.LOGITS)
        return names.GraphSizes(0, n_layers, n_kv_heads, head_dim, positioned, vocab_size)
    return names.GraphSizes(specs[names.HIDDEN_STATES][-1], n_layers, n_kv_heads, head_dim, positioned)
