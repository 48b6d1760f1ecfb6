"""Runners: anything that maps named input arrays to named output arrays.

The parity ladder drives every rung (PyTorch, each ONNX variant on ONNX Runtime, the served model
over HTTP and gRPC) through this one shape of callable.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import numpy as np

Arrays = dict[str, np.ndarray]
Forward = Callable[[Mapping[str, np.ndarray]], Arrays]


def torch_runner(model, device: str = "cpu") -> Forward:
    """The PyTorch original as a runner (the reference rung), on `device` ("cuda" on a GPU host)."""
    import torch

    from contract import names
    from export.model import KVCache

    n_layers = model.cfg.n_layers
    model = model.to(device)

    @torch.no_grad()
    def run(inputs: Mapping[str, np.ndarray]) -> Arrays:
        tensor = {name: torch.from_numpy(np.ascontiguousarray(array)).to(device) for name, array in inputs.items()}
        past = None
        if names.past_name(0, names.KEY) in tensor:
            past = [
                KVCache(tensor[names.past_name(i, names.KEY)], tensor[names.past_name(i, names.VALUE)])
                for i in range(n_layers)
            ]
        result = model(tensor[names.HIDDEN_STATES], tensor.get(names.ATTENTION_MASK), past)
        arrays = {names.OUTPUT: result.output.cpu().numpy()}
        for i, cache in enumerate(result.present):
            arrays[names.present_name(i, names.KEY)] = cache.key.cpu().numpy()
            arrays[names.present_name(i, names.VALUE)] = cache.value.cpu().numpy()
        return arrays

    return run


def rounded_runner(model, dtype: type = np.float16) -> Forward:
    """The precision floor of a `dtype` graph of `model`: the PyTorch original computed in fp64 on what
    such a graph holds in `dtype` (its weights, inputs and caches), its outputs rounded to `dtype`. Its
    difference from the fp32 original is what rounding to `dtype` (for fp32: fp32 arithmetic itself)
    costs this model, before any graph rounds anything more; driven beside a graph, its own rounded
    presents fed back, it sets the scale of that graph's tolerance (export/parity.py)."""
    import copy

    import torch

    rounded, stored = copy.deepcopy(model), torch.from_numpy(np.empty(0, dtype)).dtype
    with torch.no_grad():
        for parameter in rounded.parameters():
            parameter.copy_(parameter.to(stored).float())
    run = torch_runner(rounded.double())

    def forward(inputs: Mapping[str, np.ndarray]) -> Arrays:
        widened = {
            name: array.astype(dtype).astype(np.float64) if array.dtype.kind == "f" else array
            for name, array in inputs.items()
        }
        return {name: array.astype(dtype) for name, array in run(widened).items()}

    return forward


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


def ort_session(path: str | Path, providers: Sequence | None = None, threads: int | None = None):
    """An ONNX Runtime session with full graph optimizations; CPU unless providers say otherwise."""
    import onnxruntime as ort

    options = session_options(threads or 0)
    return ort.InferenceSession(str(path), sess_options=options, providers=list(providers or ["CPUExecutionProvider"]))


def ort_runner(session) -> Forward:
    """An ONNX Runtime session as a runner; a left-out past or mask is filled as the original reads it."""
    from contract.inputs import with_defaults

    input_names = [i.name for i in session.get_inputs()]
    output_names = [o.name for o in session.get_outputs()]
    sizes = graph_sizes(session)

    def run(inputs: Mapping[str, np.ndarray]) -> Arrays:
        feeds = dict(inputs)
        if any(name not in feeds for name in input_names):
            filled = with_defaults(sizes, feeds)
            feeds.update({name: filled[name] for name in input_names if name not in feeds})
        return dict(zip(output_names, session.run(output_names, feeds), strict=True))

    return run


def graph_sizes(session):
    """The sizes a stateless graph's inputs are made of, read from the session."""
    from contract import names

    specs = {i.name: i.shape for i in session.get_inputs()}
    n_layers = names.layer_count(list(specs))
    _, n_kv_heads, _, head_dim = specs[names.past_name(0, names.KEY)] if n_layers else (0, 0, 0, 0)
    return names.GraphSizes(specs[names.HIDDEN_STATES][-1], n_layers, n_kv_heads, head_dim)
