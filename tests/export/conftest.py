"""PyTorch on one thread for every test here, as the build's parity ladder runs it (export/runners.py,
`one_thread`): these tests drive the original a token at a time on tensors of kilobytes, where a
second thread costs far more than it saves on a busy 2-core machine (measured: 128 decode steps of
the gqa preset 21 s on two threads, under 1 s on one)."""

import pytest

from export.runners import one_thread


@pytest.fixture(autouse=True)
def torch_on_one_thread():
    with one_thread():
        yield
