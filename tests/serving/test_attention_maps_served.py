"""Attention maps through the real Triton of tests/fixtures/triton.py and the client library, over
gRPC and HTTP: `forward` answers a call with `attention_maps=True` from the inspection graph
(`fp32-fused-inspect`), equal to the PyTorch original's weights within 1e-5 on real queries (a mask
with padding and a past); the `sessions` model's `attention_maps` operation gives the maps of a session's next
step over what it holds, and leaves the session as it was. A call without the parameter gets no maps."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from client import AsyncClient, Client
from client.errors import InvalidInputError
from contract import names
from export.build import attention_maps_runner
from tests.fixtures.served import PROTOCOLS, SESSION_PROTOCOLS, full_forward, hidden, url

pytestmark = pytest.mark.served
ATOL = 1e-5


@pytest.fixture(scope="module")
def maps_reference(served_model):
    return attention_maps_runner(served_model)


def reference_maps(maps_reference, inputs: dict, n_layers: int) -> tuple[np.ndarray, list[np.ndarray]]:
    expected = maps_reference(inputs)
    return expected[names.OUTPUT], [expected[name] for name in names.attention_map_names(n_layers)]


def assert_maps_equal(served: list[np.ndarray], expected: list[np.ndarray], real_queries: np.ndarray) -> None:
    """Every layer's map within ATOL of the original's on real queries (B, T) (a padded query's row is
    unspecified), every key of them."""
    assert len(served) == len(expected)
    for layer, (ours, theirs) in enumerate(zip(served, expected, strict=True)):
        assert ours.shape == theirs.shape, layer
        error = np.abs(ours - theirs) * real_queries[:, None, :, None]
        assert error.max() <= ATOL, (layer, float(error.max()))


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_served_maps_equal_the_originals_with_a_mask_and_a_past(triton, served_cfg, maps_reference, protocol):
    prompt, new = hidden(served_cfg, 2, 6, seed=1), hidden(served_cfg, 2, 3, seed=2)
    prompt_mask = np.ones((2, 6), np.int64)
    prompt_mask[1, :2] = 0  # the second row left-padded by 2
    mask = np.concatenate([prompt_mask, np.ones((2, 3), np.int64)], axis=1)
    with Client(url(triton, protocol), protocol) as client:
        first = client.infer(prompt, prompt_mask)
        assert first.attention_maps is None  # not asked: none, and the inspection graph does not run
        result = client.infer(new, mask, past=first.present, attention_maps=True)
    past = {
        names.past_name(i, kind): pair[j]
        for i, pair in enumerate(first.present)
        for j, kind in enumerate(names.KV_KINDS)
    }
    output, maps = reference_maps(
        maps_reference, {names.HIDDEN_STATES: new, names.ATTENTION_MASK: mask, **past}, served_cfg.n_layers
    )
    assert [m.shape for m in result.attention_maps] == [(2, served_cfg.n_heads, 3, 9)] * served_cfg.n_layers
    assert_maps_equal(result.attention_maps, maps, np.ones((2, 3)))
    np.testing.assert_allclose(result.output, output, rtol=0, atol=ATOL)
    assert len(result.present) == served_cfg.n_layers and result.present[0][0].shape[2] == 9


def test_a_padded_prefill_compares_its_real_queries_and_async_asks_the_same(triton, served_cfg, maps_reference):
    prompt = hidden(served_cfg, 2, 5, seed=3)
    mask = np.ones((2, 5), np.int64)
    mask[0, :3] = 0
    with asyncio.Runner() as loop:
        client = AsyncClient(triton.grpc_url)
        result = loop.run(client.infer(prompt, mask, attention_maps=True))
        loop.run(client.close())
    _, maps = reference_maps(
        maps_reference, {names.HIDDEN_STATES: prompt, names.ATTENTION_MASK: mask}, served_cfg.n_layers
    )
    assert_maps_equal(result.attention_maps, maps, mask.astype(bool))


def test_a_request_without_the_parameter_carries_no_maps_and_a_wrong_value_is_refused(triton, served_cfg):
    tokens = hidden(served_cfg, 1, 2, seed=4)
    with grpcclient.InferenceServerClient(triton.grpc_url) as raw:
        infer_input = grpcclient.InferInput(names.HIDDEN_STATES, list(tokens.shape), "FP32")
        infer_input.set_data_from_numpy(tokens)
        plain = raw.infer("forward", [infer_input])
        assert plain.as_numpy(names.OUTPUT) is not None and plain.as_numpy(names.attention_map_name(0)) is None
        with pytest.raises(InferenceServerException, match="parameter 'attention_maps': expected true or false"):
            raw.infer("forward", [infer_input], parameters={names.ATTENTION_MAPS: "yes"})


@pytest.mark.parametrize("protocol", SESSION_PROTOCOLS)
def test_a_sessions_maps_are_the_originals_over_its_held_tokens_and_leave_it_unchanged(
    triton, served_cfg, served_reference, maps_reference, protocol
):
    prompt, token = hidden(served_cfg, 1, 8, seed=10), hidden(served_cfg, 1, 1, seed=11)
    asked, after = hidden(served_cfg, 1, 3, seed=12), hidden(served_cfg, 1, 1, seed=13)
    with Client(url(triton, protocol), protocol) as client, client.session() as session:
        session.step(prompt)
        session.step(token)
        maps = session.attention_maps(asked)
        assert session.length == 9  # the maps' tokens were not kept
        next_output = session.step(after)
        assert session.length == 10
    _, expected = reference_maps(
        maps_reference, {names.HIDDEN_STATES: np.concatenate([prompt, token, asked], axis=1)}, served_cfg.n_layers
    )
    expected = [weights[:, :, -3:] for weights in expected]  # the asked tokens' queries, over all 12 keys
    assert [m.shape for m in maps] == [(1, served_cfg.n_heads, 3, 12)] * served_cfg.n_layers
    assert_maps_equal(maps, expected, np.ones((1, 3)))
    # the session went on as if the maps had never been asked for
    reference = full_forward(served_reference, [prompt, token, after])[:, -1:]
    np.testing.assert_allclose(next_output, reference, rtol=0, atol=ATOL)


def test_a_sessions_maps_through_asyncio_and_their_refusals(triton, served_cfg):
    with asyncio.Runner() as loop:
        client = AsyncClient(triton.grpc_url, validate=False)  # the server's own checks answer

        async def scenario():
            async with client.session() as session:
                await session.step(hidden(served_cfg, 1, 4, seed=20))
                maps = await session.attention_maps(hidden(served_cfg, 1, 1, seed=21))
                with pytest.raises(InvalidInputError, match="expected hidden_states of 1 or more, got 0"):
                    await session.attention_maps(np.zeros((1, 0, served_cfg.d_model), np.float32))
                return maps, session.length

        maps, length = loop.run(scenario())
        loop.run(client.close())
    assert length == 4 and [m.shape for m in maps] == [(1, served_cfg.n_heads, 1, 5)] * served_cfg.n_layers
    for weights in maps:  # each real query's weights sum to 1
        np.testing.assert_allclose(weights.sum(axis=-1), 1.0, atol=1e-5)
