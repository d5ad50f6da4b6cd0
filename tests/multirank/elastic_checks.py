"""What the elastic tests share: the discovery script, reading what the workers and `hvrep train` wrote,
finding and signalling a worker, and the checks of the replica-API and model.fit scenarios (elastic_worker.py,
elastic_fit_worker.py). Used on two local host names (test_elastic.py) and on 3 namespace hosts
(tests/multihost/test_elastic_bed.py)."""

from __future__ import annotations

import json
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import psutil


def discovery_script(tmp: Path, hosts: Path) -> Path:
    """An executable that prints ``hosts``: horovodrun's --host-discovery-script."""
    script = tmp / "discover.sh"
    script.write_text(f"#!/bin/sh\ncat {hosts}\n")
    script.chmod(0o755)
    return script


def jsonl(paths) -> list[dict]:
    """The JSON lines of ``paths``, in order, each with ``worker`` (its file's name); a torn last line skipped."""
    lines = []
    for path in sorted(paths):
        lines += [{**json.loads(line), "worker": path.name} for line in path.read_text().splitlines()
                  if line.endswith("}")]
    return lines


def events(run: Path) -> list[dict]:
    """``hvrep train``'s metrics.jsonl lines in ``run`` so far."""
    path = run / "metrics.jsonl"
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.endswith("}")]


def rank_of(p: psutil.Process, program: str = "hvrep.cli") -> int | None:
    """The rank the launcher started ``p`` as (its HOROVOD_RANK; stale after a reset), if it runs ``program``."""
    try:
        if program not in " ".join(p.cmdline()):
            return None
        value = p.environ().get("HOROVOD_RANK")
    except psutil.Error:
        return None
    return int(value) if value is not None else None


def signal_rank_1(proc: subprocess.Popen, ready: Callable[[], bool], sig: int, deadline: float,
                  program: str = "hvrep.cli") -> tuple[psutil.Process | None, float | None]:
    """Sends ``sig`` to the job's rank-1 worker running ``program`` once ``ready()``; (the worker, when), or
    (None, None) if the job ended or ``deadline`` (monotonic) passed first."""
    while time.monotonic() < deadline and proc.poll() is None:
        if ready():
            found = [p for p in psutil.Process(proc.pid).children(recursive=True) if rank_of(p, program) == 1]
            if found:
                found[0].send_signal(sig)
                return found[0], time.time()
        time.sleep(0.2)
    return None, None


def _trajectory(records: list[dict]) -> list[tuple[int, int, int, list[int]]]:
    """elastic_worker.py's steps as the job kept them: (epoch, step in the epoch, world size, the global batch's
    sample ids) in training order, each step from the last world that trained it (a rollback's steps again)."""
    latest: dict[tuple[int, int], tuple[int, int, list[int]]] = {}  # (epoch, k) -> (world, size, ids)
    for r in records:
        if r["event"] != "step":
            continue
        world, size, ids = latest.get((r["epoch"], r["k"]), (-1, 0, []))
        if r["world"] > world:
            latest[(r["epoch"], r["k"])] = (r["world"], r["size"], list(r["ids"]))
        elif r["world"] == world:
            latest[(r["epoch"], r["k"])] = (world, size, ids + r["ids"])
    return [(e, k, size, ids) for (e, k), (_, size, ids) in sorted(latest.items())]


def _gram_schmidt(p):
    import numpy as np

    out = np.zeros_like(p)
    for j in range(p.shape[1]):
        c = p[:, j] - out[:, :j] @ (out[:, :j].T @ p[:, j])
        norm = np.linalg.norm(c)
        out[:, j] = c / norm if norm > 0 else 0.0
    return out


