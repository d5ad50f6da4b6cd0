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
from hvrep.replica.cores import bind_cores, container_cpus, default_budget
from hvrep.train import config as configs

CHILD = r"""
import json, os, sys, threading
from hvrep.replica.cores import bind_cores, default_budget
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


TWICE = r"""
import json
from hvrep.replica.cores import bind_cores
first = bind_cores(0, 2, 1)
again = bind_cores(0, 2, 1)  # a second Replicator of the process: its set is now narrower than the node
print(json.dumps([first.cores, first.bound_here, again.cores, again.bound_here]))
"""


@pytest.mark.skipif(len(ALLOWED) < 2, reason="binding one of 2 ranks to a core of its own needs 2 cores")
def test_a_second_binding_keeps_the_cores_the_first_one_chose():
    out = subprocess.run([sys.executable, "-c", TWICE], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr[-2000:]
    assert json.loads(out.stdout.splitlines()[-1]) == [[ALLOWED[0]], True, [ALLOWED[0]], False]


def test_more_ranks_times_threads_than_cores_is_refused_with_the_fix():
    with pytest.raises(ConfigError, match=r"x train.threads=2 = .* cores on this node.*Fix: lower train.threads"):
        bind_cores(0, len(ALLOWED), 2)
    assert sorted(os.sched_getaffinity(0)) == ALLOWED  # nothing was bound on the way


def _pair(budget):
    return budget.threads, budget.bind


def test_the_defaults_give_each_rank_its_share_of_the_node_and_bind_it_where_no_launcher_did():
    cfg = configs.preset("demo")
    assert cfg.train.threads is None and cfg.train.bind_cores is None  # the defaults are chosen at start-up
    # 2 ranks on 2 unbound cores (horovodrun --gloo, mpirun --bind-to none): 1 thread each, bound here
    assert _pair(default_budget(None, None, local_size=2, allowed=2, online=2)) == (1, True)
    assert _pair(default_budget(None, None, local_size=4, allowed=16, online=16)) == (4, True)
    # a launcher or Slurm bound the rank to 3 of 16 cores: 3 threads, its binding kept
    assert _pair(default_budget(None, None, local_size=4, allowed=3, online=16)) == (3, False)
    # one rank alone: TensorFlow's own pools, nothing bound
    assert _pair(default_budget(None, None, local_size=1, allowed=8, online=8)) == (None, False)
    # the settings win
    assert _pair(default_budget(2, None, local_size=2, allowed=8, online=8)) == (2, True)
    assert _pair(default_budget(None, False, local_size=2, allowed=8, online=8)) == (4, False)
    assert _pair(default_budget(None, True, local_size=1, allowed=8, online=8)) == (8, True)
    # more ranks than cores: one thread each, unbound (binding would need a core per rank)
    assert _pair(default_budget(None, None, local_size=3, allowed=2, online=2)) == (1, False)
    # this machine, as hvrep train sees it
    budget = default_budget(None, None, local_size=len(ALLOWED))
    assert budget.threads == 1 and budget.bind and "ranks on this node" in budget.why


def test_ranks_that_share_a_restricted_set_divide_it_and_a_per_rank_binding_is_kept():
    # Issue 50: "allowed < online" was taken for a per-rank binding. 4 ranks in a 4-core container (its cgroup's
    # cpuset) on a 64-core node each sized their pools to all 4: 16 threads on 4 cores.
    assert _pair(default_budget(None, None, local_size=4, allowed=4, online=64, container=4)) == (1, True)
    # horovodrun inside a Slurm allocation of 8 cores without a cgroup cpuset: it binds no rank, they share the set
    assert _pair(default_budget(None, None, local_size=4, allowed=8, online=64, launcher_binds=False)) == (2, True)
    budget = default_budget(None, None, local_size=4, allowed=8, online=64, launcher_binds=False)
    assert "8 allowed cores (of 64) shared by 4 ranks" in budget.why
    # mpirun --bind-to package, 8 ranks on 2 sockets of 32: 4 ranks share each socket's set (8 x 32 > 64), and
    # none can tell which block of it is its own: 8 threads each, left to the kernel within the socket
    assert _pair(default_budget(None, None, local_size=8, allowed=32, online=64)) == (8, False)
    # per-rank bindings (mpirun --bind-to core, srun --cpu-bind): disjoint sets that fit the container, kept
    assert _pair(default_budget(None, None, local_size=4, allowed=3, online=16)) == (3, False)
    assert _pair(default_budget(None, None, local_size=4, allowed=4, online=64, container=16)) == (4, False)
    # a container as large as the node is no restriction
    assert _pair(default_budget(None, None, local_size=4, allowed=16, online=16, container=16)) == (4, True)


def test_container_cpus_reads_the_nearest_cpuset_of_this_process_cgroup(tmp_path):
    # cgroup v2: the process's own cgroup has no cpuset file; its parent has one
    v2 = tmp_path / "v2"
    (v2 / "slurm" / "job_7" / "step_0").mkdir(parents=True)
    (v2 / "cgroup.controllers").write_text("cpuset cpu memory\n")
    (v2 / "slurm" / "job_7" / "cpuset.cpus.effective").write_text("0-3,8,10-11\n")
    (tmp_path / "v2.cgroup").write_text("0::/slurm/job_7/step_0\n")
    assert container_cpus(str(v2), str(tmp_path / "v2.cgroup")) == 7
    # cgroup v1: the cpuset hierarchy's own line
    v1 = tmp_path / "v1"
    (v1 / "cpuset" / "docker" / "abc").mkdir(parents=True)
    (v1 / "cpuset" / "docker" / "abc" / "cpuset.effective_cpus").write_text("2-5\n")
    (tmp_path / "v1.cgroup").write_text("4:memory:/docker/abc\n3:cpuset:/docker/abc\n0::/\n")
    assert container_cpus(str(v1), str(tmp_path / "v1.cgroup")) == 4
    # nothing readable: unknown, not zero
    assert container_cpus(str(tmp_path / "none"), str(tmp_path / "v1.cgroup")) is None
    assert container_cpus(str(v1), str(tmp_path / "missing")) is None


def test_a_replicator_of_one_process_keeps_tensorflows_pools_and_a_typo_names_the_choices():
    import hvrep

    repl = hvrep.Replicator("local")
    assert repl.cpu_budget is None and repl.cpu_binding is None
    with pytest.raises(ConfigError, match=r"cpu_budget must be one of \('auto', 'off'\), got 'of'"):
        hvrep.Replicator("local", cpu_budget="of")


POOLS_CHILD = """
import sys
import tensorflow as tf
from hvrep.errors import HvrepError
from hvrep.replica.cores import set_pools
set_pools(3, "train.threads=3")
print(tf.config.threading.get_intra_op_parallelism_threads(), tf.config.threading.get_inter_op_parallelism_threads())
tf.constant(1.0) + 1.0  # the runtime starts: its pools are fixed now
try:
    set_pools(2, "train.threads=2")
except HvrepError as e:
    print(e)
"""


def test_set_pools_sizes_both_pools_and_once_an_op_ran_names_the_setting_and_the_fix():
    out = subprocess.run([sys.executable, "-c", POOLS_CHILD], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"})
    assert out.returncode == 0, out.stderr[-2000:]
    sized, error = out.stdout.splitlines()[:2]
    assert sized == "3 3"
    assert error.startswith("train.threads=2 cannot be applied: TensorFlow's runtime is already running"), error
    assert "TF_NUM_INTRAOP_THREADS" in error
