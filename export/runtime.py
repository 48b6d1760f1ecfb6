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


def ort_session(path: str | Path, providers: Sequence | None = None, threads: int | None = None):
    """An ONNX Runtime session with full graph optimizations; CPU unless providers say otherwise."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    if threads:
        options.intra_op_num_threads = threads
    options.log_severity_level = 3  # errors only: a missing CUDA library is not our user's concern here
    return ort.InferenceSession(str(path), sess_options=options, providers=list(providers or ["CPUExecutionProvider"]))


def ort_runner(session) -> Forward:
    """An ONNX Runtime session as a runner; an empty past is passed as zero-length tensors."""
    input_names = [i.name for i in session.get_inputs()]
    output_names = [o.name for o in session.get_outputs()]

    def run(inputs: Mapping[str, np.ndarray]) -> Arrays:
        feeds = dict(inputs)
        missing = [name for name in input_names if name not in feeds]
        if missing:
            feeds.update(default_inputs(session, feeds, missing))
        return dict(zip(output_names, session.run(output_names, feeds), strict=True))

    return run


def default_inputs(session, feeds: Mapping[str, np.ndarray], missing: list[str]) -> Arrays:
    """What a caller may leave out, as the PyTorch original reads it: an empty past (zero-length
    tensors) and an all-ones attention mask."""
    from contract import names

    hidden = feeds[names.HIDDEN_STATES]
    batch, new = hidden.shape[:2]
    specs = {i.name: i for i in session.get_inputs()}
    arrays, past = {}, 0
    for name in missing:
        if not name.startswith("past_key_values."):
            continue
        _, n_kv_heads, _, head_dim = specs[name].shape
        arrays[name] = np.zeros((batch, n_kv_heads, 0, head_dim), dtype=hidden.dtype)
    given_past = feeds.get(names.past_name(0, names.KEY))
    if given_past is not None:
        past = given_past.shape[2]
    if names.ATTENTION_MASK in missing:
        arrays[names.ATTENTION_MASK] = np.ones((batch, past + new), dtype=np.int64)
    return arrays
