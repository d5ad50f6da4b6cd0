"""Worker of run.sh: plain Horovod (hvd.elastic.run, no hvrep Replicator), one small all-reduce a step.

Rank 1 of the 3-worker world SIGKILLs itself at step KILL_STEP (60); each worker appends JSON lines to
OUT/<host>.jsonl: init, first step of each world, error (the collective that failed), reset begin/end, done.
FIX=1: around its reset the worker shuts down the old world's connections as hvrep does
(hvrep.compat.gloo_sockets); FIX=0: Horovod's own reset only. SIGUSR1 dumps its Python stacks to OUT."""

from __future__ import annotations

import faulthandler
import json
import os
import signal
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
import horovod.tensorflow as hvd
import horovod.tensorflow.elastic as hel
import tensorflow as tf
from horovod.common.elastic import ObjectState

OUT = sys.argv[1]
KILL = int(os.environ.get("KILL_STEP", "60"))
FIX = os.environ.get("FIX") == "1"
HOST = os.environ["HOROVOD_HOSTNAME"]
_stacks = open(f"{OUT}/py.{HOST}.{os.getpid()}.txt", "w")  # open for the process's life
faulthandler.register(signal.SIGUSR1, file=_stacks, all_threads=True)
if FIX:
    from hvrep.compat import gloo_sockets


def log(**kw) -> None:
    kw.update(host=HOST, pid=os.getpid(), t=time.time())
    with open(f"{OUT}/{HOST}.jsonl", "a") as f:
        f.write(json.dumps(kw) + "\n")


def _init() -> None:
    if FIX:
        with gloo_sockets.recorded():
            hvd.init()
    else:
        hvd.init()


_horovod_reset = hel._reset


def _reset() -> None:
    log(event="reset_begin")
    if FIX:
        hvd.shutdown()
        log(event="shut_down_sockets", n=gloo_sockets.shut_down_world())
        _init()
    else:
        _horovod_reset()
    log(event="reset_end", size=hvd.size(), rank=hvd.rank())


hel._reset = _reset  # read by hel.run below, when it wraps train


def main() -> None:
    _init()
    log(event="init", size=hvd.size(), rank=hvd.rank())
    state = ObjectState(hvd.broadcast_object, hvd.rank, step=0)
    x = tf.ones([4096])

    @hel.run
    def train(state) -> None:
        first = True
        while True:
            try:
                hvd.allreduce(x, op=hvd.Sum)
            except Exception as e:
                log(event="error", step=state.step, what=type(e).__name__, msg=str(e)[:300])
                raise
            if first:
                log(event="step", step=state.step, size=hvd.size())
                first = False
            state.step += 1
            if state.step % 5 == 0:
                state.commit()
            if hvd.size() == 3 and hvd.rank() == 1 and state.step == KILL:
                log(event="kill", step=state.step)
                os.kill(os.getpid(), signal.SIGKILL)
            if hvd.size() == 2 and state.step >= KILL + 40:
                log(event="done", step=state.step)
                return

    train(state)


if __name__ == "__main__":
    main()