def replay_replica_api(records: list[dict], accumulation_steps: int, powersgd_rank: int) -> list:
    """The weights elastic_worker.py should end with, computed in one process from what it wrote: its initial
    weights, then each kept step's global batch (:func:`_trajectory`) as one batch, its gradients summed over
    ``accumulation_steps`` micro-batches and the mean applied by SGD (0.1, momentum 0.9) every that many.

    With ``powersgd_rank``: PowerSGD as Vogels et al.'s Algorithm 1 in NumPy on the mean gradient (the replicas'
    mean of M = G + e is all P, Q and the mean error depend on, so one worker holding the mean stands for any
    world), its error feedback and Q's reset whenever an update's world has another size than the last (what
    docs/powersgd.md says of a state at another world size). Only the draws of a zero Q come from hvrep
    (``random_q``: the RNG is not the algorithm), and the choice of matrix shape (``powersgd_matrix``).
    """
    import keras
    import numpy as np
    import tensorflow as tf

    from hvrep.replica.comm import powersgd_matrix
    from hvrep.replica.powersgd import random_q
    from tests.multirank.elastic_worker import features

    (first,) = [r for r in records if r["event"] == "synced" and r.get("initial") is not None and r["rank"] == 0]
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8, activation="relu"), keras.layers.Dense(2)])
    for v, w in zip(model.trainable_variables, first["initial"], strict=True):
        v.assign(np.asarray(w, np.float32))
    optimizer = keras.optimizers.SGD(0.1, momentum=0.9)
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    shapes = [tuple(v.shape) for v in model.trainable_variables]
    plans = [powersgd_matrix(s, powersgd_rank, 0) if powersgd_rank else None for s in shapes]
    errors = [None if p is None else np.zeros(p[:2]) for p in plans]
    qs = [None if p is None else np.zeros((p[1], p[2])) for p in plans]
    sums = [np.zeros(s, np.float64) for s in shapes]
    micro, reductions, last_size = 0, 0, None
    for _, _, size, ids in _trajectory(records):
        x, y = features(np.asarray(ids))
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x, training=True))
        sums = [total + g.numpy() for total, g in zip(sums, tape.gradient(loss, model.trainable_variables),
                                                      strict=True)]
        micro += 1
        if micro % accumulation_steps:
            continue
        grads = [total / accumulation_steps for total in sums]
        if powersgd_rank:
            if last_size is not None and size != last_size:
                errors = [None if e is None else np.zeros_like(e) for e in errors]
                qs = [None if q is None else np.zeros_like(q) for q in qs]
            last_size = size
            for i, p in enumerate(plans):
                if p is None:
                    continue
                rows, cols, r = p
                m = grads[i].reshape(rows, cols) + errors[i]
                q = qs[i].copy()
                norms = np.linalg.norm(q, axis=0)
                bad = ~(norms > 1e-6 * norms.max())  # a column with no direction (a zero Q) is drawn afresh
                q[:, bad] = random_q(cols, r, i, reductions).numpy().astype(np.float64)[:, bad]
                p_hat = _gram_schmidt(m @ q)
                qs[i] = m.T @ p_hat
                approx = p_hat @ qs[i].T
                errors[i] = m - approx
                grads[i] = approx.reshape(shapes[i])
            reductions += 1
        optimizer.apply_gradients(zip([tf.constant(g, tf.float32) for g in grads], model.trainable_variables,
                                      strict=True))
        sums = [np.zeros(s, np.float64) for s in shapes]
    return [v.numpy() for v in model.trainable_variables]


