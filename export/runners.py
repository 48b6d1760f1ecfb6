"""The PyTorch original as runners: callables that map named input arrays to named output arrays.

The parity ladder drives every rung (PyTorch, each ONNX variant on ONNX Runtime through
`serving.engine.ort.ort_runner`, the served model over HTTP and gRPC) through this one shape of
callable (`serving.engine.ort.Forward`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping, Sequence

import numpy as np

from serving.engine.ort import Arrays, Forward


def torch_runner(model, device: str = "cpu", caches: Sequence[type] | None = None) -> Forward:
    """The PyTorch original as a runner (the reference rung), on `device` ("cuda" on a GPU host).
    `caches`: per layer the `KVCache` class its past is made of (`KVCache` itself unless given; an
    empty past is made of it too when the inputs have none)."""
    import torch

    from contract import names
    from export.model import KVCache

    n_layers = model.cfg.n_layers
    model = model.to(device)
    caches = caches or [KVCache] * n_layers

    @torch.no_grad()
    def run(inputs: Mapping[str, np.ndarray]) -> Arrays:
        tensor = {name: torch.from_numpy(np.ascontiguousarray(array)).to(device) for name, array in inputs.items()}
        hidden = tensor[names.model_input(model.cfg)]  # (B, T, d_model), or a whole model's ids (B, T)
        past = None
        if names.past_name(0, names.KEY) in tensor:
            past = [
                cache(tensor[names.past_name(i, names.KEY)], tensor[names.past_name(i, names.VALUE)])
                for i, cache in enumerate(caches)
            ]
        elif any(cache is not KVCache for cache in caches):
            floats = hidden if hidden.is_floating_point() else next(model.parameters())
            past = [cache(*KVCache.empty(model.cfg, hidden.shape[0], floats)) for cache in caches]
        result = model(hidden, tensor.get(names.ATTENTION_MASK), past, position_ids=tensor.get(names.POSITION_IDS))
        arrays = {names.model_output(model.cfg): result.output.cpu().numpy()}
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
    with torch.no_grad():  # its weights and its float tables (the rotation's cos and sin)
        for tensor in [*rounded.parameters(), *(b for b in rounded.buffers() if b.is_floating_point())]:
            tensor.copy_(tensor.to(stored).float())
    run = torch_runner(rounded.double())

    def forward(inputs: Mapping[str, np.ndarray]) -> Arrays:
        widened = {
            name: array.astype(dtype).astype(np.float64) if array.dtype.kind == "f" else array
            for name, array in inputs.items()
        }
        return {name: array.astype(dtype) for name, array in run(widened).items()}

    return forward


def quantized_cache_runner(model, quantization) -> Forward:
    """The precision floor of a graph whose cache `quantization` (export/kv_quant.py) quantizes: the
    PyTorch original with every key and value it appends to a layer's cache fake-quantized with that
    layer's scales (quantize, clip, dequantize, as GroupQueryAttention stores them and reads them
    back; the new tokens attend over them too). Its difference from the original is what the
    quantization alone costs this model (export/parity.py). In fp32, as the kernel quantizes: fp32's
    own rounding (1e-6) is four orders below the codes' (1e-2), and an fp64 floor would round some
    values on the other side of a half step from the kernel."""
    from contract import names
    from export.model import KVCache

    def quantizing(layer: int) -> type:
        key, value = names.past_name(layer, names.KEY), names.past_name(layer, names.VALUE)

        class QuantizingCache(KVCache):
            __slots__ = ()

            def append(self, k, v):
                longer = KVCache.append(self, quantization.fake_quantize(key, k), quantization.fake_quantize(value, v))
                return QuantizingCache(*longer)

        return QuantizingCache

    return torch_runner(model, caches=[quantizing(layer) for layer in range(model.cfg.n_layers)])


@contextlib.contextmanager
def one_thread() -> Iterator[None]:
    """PyTorch on one thread for the block. The parity ladder runs the original a row and a token at a
    time, on tensors of kilobytes, where handing work to a second thread costs more than it saves; on a
    busy 2-core machine far more (measured on the seed preset: 3 ms a decode step on one thread, 111 ms
    on two, which made fp32-static's pool rung take 140 s instead of 11 s)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)
