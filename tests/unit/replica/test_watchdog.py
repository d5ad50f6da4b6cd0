"""The hang watchdog without Horovod: its verdicts as a pure function, and two watchdogs talking over TCP."""

from __future__ import annotations

import socket
import threading
import time

import pytest

from hvrep import CommConfig
from hvrep.errors import ConfigError
from hvrep.replica import watchdog
from hvrep.replica.watchdog import EXIT_CODE, Watchdog, verdict


def _state(call: int, what: str, inside: bool, age: float, step: str = "") -> dict:
    return {"call": call, "what": what, "in": inside, "age": age, "step": step, "host": "node1", "pid": 100}


def test_timeout_s_is_validated_and_defaults_to_600():
    assert CommConfig().timeout_s == 600 and CommConfig(timeout_s=0).timeout_s == 0
    for bad in (-1, 2, float("nan"), float("inf"), "20", True):
        with pytest.raises(ConfigError, match="timeout_s"):
            CommConfig(timeout_s=bad)


def test_nothing_is_reported_while_every_wait_is_shorter_than_the_timeout():
    now = 1000.0
    states = {0: (now - 1, _state(7, "run(step)", True, 15)), 1: (now - 1, _state(7, "run(step)", True, 15))}
    assert verdict(states, 2, timeout_s=20, stale_s=5, now=now) is None


def test_a_rank_without_heartbeat_is_named_once_another_waits_past_the_timeout():
    now = 1000.0
    states = {0: (now - 0.5, _state(8, "run(Runner._train_step)", True, 21, "train step 8")),
              1: (now - 30, _state(7, "run(Runner._train_step)", False, 0.1, "train step 7"))}
    report = verdict(states, 2, timeout_s=20, stale_s=5, now=now)
    assert report is not None
    first = report.splitlines()[0]
    assert "collective call #8 run(Runner._train_step) (train step 8) has not completed within comm.timeout_s=20 s" \
        in first and "rank(s) 1 did not join" in first, report
    assert "rank 1 on node1 (pid 100): after collective call #7" in report and "<- NO HEARTBEAT" in report
    assert "Fix:" in report


def test_ranks_in_different_calls_at_the_same_number_are_reported_without_waiting_for_the_timeout():
    # Uneven input: rank 0 ran out of batches and reduces, rank 1 runs one more step; neither can finish.
    now = 1000.0
    states = {0: (now, _state(58, "reduce(mean) at example.py:50", True, 6)),
              1: (now, _state(58, "run(step_fn)", True, 6))}
    report = verdict(states, 2, timeout_s=600, stale_s=5, now=now)
    assert report is not None and "different collectives at call #58" in report, report
    assert "rank(s) 0 in reduce(mean) at example.py:50; rank(s) 1 in run(step_fn)" in report
    assert "input_fn yields different numbers of batches" in report
    # For a moment two ranks may be in different calls legitimately: not reported.
    states = {0: (now, _state(58, "reduce(mean) at example.py:50", True, 0.2)),
              1: (now, _state(58, "run(step_fn)", True, 3))}
    assert verdict(states, 2, timeout_s=600, stale_s=5, now=now) is None


class _Exits:
    def __init__(self) -> None:
        self.codes: list[int] = []
        self.event = threading.Event()

    def __call__(self, code: int) -> None:
        self.codes.append(code)
        self.event.set()  # the watchdog has stopped acting; its thread ends, as os._exit would end the process


def _pair(timeout_s: float) -> tuple[Watchdog, Watchdog, _Exits, _Exits]:
    """Rank 0 and rank 1 of a 2-rank job in this process; the address exchange is a hand-off."""
    box: dict[str, bytes] = {}
    ready = threading.Event()
    exits = (_Exits(), _Exits())

    def exchange0(address: bytes) -> bytes:
        box["a"] = address
        ready.set()
        return address

    def exchange1(_: bytes) -> bytes:
        ready.wait(10)
        return box["a"]

    w0 = Watchdog(0, 2, timeout_s, exchange0, interval=0.2, exit_fn=exits[0])
    w1 = Watchdog(1, 2, timeout_s, exchange1, interval=0.2, exit_fn=exits[1])
    return w0, w1, exits[0], exits[1]


def test_two_ranks_over_tcp_a_stuck_collective_ends_both_with_the_report(capsys):
    w0, w1, e0, _ = _pair(timeout_s=5)
    w0.stale_s = w1.stale_s = 1.0
    assert w0._server is not None
    with socket.create_connection(("127.0.0.1", w0._server.server_address[1]), timeout=5) as stray:
        stray.sendall(b"GET / HTTP/1.0\r\n\r\n")  # not a rank: hung up on, nothing else happens
        assert stray.recv(100) == b""
    with w1.collective("run(step)"):
        w0.note_step("train step 3")
        with w0.collective("run(step)"):
            time.sleep(0.5)  # both heartbeat inside call #1: no verdict
            assert not e0.event.is_set()
        w1.close()  # rank 1 stops heartbeating (a SIGSTOP) ...
        t0 = time.monotonic()
        with w0.collective("run(step)"):  # ... while rank 0 waits in its next call
            assert e0.event.wait(15), "rank 0's watchdog never ended the job"
    assert e0.codes == [EXIT_CODE] and time.monotonic() - t0 >= 4
    err = capsys.readouterr().err
    assert "collective call #2 run(step) (train step 3) has not completed within comm.timeout_s=5 s: rank(s) 1 did " \
        "not join" in err, err


def test_a_rank_that_cannot_reach_rank_0_decides_alone_after_the_timeout(capsys):
    w0, w1, _, e1 = _pair(timeout_s=5)
    w1.stale_s = 0.5
    w0.close()  # rank 0 stops answering: its server is shut down
    assert w0._server is not None
    w0._server.shutdown()
    w0._server.server_close()
    with w1.collective("reduce(sum) at controller.py:140"):
        assert e1.event.wait(15), "rank 1 never gave up on rank 0"
    assert e1.codes == [EXIT_CODE]
    err = capsys.readouterr().err
    assert "rank 1: collective call #1 reduce(sum) at controller.py:140 has not completed within" in err, err
    assert "rank 0, which hosts hvrep's watchdog, has not answered" in err


def test_the_module_functions_are_free_without_a_watchdog():
    assert watchdog.current() is None
    with watchdog.collective("run(x)"):
        watchdog.note_step("train step 1")
