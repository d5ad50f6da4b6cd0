"""The hang watchdog without Horovod: its verdicts as a pure function, and two watchdogs talking over TCP."""

from __future__ import annotations

import socket
import threading
import time
import types

import pytest
import tensorflow as tf

from hvrep import CommConfig, _env, kernels
from hvrep.errors import EXIT_HANG, EXIT_MISMATCH, ConfigError, WatchdogError
from hvrep.replica import activity, watchdog
from hvrep.replica.watchdog import Watchdog, verdict


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
    found = verdict(states, 2, timeout_s=20, stale_s=5, now=now)
    assert found is not None and found.exit == EXIT_HANG
    report = found.report
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
    report = verdict(states, 2, timeout_s=600, stale_s=5, now=now).report
    assert "different collectives at call #58" in report, report
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
    with socket.create_connection(w0.address, timeout=5) as stray:
        stray.sendall(b"GET / HTTP/1.0\r\n\r\n")  # not a rank: hung up on, nothing else happens
        stray.recv(200)  # the server's hello
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
    assert e0.codes == [EXIT_HANG.code] and time.monotonic() - t0 >= 4
    err = capsys.readouterr().err
    assert "collective call #2 run(step) (train step 3) has not completed within comm.timeout_s=5 s: rank(s) 1 did " \
        "not join" in err, err


def test_a_rank_that_cannot_reach_rank_0_decides_alone_after_the_timeout(capsys):
    w0, w1, _, e1 = _pair(timeout_s=5)
    w1.stale_s = 0.5
    w0.close()  # rank 0 stops answering: its server is shut down
    with w1.collective("reduce(sum) at controller.py:140"):
        assert e1.event.wait(15), "rank 1 never gave up on rank 0"
    assert e1.codes == [EXIT_HANG.code]
    err = capsys.readouterr().err
    assert "rank 1: collective call #1 reduce(sum) at controller.py:140 has not completed within" in err, err
    assert "rank 0, which hosts hvrep's watchdog, has not answered" in err


def test_the_module_functions_are_free_without_a_watchdog():
    assert watchdog.current() is None
    with watchdog.collective("run(x)"):
        watchdog.note_step("train step 1")


def test_a_mismatch_has_its_own_exit_code_and_a_hang_keeps_75():
    now = 1000.0
    apart = {0: (now, {**_state(9, "reduce(mean) at x.py:3: allgather int64[1]", True, 6),
                       "waiting": ["reduce(mean) at x.py:3: allgather int64[1]"]}),
             1: (now, {**_state(9, "run(step): allreduce float32[10]", True, 6),
                       "waiting": ["run(step): allreduce float32[10]"]})}
    found = verdict(apart, 2, timeout_s=600, stale_s=5, now=now)
    assert found is not None and found.exit == EXIT_MISMATCH and found.exit.code == 65
    assert found.exit.stopped == "mismatch" and not found.exit.requeue
    # Ranks inside several collectives (a step's buckets, in any order) that share one are not apart.
    together = {0: (now, {**_state(9, "run(step): allreduce float32[10]", True, 6),
                          "waiting": ["run(step): allreduce float32[10]", "run(step): allreduce float32[4]"]}),
                1: (now, {**_state(9, "run(step): allreduce float32[4]", True, 6),
                          "waiting": ["run(step): allreduce float32[4]"]})}
    assert verdict(together, 2, timeout_s=600, stale_s=5, now=now) is None
    assert EXIT_HANG.code == 75 and EXIT_HANG.stopped == "timeout" and EXIT_HANG.requeue


@pytest.mark.parametrize("native", [True, False], ids=["native-markers", "py_function-markers"])
def test_watched_marks_a_traced_collective_while_it_executes_not_while_it_is_traced(native):
    if native and activity.native_watch.native() is None:
        pytest.fail(f"hvrep's kernels are not loaded ({kernels.status().describe()}): `make setup` builds them")
    # A stand-in for one Horovod collective: an op that blocks until released, so the test can look inside.
    release, inside = threading.Event(), threading.Event()

    def blocking(x):
        def wait(t):
            inside.set()
            release.wait(10)
            return t

        return tf.py_function(wait, [x], x.dtype)

    fake = types.SimpleNamespace(allreduce=blocking, size=lambda: 2)
    hvd = activity.Watched(fake, lambda: "a compiled step")
    assert hvd.size() == 2  # everything else is the module's own
    w0, w1, _, _ = _pair(timeout_s=600)
    w0.activity = activity.Activity(native=native)
    watchdog.install(w0)
    try:
        step = tf.function(lambda x: hvd.allreduce(x) * 2)
        graph = step.get_concrete_function(tf.TensorSpec([3], tf.float32)).graph
        markers = sorted(op.type for op in graph.get_operations() if "hvrep_watchdog" in op.name)
        assert markers == (["HvrepWatchEnter", "HvrepWatchLeave"] if native else ["EagerPyFunc", "EagerPyFunc"])
        assert not w0.activity.pending  # traced: nothing is inside a collective yet
        result: list = []
        worker = threading.Thread(target=lambda: result.append(step(tf.ones([3]))))
        worker.start()
        assert inside.wait(10)
        time.sleep(0.2)
        labels = [what for what, _ in w0.activity.pending.values()]
        assert labels == ["a compiled step: allreduce float32[3]"], labels
        release.set()
        worker.join(10)
        assert result[0].numpy().tolist() == [2.0, 2.0, 2.0] and not w0.activity.pending
        assert w0.activity.last[1] == "a compiled step: allreduce float32[3]"
    finally:
        release.set()
        watchdog.install(None)
        w1.close()


