"""A user's trained module, saved as a state dict, through the documented command to a served model:
`python -m export build --weights ... --layout ...`, a repository, a real Triton; a causal prefill and
32 decode steps, in a session (gRPC) and stateless with the cache sent back (HTTP), equal the user's
own module over the whole sequence within 1e-5 (fp32).

One small Triton per layout (32 wide): torch.nn.MultiheadAttention, the teaching texts' module (seeds),
and a Hugging Face-style GQA decoder without rotary embeddings; each starts while the next layout builds.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch

from contract import names
from contract.config import ModelConfig
from export.__main__ import main as export_main
from serving.triton.config import ServingSettings
from serving.triton.repository import write_repository
from tests import user_modules
from tests.fixtures.prebuilds import folder_job
from tests.fixtures.triton import selected, started_together
from tests.serving.helpers import Client, new_sequence_id

D, HEADS, KV_HEADS = 32, 4, 2
PREFILL, STEPS = 7, 32
pytestmark = pytest.mark.served  # one Triton per layout, started here

SETTINGS = ServingSettings(threads=1, kv_cache_bytes=16 << 20, max_batch_size=4)


def torch_mha():
    module = torch.nn.MultiheadAttention(D, HEADS, batch_first=True)
    future = torch.ones(PREFILL + STEPS, PREFILL + STEPS, dtype=torch.bool).triu(1)
    return module, lambda x: module(x, x, x, attn_mask=future, need_weights=False)[0], ["--n-heads", str(HEADS)]


def seeds():
    module = user_modules.MultiHeadAttention(D, HEADS)
    return module, lambda x: module(x, user_modules.causal_mask(x.shape[1]))[0], ["--n-heads", str(HEADS)]


def hf_gqa():
    module = user_modules.HuggingFaceStyle(D, HEADS, KV_HEADS, num_layers=2)
    return module, module, ["--n-kv-heads", str(KV_HEADS), "--attention-only"]  # attention keys alone


LAYOUTS = {"torch-mha": torch_mha, "seeds": seeds, "hf": hf_gqa}


def weights_file(layout: str, work: Path) -> Path:
    return work / ("model.safetensors" if layout == "hf" else "weights.pt")


def import_and_fill(layout: str, work: Path) -> None:
    """The user's module saved as a state dict in `work`, built with the documented command into
    `work`/artifact and put in a repository, `work`/repository (made ahead in the background where the session
    has time: tests/fixtures/prebuilds.py)."""
    torch.manual_seed(7)
    module, _, heads = LAYOUTS[layout]()
    weights = weights_file(layout, work)
    if layout == "hf":
        from safetensors.torch import save_file

        save_file({k: v.contiguous() for k, v in module.state_dict().items()}, str(weights))
    else:
        torch.save(module.state_dict(), str(weights))
    (work / "serving.json").write_text(json.dumps({"max_seq_len": 64}))
    argv = ["build", "--weights", str(weights), "--layout", layout, *heads, "--config", str(work / "serving.json")]
    assert export_main([*argv, "--out", str(work / "artifact"), "--variants", "fp32-fused,fp32-static"]) == 0
    write_repository(work / "artifact", work / "repository", SETTINGS, models=("forward", "sessions"))


def users_forward(layout: str, work: Path) -> Callable:
    """The user's forward over a whole sequence, its module holding the weights saved in `work`."""
    module, forward, _ = LAYOUTS[layout]()
    if layout == "hf":
        from safetensors.torch import load_file

        module.load_state_dict(load_file(str(weights_file(layout, work))))
    else:
        module.load_state_dict(torch.load(str(weights_file(layout, work))))
    return forward


def layout_key(layout: str) -> str:
    return f"imported-{layout}"


def prebuild_jobs(item) -> dict:
    """The layout this test serves, imported ahead in the background (tests/fixtures/prebuilds.py)."""
    layout = getattr(getattr(item, "callspec", None), "params", {}).get("served")
    return {layout_key(layout): folder_job(layout_key(layout), import_and_fill, layout)} if layout in LAYOUTS else {}


@pytest.fixture(scope="module")
def imports(request, tmp_path_factory, prebuilds):
    """layout -> (the user's forward, a Future of the Triton serving the import, its config) for the
    layouts this session runs: each imported ahead or here in turn while the Tritons of those before it
    start in the background; every Triton stopped at the end, together."""
    runs = selected(request, "served")
    with started_together() as start:
        made = {}
        for layout in (layout for layout in LAYOUTS if layout in runs):
            work = prebuilds.wait(layout_key(layout))
            if work is None:
                work = tmp_path_factory.mktemp(layout_key(layout))
                import_and_fill(layout, work)
            server = start(work / "repository", log_path=work / "triton.log")
            made[layout] = users_forward(layout, work), server, ModelConfig.load(work / "artifact")
        yield made


@pytest.fixture(scope="module", params=list(LAYOUTS))
def served(request, imports):
    """(the layout, the user's forward over a whole sequence, a Triton serving the import, its config)."""
    forward, server, cfg = imports[request.param]
    return request.param, forward, server.result(), cfg


def user_output(forward, hidden: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return forward(torch.from_numpy(hidden)).numpy()


def sequence(seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((1, PREFILL + STEPS, D)).astype(np.float32)


def test_a_session_equals_the_users_module(served):
    layout, forward, server, _ = served
    hidden = sequence()
    with Client(server, "grpc") as client:
        sequence_id, outputs = new_sequence_id(), []
        try:
            outputs.append(client.step(sequence_id, hidden[:, :PREFILL], start=True))
            outputs += [client.step(sequence_id, hidden[:, t : t + 1]) for t in range(PREFILL, PREFILL + STEPS)]
        finally:
            client.end(sequence_id, D)
    served_output, expected = np.concatenate(outputs, axis=1), user_output(forward, hidden)
    error = float(np.abs(served_output - expected).max())
    print(f"{layout}: sessions over a prefill of {PREFILL} and {STEPS} decode steps: max abs error {error:.2e}")
    assert error <= 1e-5


def test_stateless_calls_sending_the_cache_back_equal_the_users_module(served):
    layout, forward, server, cfg = served
    hidden = sequence(1)
    outputs, past = [], {}
    with Client(server, "http") as client:
        for start, stop in [(0, PREFILL), *((t, t + 1) for t in range(PREFILL, PREFILL + STEPS))]:
            result = client.infer("forward", {names.HIDDEN_STATES: hidden[:, start:stop], **past})
            outputs.append(result[names.OUTPUT])
            past = {
                names.past_name(i, kind): result[names.present_name(i, kind)]
                for i in range(cfg.n_layers)
                for kind in names.KV_KINDS
            }
    error = float(np.abs(np.concatenate(outputs, axis=1) - user_output(forward, hidden)).max())
    print(f"{layout}: forward over a prefill of {PREFILL} and {STEPS} decode steps: max abs error {error:.2e}")
    assert error <= 1e-5
