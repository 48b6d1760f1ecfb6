"""Nothing stored is served wrong (issue 34, items 1 and 3), against a real gateway (a durable one: a store
folder, a session secret, two integrity secrets) in front of the session's real Triton:

- a durable session whose store entry was rewritten (with a fresh sha256, as entries were once checked) or
  replaced by another session's entry is refused when it is rebuilt (409 `session_lost`), not served wrong;
  an untouched one is rebuilt and served. A session is lost here by ending its Triton sequence behind the
  gateway's back, which is what a restarted replica looks like to it: the same rebuild as after a kill -9,
  without a model reload;
- a snapshot with a byte changed in a tensor, without its tag, or whose `owner` was set to another key's
  fingerprint is refused (400) before it goes upstream; one with a NaN, tagged with the right (older)
  secret, is refused by the server naming the tensor and position;
- a restore body larger than the largest snapshot the served session model can produce is 413 naming that
  bound; a snapshot of every position fits under it and restores.
"""

from __future__ import annotations

import hashlib
import json
import struct
from collections.abc import Iterator

import httpx
import numpy as np
import pytest

from client import Client
from contract import names
from contract.integrity import IntegrityError, Keyring, snapshot_signed, snapshot_verified
from serving.engine import snapshots
from serving.gateway.auth import owner_of
from serving.gateway.sessions import SessionIds
from tests.faults.test_edges import assert_error
from tests.gateway.conftest import running

KEY, OTHER_KEY = "integrity-key-a", "integrity-key-b"
SESSION_SECRET = "keyed-integrity-session-secret"
NEW_SECRET, OLD_SECRET = "keyed-integrity-new", "keyed-integrity-old"  # the first signs, both verify
EVERY = 4  # positions between checkpoints: a 6-token prompt writes the entry [0, 6)
OCTET = {"Content-Type": "application/octet-stream"}
KIB = 1 << 10


@pytest.fixture(scope="module")
def gateway(triton, tmp_path_factory):
    store = tmp_path_factory.mktemp("keyed-store")
    settings = {
        "api_keys": (KEY, OTHER_KEY),
        "triton_url": triton.grpc_url,
        "session_secret": SESSION_SECRET,
        "integrity_secrets": f"{NEW_SECRET},{OLD_SECRET}",
        "session_store": str(store),
        "checkpoint_every": EVERY,
    }
    with running(**settings) as gateway:
        yield gateway, store


@pytest.fixture(scope="module")
def api(gateway) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=gateway[0].url, headers={"X-API-Key": KEY}, timeout=60) as client:
        yield client


@pytest.fixture(scope="module")
def other(gateway) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=gateway[0].url, headers={"X-API-Key": OTHER_KEY}, timeout=60) as client:
        yield client


def step(api: httpx.Client, session: str, tokens: int, d_model: int, seed: int = 0) -> httpx.Response:
    states = np.random.default_rng([seed, tokens]).standard_normal((1, tokens, d_model)).astype(np.float32)
    return api.post(f"/v1/sessions/{session}/step", json={"hidden_states": states.tolist()})


# --- store entries ------------------------------------------------------------------------------------


def checkpointed(api: httpx.Client, d_model: int, seed: int) -> str:
    """A session holding 7 positions: [0, 6) in the store, the 7th in its replay log."""
    session = api.post("/v1/sessions").json()["id"]
    for tokens in (6, 1):
        assert step(api, session, tokens, d_model, seed).status_code == 200
    return session


def entry_of(store, session: str):
    """The session's one store entry (the file of positions [0, 6)), found by its store key."""
    claim = SessionIds(SESSION_SECRET).read(session)
    (entry,) = store.rglob(f"{claim.store_key}/{0:012d}-{6:012d}")
    return entry


def lose(triton, session: str) -> None:
    """End the session's Triton sequence behind the gateway: its next step finds it gone."""
    claim = SessionIds(SESSION_SECRET).read(session)
    with Client(triton.grpc_url, retries=0) as direct:
        direct.session(claim.sequence_id, claim.replica).close()


def with_fresh_sha256(entry_bytes: bytes) -> bytes:
    """The entry's snapshot with one value changed, behind the sha256 of the changed bytes: how entries were
    checked before they were keyed, so what passed that check."""
    blob = bytearray(_blob_of(entry_bytes))
    blob[-1] ^= 0x01  # the last value's top byte: a finite value, changed
    return hashlib.sha256(bytes(blob)).hexdigest().encode() + bytes(blob)