def check_replica_api(records: list[dict], sizes: list[tuple[int, int]], global_batch: int, n: int = 192,
                      accumulation_steps: int = 1, powersgd_rank: int = 0, atol: float = 0.0) -> None:
    """elastic_worker.py's run: a kill, a host added, a host dropped, the world going through ``sizes``
    ((old, new) per reset); ``records`` from its trained.*.jsonl files (:func:`jsonl`). With
    ``accumulation_steps`` > 1 or ``powersgd_rank`` (its options) the final weights of every worker must equal
    :func:`replay_replica_api`'s to ``atol``."""
    assert {r["backend"] for r in records if r["event"] == "start"} == {"horovod"}
    (kill,) = [r for r in records if r["event"] == "killing"]
    done = [r for r in records if r["event"] == "done"]
    # The workers alive at the end: the first world's less the killed and the dropped one, plus the joiner.
    assert len(done) == sizes[-1][1], done
    # The first world's survivors saw every reset; a joiner only those after it joined.
    whole = [d for d in done if len(d["resets"]) == len(sizes)]
    assert whole, f"no worker that finished saw every reset: {[d['resets'] for d in done]}"
    for d in whole:
        resets = d["resets"]
        assert [r["why"] for r in resets] == ["failure", "hosts added", "hosts removed"], resets
        assert [(r["old_size"], r["new_size"]) for r in resets] == sizes, resets
        assert resets[0]["rolled_back"] == {"step": 2.0}, resets[0]  # killed at step 7, last commit at step 5
        assert resets[1]["rolled_back"] == {} and resets[2]["rolled_back"] == {}, resets
    synced = [r for r in records if r["event"] == "synced"]
    back = [r for r in synced if r["world"] == 1]
    assert len(back) == sizes[0][1], back  # every survivor synced in the world after the kill
    for r in back:
        assert r["step"] == 5, r  # rolled back to the commit
        assert r["at"] - kill["at"] < 30, f"a survivor went on {r['at'] - kill['at']:.1f} s after the kill"

    # Weights identical on every worker after each sync, per world.
    by_world: dict[tuple, set] = {}
    for r in synced:
        by_world.setdefault((r["step"], r["size"]), set()).add(r["weights"])
    assert all(len(w) == 1 for w in by_world.values()), by_world

    # Each epoch's samples, the rolled-back steps replaced by what was trained after the rollback.
    steps = [r for r in records if r["event"] == "step"]
    for epoch in sorted({r["epoch"] for r in steps}):
        latest: dict[int, tuple[int, list[int]]] = {}  # step in the epoch -> (world, ids of its last training)
        for r in steps:
            if r["epoch"] != epoch:
                continue
            world, ids = latest.get(r["k"], (-1, []))
            if r["world"] > world:
                latest[r["k"]] = (r["world"], list(r["ids"]))
            elif r["world"] == world:
                latest[r["k"]] = (world, ids + r["ids"])
        trained = [i for _, ids in latest.values() for i in ids]
        assert len(trained) == len(set(trained)), f"epoch {epoch}: a sample trained twice since the rollback"
        assert all(len(ids) == global_batch for _, ids in latest.values()), f"epoch {epoch}: a step short of samples"
        assert sorted(latest) == list(range(len(latest))), f"epoch {epoch}: steps missing"
        assert len(trained) == n // global_batch * global_batch, f"epoch {epoch}: {len(trained)} samples trained"

    if accumulation_steps > 1 or powersgd_rank:
        import numpy as np

        want = replay_replica_api(records, accumulation_steps, powersgd_rank)
        for d in done:
            worst = max(float(np.max(np.abs(np.asarray(g) - w))) for g, w in zip(d["final"], want, strict=True))
            assert worst <= atol, (f"{d['worker']}: final weights off the one-process replay by {worst:.3g} "
                                   f"(tolerance {atol:g})")


def check_fit(records: list[dict], sizes: list[tuple[int, int]], powersgd_steps: int | None = None) -> None:
    """elastic_fit_worker.py's run: rank 0 killed at epoch 1, batch 8, then (with ``sizes`` of 3 resets) a host
    added at epoch 2, batch 4 and one dropped at epoch 3, batch 4; ``records`` from its fit.*.jsonl files.
    ``powersgd_steps``: the reductions PowerSGD's state must count at the end (its --powersgd)."""
    done = [r for r in records if r["event"] == "done"]
    assert len(done) == sizes[-1][1], done
    whole = [d for d in done if len(d["resets"]) == len(sizes)]
    assert whole, f"no worker that finished saw every reset: {[d['resets'] for d in done]}"
    why = ["failure", "hosts added", "hosts removed"][:len(sizes)]
    for d in whole:
        resets = d["resets"]
        assert [r["why"] for r in resets] == why and [(r["old_size"], r["new_size"]) for r in resets] == sizes, \
            resets
        assert resets[0]["rolled_back"] == {"batch": 3.0}, resets  # killed after batch 8, committed after batch 5
        assert all(r["rolled_back"] == {} for r in resets[1:]), resets  # a host joined or left: nothing lost
        assert d["epoch"] == 4 and d["size"] == sizes[-1][1], d
        # Epoch 1: 8 batches before the kill, then the 7 after the commit; the others 12 each.
        assert d["batches"] == {"0": 12, "1": 15, "2": 12, "3": 12}, d["batches"]
        assert d["accuracy"] >= 0.9, d
        if powersgd_steps is not None:
            assert d["powersgd_step"] == powersgd_steps, (d["powersgd_step"], powersgd_steps)
    (kill,) = [r for r in records if r["event"] == "killing"]
    after = [r for r in records if r["event"] == "reset" and r["why"] == "failure"]
    assert len(after) == sizes[0][1], after  # every survivor reset once for the failure
    assert all(r["at"] - kill["at"] < 30 for r in after), (kill, after)
