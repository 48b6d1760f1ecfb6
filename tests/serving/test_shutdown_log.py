"""How a stop reads Triton's shutdown from its log (serving/host/launcher.py `Shutdown`), on lines as Triton
2.51 writes them (taken from its logs): what it still waits for after SIGINT, and when that will not come.
The served proofs (a stop after a reload that left a replaced version, a fleet's retire) are
tests/faults/test_leftovers.py and tests/scale/test_fleet.py."""

from __future__ import annotations

from serving.host.launcher import Shutdown, holds_only_replaced_versions, sessions_waited_for

MODELS = ("forward", "sessions")
SIGNAL = "Signal (2) received."


def stamped(*messages: str) -> list[str]:
    return [f'I1126 16:17:{48 + i:02d}.757463 7812 server.cc:321] "{m}"' for i, m in enumerate(messages)]


def in_flight(held: dict[str, int]) -> list[str]:
    """One of Triton's counts while it serves what is in flight: the versions, then each one's count."""
    header = f"Timeout 5: Found {len(held)} model versions that have in-flight inferences"
    return stamped(header, *(f"Model '{m}' (version 1) has {n} in-flight inferences" for m, n in held.items()))


def live(count: int, remaining: int) -> str:
    return stamped(f"Timeout {remaining}: Found {count} live models and 0 in-flight non-inference requests")[0]


def unloaded(model: str) -> str:
    return stamped(f"successfully unloaded '{model}' version 1")[0]


# a stop after a reload whose replaced version a request reached: 3 live (forward twice), both served ones unload
STUCK = [
    SIGNAL,
    *in_flight({}),
    *stamped("All models are stopped, unloading models"),
    live(3, 5),
    live(3, 4),
    unloaded("sessions"),
    unloaded("forward"),
    live(1, 3),
    live(1, 2),
]


def test_a_version_left_live_for_a_whole_count_after_every_served_model_unloaded_is_a_replaced_one():
    assert holds_only_replaced_versions(STUCK, MODELS)


def test_one_count_after_the_last_unload_is_not_yet_a_whole_one():
    assert not holds_only_replaced_versions(STUCK[:-1], MODELS)


def test_a_served_model_still_unloading_is_waited_for():
    lines = [*STUCK[:5], unloaded("forward"), live(2, 3), live(2, 2)]  # sessions has not unloaded yet
    assert not holds_only_replaced_versions(lines, MODELS)


def test_a_shutdown_whose_count_reaches_zero_holds_nothing():
    lines = [*STUCK[:-2], live(0, 3)]
    assert not holds_only_replaced_versions(lines, MODELS)


def test_sessions_alone_in_flight_are_counted_and_anything_else_is_waited_for():
    assert sessions_waited_for([SIGNAL, *in_flight({"sessions": 2})]) == 2
    assert sessions_waited_for([SIGNAL, *in_flight({"sessions": 2, "forward": 1})]) == 0  # a stateless call
    assert sessions_waited_for([SIGNAL, *in_flight({"sessions": 2, "forward": 1})[:2]]) == 0  # half written
    assert sessions_waited_for([SIGNAL, *in_flight({"sessions": 1}), *in_flight({})]) == 0  # they ended
    # a second model set's sessions (the trained model's, beside the default one) are sessions too
    assert sessions_waited_for([SIGNAL, *in_flight({"sessions": 1, "fortunes_sessions": 2})]) == 3
    assert sessions_waited_for([SIGNAL, *in_flight({"fortunes_sessions": 1, "fortunes_forward": 1})]) == 0


def test_a_stop_reads_the_log_from_its_signal_on_and_ends_sessions_only_when_not_draining(tmp_path):
    log = tmp_path / "triton.log"
    log.write_text("earlier run\n")
    offset = log.stat().st_size
    # a reload just before the stop unloaded the old forward: no unload of the served one since the signal
    before_signal = [unloaded("forward")]
    after = [*STUCK[:5], unloaded("sessions"), live(2, 3), live(2, 2)]
    with log.open("a") as out:
        out.write("\n".join([*before_signal, *after]) + "\n")
    assert not Shutdown(log, offset, MODELS, drain=True).settled()

    log.write_text("\n".join([SIGNAL, *in_flight({"sessions": 3})]) + "\n")
    draining, moved = Shutdown(log, 0, MODELS, drain=True), Shutdown(log, 0, MODELS, drain=False)
    assert not draining.settled() and not draining.ended
    assert moved.settled() and moved.ended.startswith("3 open session(s)")