def _blob_of(entry_bytes: bytes) -> bytes:
    """The snapshot inside an entry, whatever is written ahead of it: it starts at the first offset whose
    8 bytes are a size within the entry followed by the header's JSON."""
    for offset in range(128):
        (size,) = struct.unpack("<Q", entry_bytes[offset : offset + 8])
        if 0 < size < len(entry_bytes) and entry_bytes[offset + 8 : offset + 10] == b'{"':
            return entry_bytes[offset:]
    raise AssertionError(f"no safetensors file in the entry: {entry_bytes[:128]!r}")


def test_a_rewritten_or_foreign_store_entry_is_refused_at_the_rebuild_an_untouched_one_is_rebuilt(
    gateway, api, triton, served_cfg
):
    _, store = gateway
    d_model = served_cfg.d_model
    rewritten, foreign, source, untouched = (checkpointed(api, d_model, seed) for seed in range(4))
    entry_of(store, rewritten).write_bytes(with_fresh_sha256(entry_of(store, rewritten).read_bytes()))
    entry_of(store, foreign).write_bytes(entry_of(store, source).read_bytes())  # same key, same positions
    for session in (rewritten, foreign, untouched):
        lose(triton, session)

    rebuilt = step(api, untouched, 1, d_model)
    assert rebuilt.status_code == 200, rebuilt.text  # the loss is rebuilt from the store: the path is live
    assert rebuilt.json()["length"] == 8
    assert_error(step(api, rewritten, 1, d_model), 409, "session_lost", "[0, 6) is refused", "old format")
    message = assert_error(step(api, foreign, 1, d_model), 409, "session_lost", "[0, 6) is refused")
    assert "integrity tag does not match" in message and "another session's" in message
    for session in (rewritten, foreign, source, untouched):
        api.delete(f"/v1/sessions/{session}")


# --- snapshots ----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def snapshot(api, served_cfg) -> bytes:
    """A snapshot of a session of KEY holding 5 positions, as the gateway hands it out."""
    session = api.post("/v1/sessions").json()["id"]
    assert step(api, session, 5, served_cfg.d_model).status_code == 200
    blob = api.get(f"/v1/sessions/{session}/snapshot")
    assert blob.status_code == 200, blob.text
    api.delete(f"/v1/sessions/{session}")
    return blob.content


def header_of(blob: bytes) -> tuple[dict, bytes]:
    (size,) = struct.unpack("<Q", blob[:8])
    return json.loads(blob[8 : 8 + size]), blob[8 + size :]


def with_header(header: dict, data: bytes) -> bytes:
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text + data


def restored(client: httpx.Client, blob: bytes) -> httpx.Response:
    answer = client.post("/v1/sessions", content=blob, headers=OCTET)
    if answer.status_code == 201:
        client.delete(f"/v1/sessions/{answer.json()['id']}")
    return answer


def test_a_snapshot_restores_as_handed_out_and_under_a_rotated_in_secret(api, snapshot):
    assert restored(api, snapshot).status_code == 201
    header, data = header_of(snapshot)
    metadata = {k: v for k, v in header["__metadata__"].items() if k != "mac"}
    unsigned = with_header({**header, "__metadata__": metadata}, data)
    assert restored(api, snapshot_signed(unsigned, Keyring(OLD_SECRET))).status_code == 201  # still verified
    refused = restored(api, snapshot_signed(unsigned, Keyring("a secret this gateway never had")))
    assert_error(refused, 400, "invalid_input", "integrity tag does not match", "another secret")
    assert_error(restored(api, unsigned), 400, "invalid_input", "no integrity tag")


@pytest.mark.parametrize("flip", [0x01, 0x20], ids=["a mantissa bit", "an exponent bit"])
def test_a_snapshot_with_a_changed_value_is_refused(api, snapshot, flip):
    changed = bytearray(snapshot)
    changed[-1] ^= flip  # the top byte of the last value of the last tensor; 0x20: its exponent, x 2**+-64
    assert_error(restored(api, bytes(changed)), 400, "invalid_input", "integrity tag does not match")


def test_a_snapshot_whose_owner_was_set_to_another_keys_fingerprint_is_refused(api, other, snapshot):
    header, data = header_of(snapshot)
    forged = {**header, "__metadata__": {**header["__metadata__"], "owner": owner_of(OTHER_KEY, SESSION_SECRET)}}
    refused = restored(other, with_header(forged, data))
    assert_error(refused, 400, "invalid_input", "integrity tag does not match", "the owner included")
    # as handed out, the other key is refused by the server's owner check (the other check, kept)
    assert_error(restored(other, snapshot), 400, "invalid_input", "belongs to another owner")


