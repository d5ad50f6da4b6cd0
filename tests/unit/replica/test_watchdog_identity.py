"""Elastic training: the watchdog ends a stuck rank by itself only where it proves which process the rank is
(kernel boot id, pid namespace, pid and start time), never by a matching host name; otherwise every rank ends.

Containers of one job often share a host name, and nodes may all be called ``localhost``: a pid heard from a rank
on "my host" may then be an unrelated process here. The stand-in for that process is a real ``sleep``.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import socket
import subprocess
import threading

import pytest

from hvrep.errors import EXIT_HANG
from hvrep.replica.identity import ProcessIdentity
from hvrep.replica.watchdog import Verdict, Watchdog


@pytest.fixture
def rank0():
    """Rank 0 of an elastic 2-rank job, alone (rank 1's heartbeats are written in by each test)."""
    dog = Watchdog(0, 2, 30, lambda address: address, interval=5, exit_fn=lambda code: None, elastic=True)
    yield dog
    dog.close()


@pytest.fixture
def bystander():
    """A process that is not a rank: what a pid may name on a host that merely shares the rank's host name."""
    proc = subprocess.Popen(["sleep", "300"])
    yield proc
    if proc.poll() is None:
        proc.kill()
        proc.wait()


def _heard(dog: Watchdog, pid: int, proc: ProcessIdentity | None, host: str = "") -> Verdict:
    state = {"rank": 1, "call": 3, "what": "run(step)", "in": False, "age": 0.0, "step": "", "seq": 1,
             "host": host or socket.gethostname(), "pid": pid}
    if proc is not None:
        state["proc"] = proc.to_json()
    dog._states[1] = (0.0, state)
    return Verdict(EXIT_HANG, "hvrep: collective call #4 run(step) has not completed: rank(s) 1 did not join. "
                              "Exiting every rank", missing=(1,))


def test_a_matching_host_name_is_no_proof(rank0, bystander):
    # Rank 1 ran in another container with this host name: its pid here is the bystander's, its process not.
    elsewhere = dataclasses.replace(ProcessIdentity.of(bystander.pid), pid_ns="pid:[4026532000]")
    found = _heard(rank0, bystander.pid, elsewhere)
    assert not rank0._stuck_here(found)  # every rank ends, as without elasticity
    found = _heard(rank0, bystander.pid, None)  # a heartbeat naming host and pid only
    assert not rank0._stuck_here(found)
    rank0._end_stuck(found)
    assert bystander.poll() is None, "the watchdog killed a process that is not the rank"


def test_the_same_pid_with_another_start_time_is_another_process(rank0, bystander):
    earlier = dataclasses.replace(ProcessIdentity.of(bystander.pid), start=ProcessIdentity.of(bystander.pid).start - 1)
    found = _heard(rank0, bystander.pid, earlier)  # the rank ended; its pid went to the bystander
    assert not rank0._stuck_here(found)
    rank0._end_stuck(found)
    assert bystander.poll() is None


def test_a_rank_proven_here_is_ended_alone_even_under_another_host_name(rank0, bystander):
    os.kill(bystander.pid, signal.SIGSTOP)  # a stopped rank: SIGKILL ends it all the same
    found = _heard(rank0, bystander.pid, ProcessIdentity.of(bystander.pid), host="another-name")
    assert rank0._stuck_here(found)
    rank0._end_stuck(found)
    assert bystander.wait(timeout=10) == -signal.SIGKILL


def test_every_heartbeat_carries_its_process_identity():
    box, ready = {}, threading.Event()

    def exchange(address: bytes) -> bytes:
        if address:
            box["a"] = address
            ready.set()
        ready.wait(10)
        return box["a"]

    dogs = [Watchdog(r, 2, 30, exchange, interval=0.2, exit_fn=lambda code: None) for r in (0, 1)]
    try:
        done = threading.Event()
        for _ in range(100):
            if 1 in dogs[0]._states:
                break
            done.wait(0.05)
        state = dogs[0]._states[1][1]
        assert ProcessIdentity.from_json(state["proc"]) == ProcessIdentity.mine()
    finally:
        for dog in dogs:
            dog.close()
