"""The watchdog's port against a peer that holds no secret: two real watchdogs over TCP and a real attacker
process (tests/multirank/attacker.py). Nothing it sends ends the job, changes an exit code, or is printed."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from pathlib import Path

from hvrep.errors import EXIT_HANG
from hvrep.replica import watchdog
from tests.unit.replica.test_watchdog import _pair

ATTACKER = Path(__file__).resolve().parents[2] / "multirank" / "attacker.py"
MARKER = "INJECTED-by-a-peer-without-the-secret"


def test_a_peer_without_the_secret_cannot_end_the_job_and_nothing_it_sent_is_printed(capsys):
    w0, w1, e0, e1 = _pair(timeout_s=5)
    w0.stale_s = w1.stale_s = 1.0
    host, port = w0.address
    assert host == "127.0.0.1"  # a one-host job listens on loopback only
    try:
        attacker = subprocess.Popen([sys.executable, str(ATTACKER), host, str(port), "--seconds", "7", "--marker",
                                     MARKER], stdout=subprocess.PIPE, text=True)
        # Both ranks keep issuing short collectives, as a training job does, while the attack runs.
        t0 = time.monotonic()
        while attacker.poll() is None and time.monotonic() - t0 < 30:
            with w0.collective("run(step)"), w1.collective("run(step)"):
                time.sleep(0.05)
        sent = attacker.communicate(timeout=30)[0]
        assert '"forged_lines"' in sent and '"huge_lines": 0' not in sent, sent
        # The ranks were heard throughout: their connections were never crowded out.
        for rank in (0, 1):
            heard = time.monotonic() - w0._states[rank][0]
            assert heard < 1.0, f"rank {rank} last heard {heard:.1f} s ago"
        assert not e0.event.is_set() and not e1.event.is_set(), (e0.codes, e1.codes)
        assert w0._verdict is None
        assert w0.rejected_total >= 50, w0.rejected_total  # dropped and counted
        # Idle connections do not pile up: the server holds the two ranks' and those still in AUTH_S.
        assert w0._server is not None and len(w0._server._conns) <= 2 + watchdog.MAX_UNAUTHENTICATED
        time.sleep(watchdog.AUTH_S + 1)
        assert len(w0._server._conns) == 2, len(w0._server._conns)
        # Hang detection still works, and its report holds nothing the peer sent.
        w1.close()
        with w0.collective("run(step)"):
            assert e0.event.wait(20), "rank 0's watchdog never ended the job"
        assert e0.codes == [EXIT_HANG.code]
    finally:
        w0.close()
        w1.close()
    out = capsys.readouterr()
    assert "has not completed within comm.timeout_s=5 s: rank(s) 1 did not join" in out.err, out.err
    assert "did not authenticate" in out.err
    assert MARKER not in out.out + out.err


def test_a_line_signed_for_another_connection_or_out_of_sequence_is_dropped():
    w0, w1, e0, _ = _pair(timeout_s=600)
    try:
        link = w1._link
        assert link is not None
        line = watchdog._line(w1.secret, b"c", link.nonce, b'{"rank": 1}')
        # Replayed on a connection of its own (another nonce): dropped like garbage.
        with socket.create_connection(w0.address, timeout=5) as s:
            s.recv(200)
            s.sendall(line)
            assert s.recv(100) == b""
        # A line signed with a wrong secret on the right nonce: dropped too.
        with socket.create_connection(w0.address, timeout=5) as s:
            nonce = s.recv(200).rstrip(b"\n").partition(b" ")[2]
            s.sendall(watchdog._line(b"x" * 32, b"c", nonce, b'{"rank": 1}'))
            assert s.recv(100) == b""
        assert w0.rejected_total >= 2 and not e0.event.is_set()
    finally:
        w0.close()
        w1.close()