def test_a_snapshot_with_a_nan_tagged_with_the_right_secret_is_refused_naming_where(api, snapshot, served_cfg):
    header, data = header_of(snapshot)
    tensors = {name: entry for name, entry in header.items() if name != "__metadata__"}
    name = names.past_name(1, names.KEY)
    start, _ = tensors[name]["data_offsets"]
    _, length, width = tensors[name]["shape"]
    values = bytearray(data)
    # kv head 1, position 3, index 2 of layer 1's keys
    at = start + 4 * ((1 * length + 3) * width + 2)
    values[at : at + 4] = np.float32(np.nan).tobytes()
    # without its data_sha256 (a blob written before it, which that check would refuse first): the finite check's
    metadata = {k: v for k, v in header["__metadata__"].items() if k not in ("mac", "data_sha256")}
    signed = snapshot_signed(with_header({**header, "__metadata__": metadata}, bytes(values)), Keyring(OLD_SECRET))
    message = assert_error(restored(api, signed), 400, "invalid_input", name, "finite")
    assert "kv head 1, position 3, index 2" in message, message


def test_a_restore_body_over_the_largest_snapshot_is_413_naming_the_bound_a_full_one_restores(
    api, snapshot, served_cfg
):
    cfg = served_cfg
    # every position of every layer's keys and values as float32, the widest cache, and 64 KiB of header
    bound = cfg.max_seq_len * cfg.n_layers * 2 * cfg.n_kv_heads * cfg.head_dim * 4 + 64 * KIB
    over = b"\0" * (bound + 1)
    declared = api.post("/v1/sessions", content=over, headers=OCTET)
    assert_error(declared, 413, "body_too_large", f"limit of {bound} bytes", "the largest snapshot")
    chunks = iter([over[i : i + (1 << 20)] for i in range(0, len(over), 1 << 20)])
    streamed = api.post("/v1/sessions", content=chunks, headers=OCTET)
    assert "content-length" not in streamed.request.headers
    assert_error(streamed, 413, "body_too_large", f"limit of {bound} bytes")

    # a snapshot of all max_seq_len positions, of the served model and graph, fits and restores
    identity = {
        key: value for key, value in header_of(snapshot)[0]["__metadata__"].items() if key in snapshots.IDENTITY
    }
    rng = np.random.default_rng(0)
    shape = (cfg.n_kv_heads, cfg.max_seq_len, cfg.head_dim)
    cache = {name: rng.standard_normal(shape).astype(np.float32) for name in names.past_names(cfg.n_layers)}
    owner = header_of(snapshot)[0]["__metadata__"]["owner"]
    full = snapshot_signed(snapshots.encode(cache, identity, cfg.max_seq_len, owner), Keyring(NEW_SECRET))
    assert bound - 64 * KIB < len(full) <= bound
    answer = restored(api, full)
    assert answer.status_code == 201, answer.text


# --- the tag's canonical form (no server) ---------------------------------------------------------------


def small_snapshot() -> bytes:
    cache = {name: np.ones((1, 2, 4), np.float32) for name in names.past_names(1)}
    return snapshots.encode(cache, {"format": "1", "dtype": "float32"}, 2, owner="someone")


def test_the_tag_holds_whatever_the_header_is_written_like_and_a_repeated_key_is_refused():
    keyring = Keyring("a secret")
    signed = snapshot_signed(small_snapshot(), keyring)
    header, data = header_of(signed)
    # the same header written with other spacing and another key order: the same snapshot, still verified
    reordered = json.dumps(dict(reversed(list(header.items()))), indent=1).encode()
    reordered += b" " * (-len(reordered) % 8)
    snapshot_verified(struct.pack("<Q", len(reordered)) + reordered + data, keyring)
    # an owner given twice (read one way here, perhaps another by the library that restores it): refused
    text = json.dumps(header).replace('"owner": "someone"', '"owner": "someone", "owner": "someone else"', 1)
    twice = text.encode() + b" " * (-len(text) % 8)
    with pytest.raises(IntegrityError, match=r"a key appears twice: \['owner'\]"):
        snapshot_verified(struct.pack("<Q", len(twice)) + twice + data, keyring)
    with pytest.raises(IntegrityError, match="its header is 1000 bytes, the file only 16"):
        snapshot_verified(struct.pack("<Q", 1000) + b"{}      ", keyring)
