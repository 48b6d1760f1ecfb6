"""The small ONNX graphs the engines run beside the model (copies of cache rows, batching's pads and
slices), built here once: the kernel-model helper every such graph goes through. They take buffers,
shapes and sessions, never an engine or a pool, so this module imports nothing of the engine's.
"""

from __future__ import annotations

KERNEL_OPSET = 18


def kernel_model(nodes, inputs, outputs, initializers=()):
    """A one-graph ONNX model of `nodes` at `KERNEL_OPSET`, in the IR version ONNX Runtime 1.31 loads."""
    from onnx import helper

    graph = helper.make_graph(nodes, "cache_kernel", inputs, outputs, initializer=list(initializers))
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", KERNEL_OPSET)])
    model.ir_version = 10  # what ONNX Runtime 1.31 loads (measured)
    return model
