"""A user thread opens a connection while ``hvd.init()`` runs; a reset shuts down Horovod's connections only
(run by test_gloo_sockets_reset.py).

Each rank starts a thread that connects to (and accepts from) a server of its own the moment ``hvd.init()`` is
called, inside ``gloo_sockets.recorded()`` as an elastic reset records the world. After ``hvd.shutdown()`` and
``shut_down_world()`` (what ``reform_world`` does), the user's connection must still carry bytes both ways. Each
rank prints one JSON line.

    horovodrun -np 2 -H localhost:2 --gloo python tests/multirank/gloo_sockets_probe.py
"""

import json
import socket
import threading

import tensorflow as tf

from hvrep import compat
from hvrep.compat import gloo_sockets

hvd = compat.import_horovod()
server = socket.create_server(("127.0.0.1", 0))
go, user = threading.Event(), {}


def user_thread() -> None:
    go.wait()
    user["client"] = socket.create_connection(server.getsockname(), timeout=10)
    user["during_init"] = not hvd.is_initialized()
    user["peer"], _ = server.accept()


thread = threading.Thread(target=user_thread)
thread.start()
with gloo_sockets.recorded():
    go.set()
    hvd.init()
    thread.join()
world = {fd for fd, _ in gloo_sockets.world_connections()}
rank = int(hvd.rank())
total = float(hvd.allreduce(tf.constant(1.0), op=hvd.Sum, name="together"))
hvd.shutdown()
closed = gloo_sockets.shut_down_world()
works = []
for a, b in ((user["client"], user["peer"]), (user["peer"], user["client"])):
    try:
        a.sendall(b"x")
        b.settimeout(5)
        works.append(b.recv(1) == b"x")
    except OSError:
        works.append(False)
print("GLOO_SOCKETS " + json.dumps({
    "rank": rank, "total": total, "world": len(world), "closed": closed,
    "user_recorded": sorted({user["client"].fileno(), user["peer"].fileno()} & world),
    "during_init": user["during_init"], "user_connection_works": works}), flush=True)
