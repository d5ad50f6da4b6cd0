"""Bucketing of tensors into fusion buffers, and CommConfig validation."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
import tensorflow as tf

from hvrep import CommConfig
from hvrep.errors import ConfigError
from hvrep.replica import fusion


def test_buckets_fill_up_to_the_threshold_in_order():
    # 4 tensors of 40 bytes, limit 100: [0, 1], [2, 3].
    assert fusion.plan_buckets([40] * 4, ["f"] * 4, 100) == [[0, 1], [2, 3]]


def test_a_tensor_above_the_threshold_gets_its_own_bucket():
    assert fusion.plan_buckets([10, 500, 10], ["f"] * 3, 100) == [[0], [1], [2]]


def test_threshold_zero_means_one_tensor_per_bucket():
    assert fusion.plan_buckets([1, 2, 3], ["f"] * 3, 0) == [[0], [1], [2]]


def test_buckets_never_mix_dtypes():
    buckets = fusion.plan_buckets([4, 2, 4, 2], ["f32", "f16", "f32", "f16"], 1 << 20)
    assert buckets == [[0, 2], [1, 3]]


def test_num_groups_splits_bytes_evenly():
    buckets = fusion.plan_buckets([10] * 9, ["f"] * 9, 0, num_groups=3)
    assert buckets == [[0, 1, 2], [3, 4, 5], [6, 7, 8]]
    assert sorted(i for b in fusion.plan_buckets([5, 50, 5, 5], ["f"] * 4, 0, 2) for i in b) == [0, 1, 2, 3]


def test_fused_reduce_restores_shapes_and_dtypes_and_counts_calls():
    calls = []

    def reduce_buffer(buf):
        calls.append(int(buf.shape[0]))
        return buf * 2  # a stand-in "sum over two replicas" of identical values

    xs = [tf.reshape(tf.range(6, dtype=tf.float32), (2, 3)), tf.constant([1.0], tf.float32),
          tf.constant([[0.5]], tf.float16)]
    out = fusion.fused_reduce(xs, reduce_buffer, threshold=1 << 20)
    assert sorted(calls) == [1, 7]  # one f32 buffer of 6+1 elements, one f16 buffer
    for x, o in zip(xs, out, strict=True):
        assert o.shape == x.shape and o.dtype == x.dtype
        np.testing.assert_array_equal(o.numpy(), 2 * x.numpy())


def test_fused_reduce_casts_to_the_wire_dtype_and_prescales():
    seen = []

    def reduce_buffer(buf):
        seen.append(buf.dtype)
        return buf

    out = fusion.fused_reduce([tf.constant([4.0, 8.0])], reduce_buffer, 0, wire_dtype=tf.float16, prescale=0.5)
    assert seen == [tf.float16] and out[0].dtype == tf.float32
    np.testing.assert_array_equal(out[0].numpy(), [2.0, 4.0])


@pytest.mark.parametrize(("field", "value", "fragment"), [
    ("fusion_threshold_bytes", -1, "fusion_threshold_bytes must be None (the backend's choice) or an int >= 0, got -1"),
    ("cycle_time_ms", 0, "cycle_time_ms must be None or > 0, got 0"),
    ("horovod_fusion_threshold_bytes", -5, "horovod_fusion_threshold_bytes must be None or an int >= 0, got -5"),
    ("compression", "int8", "compression must be one of ('none', 'fp16', 'bf16', 'powersgd'), got 'int8'"),
    ("num_groups", -2, "num_groups must be an int >= 0, got -2"),
    ("mpi_yield_when_idle", "yes", "mpi_yield_when_idle must be True, False or None (hvrep sets nothing), got 'yes'"),
    ("mpi_yield_when_idle", 1, "mpi_yield_when_idle must be True, False or None (hvrep sets nothing), got 1"),
])
def test_comm_config_rejects_bad_values_by_name(field, value, fragment):
    with pytest.raises(ConfigError) as e:
        CommConfig(**{field: value})
    assert fragment in str(e.value)


def test_comm_config_defaults_leave_horovods_own_settings_alone():
    cfg = CommConfig()
    assert cfg.fusion_threshold_bytes is None  # the backend's choice: horovod 25 MiB, in-graph 128 MiB
    # hvrep's bucket size does not set Horovod's process-wide fusion buffer or cycle time.
    assert cfg.horovod_fusion_threshold_bytes is None and cfg.cycle_time_ms is None
    # Open MPI is asked to yield a waiting rank's core (tests/multirank/test_mpi_wait.py shows it does).
    assert cfg.mpi_yield_when_idle is True
    with pytest.raises(AttributeError):
        cfg.compression = "fp16"  # frozen



YIELD = "OMPI_MCA_mpi_yield_when_idle"


@pytest.mark.parametrize(("asked", "exported", "mpi_started", "expected"), [
    (True, None, False, "1"),
    (False, None, False, "0"),
    (None, None, False, None),  # hvrep sets nothing
    (True, "0", False, "0"),  # the user's export wins
    (False, "true", False, "true"),
    (True, None, True, None),  # MPI already runs: setting it now would change nothing, so it is not set
])
def test_mpi_yield_when_idle_reaches_open_mpi_through_the_environment(monkeypatch, asked, exported, mpi_started,
                                                                        expected):
    from hvrep import _env

    for name in (YIELD, "HOROVOD_FUSION_THRESHOLD", "HOROVOD_CYCLE_TIME"):
        monkeypatch.delenv(name, raising=False)
    if exported is not None:
        monkeypatch.setenv(YIELD, exported)
    started = _env.set_horovod_knobs(None, None, asked, mpi_started)
    assert os.environ.get(YIELD) == expected
    assert started == {"HOROVOD_FUSION_THRESHOLD": None, "HOROVOD_CYCLE_TIME": None, YIELD: expected}


@pytest.mark.parametrize("where", ["home", "param_files", "opal_prefix"])
def test_a_site_parameter_file_that_sets_mpi_yield_when_idle_is_not_overridden(monkeypatch, tmp_path, where):
    from hvrep import _env

    for name in (YIELD, "HOROVOD_FUSION_THRESHOLD", "HOROVOD_CYCLE_TIME", *_env.OMPI_MCA_PARAM_FILES_VARS,
                 "OPAL_PREFIX", "OMPI_HOME"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    conf = {"home": tmp_path / "home" / ".openmpi" / "mca-params.conf",
            "param_files": tmp_path / "site.conf",
            "opal_prefix": tmp_path / "ompi" / "etc" / "openmpi-mca-params.conf"}[where]
    conf.parent.mkdir(parents=True, exist_ok=True)
    conf.write_text("# site settings\nbtl_tcp_if_include = eth0\nmpi_yield_when_idle = 0  # spin: dedicated nodes\n")
    if where == "param_files":
        monkeypatch.setenv("OMPI_MCA_mca_base_param_files", f"{tmp_path / 'missing.conf'},{conf}")
    elif where == "opal_prefix":
        monkeypatch.setenv("OPAL_PREFIX", str(tmp_path / "ompi"))
    started = _env.set_horovod_knobs(None, None, True, mpi_started=False)
    # An exported OMPI_MCA_* would beat the site's file: hvrep exports nothing, and reports the file's value.
    assert YIELD not in os.environ
    assert started[YIELD] == "0"
    assert _env.mca_file_setting("mpi_yield_when_idle") == (conf, "0")

    conf.write_text("mpi_yield_when_idle_x = 0\n# mpi_yield_when_idle = 0\n")  # neither sets it
    assert _env.set_horovod_knobs(None, None, True, mpi_started=False)[YIELD] == "1"


@pytest.mark.parametrize(("text", "value"), [
    ("1", True), ("true", True), (" Yes", True), ("0", False), ("false", False), ("no", False), (None, None),
    ("maybe", None),
])
def test_open_mpi_flags_read_as_open_mpi_reads_them(text, value):
    from hvrep import _env

    assert _env.flag_value(text) is value


_AFTER_USERS_INIT = """
import horovod.tensorflow as hvd
import hvrep
from hvrep.errors import ConfigError
from hvrep.replica.backends import horovod as backend

