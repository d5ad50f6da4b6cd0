"""An elastic `hvrep train` refuses a global batch that some world size in [min_np, max_np] does not divide."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from hvrep.errors import ConfigError
from hvrep.train.config import ElasticConfig


def test_a_world_size_that_does_not_divide_the_global_batch_is_named_with_the_fix():
    with pytest.raises(ConfigError) as e:
        ElasticConfig(min_np=3, max_np=4).check_batch(64)
    msg = str(e.value)
    assert "train.global_batch=64 does not divide by world size(s) [3]" in msg, msg
    assert "elastic.min_np=3..elastic.max_np=4" in msg and "Fix: train.global_batch=60 (a multiple of 12)" in msg
    ElasticConfig(min_np=1, max_np=4).check_batch(48)  # 1, 2, 3, 4 all divide 48


def test_min_np_above_max_np_and_missing_sizes_are_refused():
    with pytest.raises(ConfigError, match=re.escape("elastic.min_np=3 is above elastic.max_np=2")):
        ElasticConfig(min_np=3, max_np=2)
    with pytest.raises(ConfigError, match=re.escape("Fix: add elastic.min_np=A elastic.max_np=B")):
        ElasticConfig().check_batch(64)


def test_hvrep_train_under_the_elastic_driver_refuses_the_start(tmp_path):
    # HOROVOD_ELASTIC=1 is what horovodrun's elastic driver sets in its workers; the check runs before TensorFlow.
    from hvrep.data import write_demo

    write_demo(tmp_path / "demo")
    env = {**os.environ, "HOROVOD_ELASTIC": "1", "TF_CPP_MIN_LOG_LEVEL": "3"}
    res = subprocess.run([sys.executable, "-m", "hvrep.cli", "train", "--config", "demo",
                          f"data.data_dir={tmp_path / 'demo' / 'tfrecord'}", f"output_dir={tmp_path / 'run'}",
                          "elastic.min_np=3", "elastic.max_np=4"], capture_output=True, text=True, env=env,
                         timeout=120)
    assert res.returncode == 2, res.stderr[-2000:]
    assert "train.global_batch=64 does not divide by world size(s) [3]" in res.stderr, res.stderr[-2000:]


def test_elastic_settings_outside_the_driver_are_one_warning_with_what_the_driver_would_refuse(tmp_path):
    # Under mpirun, not elastic: the first rank warns once, before TensorFlow (the missing data folder then ends
    # the run); the batch check the driver would make is in the warning. One rank: with two, the other rank's
    # error could end the job (mpirun stops every rank at the first non-zero exit) before rank 0 wrote its line.
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMPI_", "PMI_", "HOROVOD_"))}
    env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1", TF_CPP_MIN_LOG_LEVEL="3")
    mpirun = [str(Path(sys.executable).parent / "mpirun"), "-np", "1", "--oversubscribe", "--bind-to", "none"]
    train = [sys.executable, "-m", "hvrep.cli", "train", "--config", "demo", f"data.data_dir={tmp_path / 'missing'}",
             f"output_dir={tmp_path / 'run'}", "elastic.min_np=2", "elastic.max_np=4"]
    res = subprocess.run([*mpirun, *train], capture_output=True, text=True, env=env, timeout=120)
    warnings = [line for line in res.stderr.splitlines() if line.startswith("hvrep train: warning:")]
    assert len(warnings) == 1, res.stderr[-3000:]
    assert "elastic.min_np=2 elastic.max_np=4: elastic settings apply only under horovodrun's elastic driver" in \
        warnings[0] and "train.global_batch=64 does not divide by world size(s) [3]" in warnings[0], warnings[0]
    # Rank 1 of 2 (Open MPI's variables, as mpirun sets them) says nothing: one warning per job, not per rank.
    rank1 = dict(env, OMPI_COMM_WORLD_RANK="1", OMPI_COMM_WORLD_SIZE="2", OMPI_COMM_WORLD_LOCAL_RANK="1",
                 OMPI_COMM_WORLD_LOCAL_SIZE="2")
    res = subprocess.run(train, capture_output=True, text=True, env=rank1, timeout=120)
    assert "is not a folder" in res.stderr and "warning" not in res.stderr, res.stderr[-3000:]
    res = subprocess.run([sys.executable, "-m", "hvrep.cli", "train", "--config", "demo",
                          f"data.data_dir={tmp_path / 'missing'}"], capture_output=True, text=True, env=env,
                         timeout=120)
    assert "warning" not in res.stderr, res.stderr  # no elastic settings: nothing to say
