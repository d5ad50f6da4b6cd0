"""Test-process set-up shared by every tier."""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import tensorflow as tf

# Two logical CPU devices, so the in-graph (local/TPU) code path runs with two
# replicas in one process. Must happen before TensorFlow initialises devices.
_cpus = tf.config.list_physical_devices("CPU")
tf.config.set_logical_device_configuration(_cpus[0], [tf.config.LogicalDeviceConfiguration()] * 2)


# pytest-xdist's workers ignore SIGINT, and an ignored signal stays ignored across exec: every launcher a test
# started (prterun, hvrep launch) would ignore the Ctrl-C a test sends it. Tests start their jobs as a terminal would.
import signal  # noqa: E402

if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


# `make test` runs whole files on two xdist workers (--dist loadfile), in the order collected here
# (--no-loadscope-reorder; xdist's own reorder puts files with many tests first, which left the long launches
# with few tests to the end, where one worker ran them while the other idled). Longest first, then the rest in
# pytest's order: one worker's last file is then a short one. Ordered by their durations in the CI runs so
# far (the last: 2026-11-26, `PYTEST_ARGS=--durations=0`); a file that grows long belongs here.
LONGEST_FIRST = (
    "tests/slurm/test_slurm.py",
    "tests/unit/train/test_train_cli.py",
    "tests/multirank/test_multirank.py",
    "tests/unit/perf/test_benchmark_vs_horovod.py",
    "tests/multirank/test_multirank_apps.py",
    "tests/multirank/test_combinations.py",  # issue 46's covering array: one launch per launcher (new, not timed)
    "tests/unit/replica/test_combinations.py",
    "tests/multirank/test_bench_node.py",  # issue 51: one quick bench-node launch per launcher, side by side
    "tests/unit/train/test_odd_batch_train.py",  # issue 48: 8 hvrep train processes, ~2 min
    "tests/slurm/test_slurm_multinode.py",
    "tests/multirank/test_dead_and_stopped_ranks.py",
    "tests/multirank/test_faults_ranks.py",  # issue 49: 7 two-rank launches, 3 at a time (new, not timed)
    "tests/unit/train/test_faults_training.py",  # issue 49: 5 hvrep train runs in a row (new, not timed)
    "tests/unit/train/test_train_stop.py",
    "tests/multirank/test_elastic.py",
    "tests/multirank/test_usage_error_under_horovodrun.py",  # issue 47: two horovodrun launches, ~80 s
    "tests/unit/train/test_schedule_resume.py",
    "tests/unit/replica/test_backend_choice.py",
    "tests/unit/test_compat.py",
    "tests/unit/train/test_fit_loop.py",
    "tests/unit/perf/test_benchmark_allreduce.py",
    "tests/unit/cluster/test_doctor.py",
    "tests/multihost/test_netbed.py",
    "tests/unit/perf/test_bench.py",
    "tests/unit/known_issues/test_shape_sweep.py",  # issue 48: 30 shapes in 4 children, ~1 min
    "tests/unit/train/test_crash_report.py",
    "tests/unit/replica/test_powersgd_loss_scale.py",
    "tests/multirank/test_gloo_sockets_reset.py",
    "tests/unit/docs/test_examples.py",
    "tests/unit/perf/test_benchmark_optimizer_apply.py",
    "tests/multirank/test_model_parallel.py",
    "tests/unit/train/test_powersgd_train.py",
    "tests/unit/perf/test_benchmark_batch_norm.py",
    "tests/unit/cluster/test_horovodrun_mpi.py",
    "tests/multirank/test_cpu_budget.py",
    "tests/multirank/test_harness.py",
    "tests/multirank/test_sngan.py",
    "tests/unit/kernels/test_kernels_build.py",
    "tests/unit/train/test_loop.py",
    "tests/unit/perf/test_benchmark_loop_overhead.py",
    "tests/unit/kernels/test_kernels.py",
    "tests/unit/d4pg/test_app.py",
    "tests/unit/replica/test_local_sgd.py",
    "tests/unit/replica/test_powersgd.py",
)


def pytest_collection_modifyitems(config, items):
    rank = {path: i for i, path in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::", 1)[0], len(rank)))  # stable: the rest keep order
