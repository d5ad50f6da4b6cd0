"""hvrep.compat.gloo_sockets: the connections opened in a recorded block are shut down (the peer reads EOF at
once, as a waiting Gloo pair must), while their descriptors stay open and other sockets are left alone."""

from __future__ import annotations

import os
import socket
import sys

import pytest

from hvrep.compat import gloo_sockets

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/fd")


def _pair(server: socket.socket) -> tuple[socket.socket, socket.socket]:
    client = socket.create_connection(server.getsockname(), timeout=5)
    peer, _ = server.accept()
    peer.settimeout(5)
    return client, peer


def test_the_recorded_connections_are_shut_down_and_the_others_left_alone():
    server = socket.create_server(("127.0.0.1", 0))
    before_client, before_peer = _pair(server)  # opened before the block: not the world's
    with gloo_sockets.recorded():
        world_client, world_peer = _pair(server)
        listener = socket.create_server(("127.0.0.1", 0))  # not connected: left alone
    recorded = {fd for fd, _ in gloo_sockets.world_connections()}
    assert world_client.fileno() in recorded and world_peer.fileno() in recorded
    assert before_client.fileno() not in recorded

    assert gloo_sockets.shut_down_world() == 2
    # a peer process waiting to receive on this connection reads end-of-file at once
    assert world_peer.recv(1) == b""
    # the descriptor stays open: its owner (Horovod's leaked pair) closes it
    os.fstat(world_client.fileno())
    # the connection opened before the block still works both ways
    before_client.sendall(b"x")
    assert before_peer.recv(1) == b"x"
    listener.settimeout(0.2)
    with pytest.raises(TimeoutError):
        listener.accept()  # still listening, nothing shut down
    assert gloo_sockets.world_connections() == set()
    assert gloo_sockets.shut_down_world() == 0
    for s in (server, before_client, before_peer, world_client, world_peer, listener):
        s.close()