hvd.init()  # the user's own, before any Replicator
try:
    hvrep.Replicator("horovod", config=hvrep.CommConfig(cycle_time_ms=7.5))
except ConfigError as e:
    print("refused:", e)
# hvrep's own re-initialisation (elastic training) passes the private flag: recorded, not refused.
backend._start_horovod(hvd, hvrep.CommConfig(cycle_time_ms=7.5), started_by_hvrep=True)
print("recorded:", backend._started_with["HOROVOD_CYCLE_TIME"])
"""


def test_horovod_settings_after_the_users_own_hvd_init_are_refused_but_not_hvreps_own_restart():
    # One process (Open MPI's singleton); tests/multirank/cases_horovod_core.py does it on 2 ranks per launcher.
    env = {k: v for k, v in os.environ.items() if k not in ("HOROVOD_CYCLE_TIME", "HOROVOD_FUSION_THRESHOLD")}
    res = subprocess.run([sys.executable, "-c", _AFTER_USERS_INIT], capture_output=True, text=True, timeout=300,
                         env={**env, "TF_CPP_MIN_LOG_LEVEL": "3"})
    assert res.returncode == 0, res.stderr[-3000:]
    assert "refused: this Replicator's CommConfig asks for cycle_time_ms=7.5" in res.stdout, res.stdout
    assert "an hvd.init() of your own" in res.stdout and "Fix: create the Replicator before calling hvd.init()" \
        in res.stdout
    assert "recorded: 7.5" in res.stdout, res.stdout