def test_close_stops_the_server_and_frees_its_port():
    w0, w1, _, _ = _pair(timeout_s=600)
    address = w0.address
    w1.close()
    w0.close()
    with pytest.raises(OSError):
        socket.create_connection(address, timeout=2).close()


def test_the_last_words_cannot_hold_up_the_exit(monkeypatch, capsys):
    monkeypatch.setattr(watchdog, "END_WORK_S", 0.5)
    w0, w1, _, e1 = _pair(timeout_s=5)
    w1.on_end(lambda stopped, report: time.sleep(3600))  # a metrics.jsonl on a hung file system
    t0 = time.monotonic()
    threading.Thread(target=w1._end, args=(EXIT_HANG, "hvrep: a report"), daemon=True).start()
    assert e1.event.wait(5) and e1.codes == [EXIT_HANG.code]
    assert time.monotonic() - t0 < 3
    assert "did not finish within 0.5 s" in capsys.readouterr().err
    w0.close()


def test_a_rank_that_cannot_reach_the_watchdog_says_so_at_start_up(capsys):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nothing listens here once closed
    w1 = Watchdog(1, 2, 600, lambda _: f"127.0.0.1|{port}|{'ab' * 32}".encode(), interval=0.2,
                  exit_fn=lambda code: None)
    w1.close()
    err = capsys.readouterr().err
    assert f"rank 1 on {socket.gethostname()} cannot reach hvrep's watchdog on rank 0 at 127.0.0.1:{port}" in err
    assert "HVREP_WATCHDOG_ADDR" in err


def test_where_rank_0_listens():
    ifaces = {"lo": ["127.0.0.1"], "eth0": ["10.0.0.5"], "ib0": ["192.168.7.2"]}
    assert watchdog.listen_address(True, "", "ib0", ifaces, "10.0.0.5") == "127.0.0.1"  # one host
    assert watchdog.listen_address(True, "10.9.9.9", "", ifaces, "") == "10.9.9.9"  # HVREP_WATCHDOG_ADDR wins
    assert watchdog.listen_address(False, "", "ib0", ifaces, "10.0.0.5") == "192.168.7.2"  # Horovod's interface
    assert watchdog.listen_address(False, "", "192.168.0.0/16", ifaces, "10.0.0.5") == "192.168.7.2"  # a CIDR
    assert watchdog.listen_address(False, "", "", ifaces, "10.0.0.5") == "10.0.0.5"  # the host name's address
    assert watchdog.listen_address(False, "", "", ifaces, "127.0.1.1") == "10.0.0.5"
    with pytest.raises(WatchdogError, match="HVREP_WATCHDOG_ADDR"):
        watchdog.listen_address(False, "", "", {"lo": ["127.0.0.1"]}, "")


def test_a_port_range_lets_a_second_job_on_the_node_take_the_next_port(monkeypatch):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        first = s.getsockname()[1]
    monkeypatch.setenv("HVREP_WATCHDOG_PORT", f"{first}-{first + 20}")
    a, a1, _, _ = _pair(timeout_s=600)
    b, b1, _, _ = _pair(timeout_s=600)
    try:
        assert a.address[1] == first and first < b.address[1] <= first + 20
    finally:
        for w in (a, a1, b, b1):
            w.close()
    monkeypatch.setenv("HVREP_WATCHDOG_PORT", f"{first}-{first}")
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # past the closed watchdog's TIME_WAIT
        s.bind(("127.0.0.1", first))
        s.listen()
        with pytest.raises(WatchdogError, match=f"cannot listen on 127.0.0.1 at port {first}"):
            Watchdog(0, 2, 600, lambda a: a, interval=0.2, exit_fn=lambda code: None)
    for bad in ("x", "10-5", "0-10", "70000"):
        monkeypatch.setenv("HVREP_WATCHDOG_PORT", bad)
        with pytest.raises(ConfigError, match="HVREP_WATCHDOG_PORT"):
            _env.watchdog_ports()
