"""train.bind_cores: every thread of a rank, running or not yet started, on its own block of cores.

Each case runs in a child process: binding changes the affinity of the process that asks.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from hvrep.errors import ConfigError
from hvrep.train import config as configs
from hvrep.train.cores import bind_cores

CHILD = r"""
import json, os, sys, threading
from hvrep.train.cores import bind_cores
pre = os.environ.get("PRE_BIND")
if pre is not None:
    os.sched_setaffinity(0, {int(pre)})
stop = threading.Event()
early = threading.Thread(target=stop.wait)  # running before the binding, like Horovod's background thread
early.start()
binding = bind_cores(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]))
late_cores = []
late = threading.Thread(target=lambda: late_cores.extend(sorted(os.sched_getaffinity(0))))
late.start(); late.join()
tasks = {tid: sorted(os.sched_getaffinity(int(tid))) for tid in os.listdir("/proc/self/task")}
stop.set(); early.join()
print(json.dumps({"cores": binding.cores, "bound_here": binding.bound_here, "tasks": tasks, "late": late_cores}))
"""


def _child(local_rank, local_size, threads, pre_bind=None):
    env = dict(os.environ, **({"PRE_BIND": str(pre_bind)} if pre_bind is not None else {}))
    out = subprocess.run([sys.executable, "-c", CHILD, str(local_rank), str(local_size), str(threads)],
                         env=env, capture_output=True, text=True, timeout=60, check=True)
    return json.loads(out.stdout.splitlines()[-1])


ALLOWED = sorted(os.sched_getaffinity(0))
pytestmark = pytest.mark.skipif(len(ALLOWED) < (os.cpu_count() or 0),
                                reason="this test process is bound to some CPUs already (taskset or a cgroup)")


def test_the_last_local_rank_gets_the_last_core_on_every_thread_it_has_or_starts():
    got = _child(len(ALLOWED) - 1, len(ALLOWED), 1)
    assert got["bound_here"] is True and got["cores"] == [ALLOWED[-1]]
    assert len(got["tasks"]) >= 2 and all(c == [ALLOWED[-1]] for c in got["tasks"].values()), got["tasks"]
    assert got["late"] == [ALLOWED[-1]]


def test_a_process_a_launcher_bound_already_keeps_its_binding():
    got = _child(0, 1, 1, pre_bind=ALLOWED[-1])
    assert got["bound_here"] is False and got["cores"] == [ALLOWED[-1]]
    assert got["late"] == [ALLOWED[-1]]


def test_more_ranks_times_threads_than_cores_is_refused_with_the_fix():
    with pytest.raises(ConfigError, match=r"x train.threads=2 = .* cores on this node.*Fix: lower train.threads"):
        bind_cores(0, len(ALLOWED), 2)
    assert sorted(os.sched_getaffinity(0)) == ALLOWED  # nothing was bound on the way


def test_bind_cores_without_threads_is_a_config_error():
    with pytest.raises(ConfigError, match=r"train\.bind_cores=true needs train\.threads"):
        configs.apply_overrides(configs.preset("demo"), {"train.bind_cores": "true"})
    cfg = configs.apply_overrides(configs.preset("demo"), {"train.bind_cores": "true", "train.threads": "1"})
    assert cfg.train.bind_cores is True
