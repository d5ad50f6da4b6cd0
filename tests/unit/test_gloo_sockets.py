"""hvrep.compat.gloo_sockets: Horovod's connections opened in a recorded block are shut down (the peer reads EOF
at once, as a waiting Gloo pair must), while their descriptors stay open; connections another thread of the
process opened in the same window, and every other socket, are left alone.

Horovod's Gloo pairs are made by C++ code: here by libc's socket/connect/listen/accept through ctypes, the same
system calls outside Python's socket module. A user thread's connection goes through Python's socket module.
"""

from __future__ import annotations

import ctypes
import os
import socket
import struct
import sys
import threading

import pytest

from hvrep.compat import gloo_sockets

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/fd")
_libc = ctypes.CDLL(None, use_errno=True)


def _sockaddr(port: int) -> bytes:
    return struct.pack("=H", socket.AF_INET) + struct.pack("!H", port) + socket.inet_aton("127.0.0.1") + bytes(8)


def _c_connect(port: int) -> int:
    """A TCP connection to 127.0.0.1:``port`` made in C, as Gloo's connecting side makes it."""
    fd = _libc.socket(socket.AF_INET, socket.SOCK_STREAM, 0)
    addr = _sockaddr(port)
    assert fd >= 0 and _libc.connect(fd, addr, len(addr)) == 0, os.strerror(ctypes.get_errno())
    return fd


def _c_accepting_pair(client_port_holder: list) -> int:
    """A connection accepted in C on a listener closed afterwards, as Gloo's accepting side does."""
    fd = _libc.socket(socket.AF_INET, socket.SOCK_STREAM, 0)
    addr = _sockaddr(0)
    assert _libc.bind(fd, addr, len(addr)) == 0 and _libc.listen(fd, 1) == 0
    port = socket.socket(fileno=os.dup(fd)).getsockname()[1]
    client = socket.create_connection(("127.0.0.1", port), timeout=5)  # the peer process's end
    client_port_holder.append(client)
    accepted = _libc.accept(fd, None, None)
    assert accepted >= 0 and _libc.close(fd) == 0
    return accepted


def test_horovods_connections_are_shut_down_and_another_threads_are_left_alone():
    server = socket.create_server(("127.0.0.1", 0))
    before_client = socket.create_connection(server.getsockname(), timeout=5)
    before_peer, _ = server.accept()
    peers: list[socket.socket] = []
    user: dict[str, socket.socket] = {}
    # The user thread's own listener: were it to accept on ``server`` too, the two accepts could take each other's
    # connections and the test would check the wrong peer.
    user_server = socket.create_server(("127.0.0.1", 0))

    def user_thread() -> None:  # connects and accepts while "hvd.init()" runs
        user["client"] = socket.create_connection(user_server.getsockname(), timeout=5)
        user["peer"], _ = user_server.accept()

    with gloo_sockets.recorded():
        thread = threading.Thread(target=user_thread)
        thread.start()
        connector = _c_connect(server.getsockname()[1])
        peers.append(server.accept()[0])
        acceptor = _c_accepting_pair(peers)
        thread.join()
        listener = socket.create_server(("127.0.0.1", 0))  # not connected: left alone
    assert {fd for fd, _ in gloo_sockets.world_connections()} == {connector, acceptor}

    assert gloo_sockets.shut_down_world() == 2
    for peer in peers:  # a peer process waiting to receive on Horovod's connections reads end-of-file at once
        peer.settimeout(5)
        assert peer.recv(1) == b""
    os.fstat(connector)  # the descriptors stay open: their owner (Horovod's leaked pair) closes them
    # The user thread's connection, both its ends, and the one opened before still work both ways.
    for a, b in ((user["client"], user["peer"]), (before_client, before_peer)):
        a.sendall(b"x")
        b.settimeout(5)
        assert b.recv(1) == b"x"
    listener.settimeout(0.2)
    with pytest.raises(TimeoutError):
        listener.accept()  # still listening, nothing shut down
    assert gloo_sockets.world_connections() == set()
    assert gloo_sockets.shut_down_world() == 0
    for fd in (connector, acceptor):
        os.close(fd)
    for s in (server, user_server, before_client, before_peer, user["client"], user["peer"], listener, *peers):
        s.close()
