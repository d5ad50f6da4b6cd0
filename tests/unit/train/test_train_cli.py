"""`hvrep train`, run as users run it: the real CLI on the demo data, 1 and 2 ranks."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import psutil
import pytest
import tensorflow as tf

from hvrep.train.checkpoint import read_metadata
from tests.multirank import harness

BIN = Path(sys.executable).parent
HVREP = str(BIN / "hvrep")


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMPI_", "PMI_", "SLURM_", "HOROVOD_"))}
    env.update(TF_CPP_MIN_LOG_LEVEL="2", OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    return env


def _mpirun(np_: int) -> list[str]:
    return [str(BIN / "mpirun"), "-np", str(np_), *harness.MPIRUN_FLAGS, sys.executable, "-m", "mpi4py", "-m",
            "hvrep.cli"]


def _command(args: list[str], ranks: int) -> list[str]:
    return ([*_mpirun(ranks), "train"] if ranks > 1 else [HVREP, "train"]) + args


def _train(args: list[str], ranks: int = 1, timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run(_command(args, ranks), capture_output=True, text=True, env=_env(), timeout=timeout)


def _train_at_once(runs: list[tuple[list[str], int]], timeout: int = 300) -> list[subprocess.CompletedProcess]:
    """Independent runs (``(args, ranks)`` each, own output folders) at the same time, for the CI clock: much of
    a short run is one process's TensorFlow start-up, which leaves the other core idle."""
    procs = [subprocess.Popen(_command(args, ranks), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env=_env()) for args, ranks in runs]
    try:
        done = []
        for proc in procs:
            stdout, stderr = proc.communicate(timeout=timeout)
            done.append(subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr))
        return done
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def _events(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def _weights(checkpoint: Path) -> dict[str, np.ndarray]:
    reader = tf.train.load_checkpoint(str(checkpoint / "ckpt"))
    return {k: reader.get_tensor(k) for k in reader.get_variable_to_shape_map() if k.startswith("model/")}


def test_two_ranks_write_metrics_and_a_checkpoint_then_resume(demo_data, tmp_path):
    # With 2 micro-batches per update: the checkpoint at step 7 holds one pending micro-batch.
    out = tmp_path / "run"
    common = ["--config", "demo", f"data.data_dir={demo_data}", f"output_dir={out}", "train.log_every=2"]
    res = _train([*common, "train.max_steps=7", "comm.accumulation_steps=2"], ranks=2)
    assert res.returncode == 0, res.stderr[-3000:]
    events = _events(out)
    config = events[0]
    assert config["event"] == "config" and config["replicas"] == 2 and config["backend"] == "horovod"
    assert config["fast_path"]["input"] == "tfdata" and config["optimizer"] == "LARS"
    assert config["fast_path"]["kernels"].startswith("fused (CPU"), config["fast_path"]  # LARS took the fused op
    assert [e["step"] for e in events if e["event"] == "train"] == [2, 4, 6]
    final = events[-1]
    assert final["event"] == "final" and final["stopped"] == "max_steps" and final["step"] == 7
    ckpt = Path(final["checkpoint"])
    assert ckpt.name == "ckpt-00000007"
    meta = read_metadata(ckpt)
    assert {k: meta[k] for k in ("position", "world_size", "global_batch", "segments", "accumulation")} == {
        "position": 7, "world_size": 2, "global_batch": 64, "segments": [[2, 64, 7]],
        "accumulation": {"steps": 2, "micro_step": 7}}, meta
    saved = tf.train.load_checkpoint(str(ckpt / "ckpt"))
    assert saved.get_tensor("accumulation/micro_step/.ATTRIBUTES/VARIABLE_VALUE") == 7
    assert saved.get_tensor("optimizer/_iterations/.ATTRIBUTES/VARIABLE_VALUE") == 3  # updates at 2, 4, 6
    assert res.stdout.count("hvrep train: max_steps at step 7") == 1  # only the chief prints

    res = _train([*common, "--resume", "train.max_steps=10", "comm.accumulation_steps=2"], ranks=2)
    assert res.returncode == 0, res.stderr[-3000:]
    events = _events(out)
    resumed = [e for e in events if e["event"] == "config"][-1]
    assert resumed["resumed_from"] == str(ckpt)
    assert [e["step"] for e in events[events.index(resumed):] if e["event"] == "train"] == [8, 10]
    assert events[-1]["step"] == 10
    ckpt = Path(events[-1]["checkpoint"])
    assert read_metadata(ckpt)["segments"] == [[2, 64, 10]]
    assert tf.train.load_checkpoint(str(ckpt / "ckpt")).get_tensor(
        "optimizer/_iterations/.ATTRIBUTES/VARIABLE_VALUE") == 5

    # On 1 rank, with another global batch and no accumulation (none is pending at step 10): the epoch goes on
    # with the samples it has not trained on, and says so.
    res = _train([*common, "--resume", "train.max_steps=13", "train.global_batch=48"])
    assert res.returncode == 0, res.stderr[-3000:]
    assert "epoch 1 resumes after 640 of its 1437 samples: world size 2 -> 1, global batch 64 -> 48" in res.stdout
    events = _events(out)
    change = [e for e in events if e["event"] == "resume"][-1]
    assert change["replicas"] == [2, 1] and change["global_batch"] == [64, 48] and change["steps"] == 16, change
    meta = read_metadata(Path(events[-1]["checkpoint"]))
    assert meta["segments"] == [[2, 64, 10], [1, 48, 3]] and meta["world_size"] == 1, meta
    # The samples of the epoch so far: each once; 16 steps of 48 were left after 640 samples.
    from hvrep.data import EpochPosition, Segment, epoch_plan
    from hvrep.train import config as configs

    plan = epoch_plan(configs.build("demo", [f"data.data_dir={demo_data}"]).data)
    trained = plan.trained([Segment.from_json(s) for s in meta["segments"]])
    assert len(set(trained.tolist())) == len(trained) == 10 * 64 + 3 * 48
    assert plan.steps(1, 48, EpochPosition((Segment(2, 64, 10),))) == 16 == (1437 - 640) // 48


def test_a_two_rank_checkpoint_resumes_on_one_and_on_two_ranks_with_the_same_samples_in_the_epoch(demo_data,
                                                                                                   tmp_path):
    # Stopped at step 7 of the epoch's 22 on 2 ranks; continued to the epoch's end on 2 ranks and, from a copy of
    # the same checkpoint, on 1 rank (a requeue onto fewer nodes): the global batch stays 64 (32 -> 64 per rank).
    two, one = tmp_path / "two", tmp_path / "one"
    common = ["--config", "demo", f"data.data_dir={demo_data}", "train.log_every=5"]
    res = _train([*common, f"output_dir={two}", "train.max_steps=7"], ranks=2)
    assert res.returncode == 0, res.stderr[-3000:]
    import shutil

    shutil.copytree(two, one)
    for res in _train_at_once([([*common, f"output_dir={out}", "train.max_steps=22", "--resume"], ranks)
                               for out, ranks in ((two, 2), (one, 1))]):
        assert res.returncode == 0, res.stderr[-3000:]
    from hvrep.data import Segment, epoch_plan
    from hvrep.train import config as configs

    plan = epoch_plan(configs.build("demo", [f"data.data_dir={demo_data}"]).data)
    trained = {}
    for out, ranks in ((two, 2), (one, 1)):
        meta = read_metadata(Path(_events(out)[-1]["checkpoint"]))
        assert meta["step"] == 22 and meta["segments"] == ([[2, 64, 22]] if ranks == 2 else
                                                           [[2, 64, 7], [1, 64, 15]]), meta
        ids = plan.trained([Segment.from_json(s) for s in meta["segments"]])
        assert len(set(ids.tolist())) == len(ids) == 22 * 64, ranks  # no sample twice
        assert ids[:7 * 64].tolist() == plan.trained([Segment(2, 64, 7)]).tolist()  # the checkpoint's 7 steps
        trained[ranks] = set(ids.tolist())
    # Both finish the epoch with every sample once but the remainder no global batch can fill: 1437 - 22 * 64 = 29
    # samples, < 64, and the same 29 (the plan deals the first segment's remainder last: hvrep/data/plan.py).
    left_out = {r: set(range(plan.num_samples)) - t for r, t in trained.items()}
    assert left_out[1] == left_out[2] == set(plan.left_out(2, 64).tolist()) and len(left_out[1]) == 29, left_out


def test_stopped_and_resumed_run_ends_with_the_same_weights(demo_data, tmp_path):
    # 30 steps cross the epoch boundary (22 steps) and an evaluation; the stop at 12 is mid-epoch.
    common = ["--config", "demo", f"data.data_dir={demo_data}", "train.epochs=3"]
    straight, split = tmp_path / "straight", tmp_path / "split"
    for res in _train_at_once([([*common, f"output_dir={straight}", "train.max_steps=30"], 1),
                               ([*common, f"output_dir={split}", "train.max_steps=12"], 1)]):
        assert res.returncode == 0, res.stderr[-3000:]
    res = _train([*common, f"output_dir={split}", "train.max_steps=30", "--resume"])
    assert res.returncode == 0, res.stderr[-3000:]
    a = _weights(straight / "checkpoints" / "ckpt-00000030")
    b = _weights(split / "checkpoints" / "ckpt-00000030")
    assert a.keys() == b.keys() and len(a) > 10
    for k in a:
        np.testing.assert_array_equal(a[k], b[k], err_msg=k)


def test_a_signal_to_one_rank_stops_every_rank_cleanly_with_a_checkpoint(demo_data, tmp_path):
    out = tmp_path / "preempted"
    cmd = [*_mpirun(2), "train", "--config", "demo", f"data.data_dir={demo_data}", f"output_dir={out}",
           "train.log_every=1", "train.epochs=50"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env())
    try:
        deadline = time.time() + 240
        while time.time() < deadline:
            if (out / "metrics.jsonl").is_file() and any(e["event"] == "train" for e in _events(out)):
                break
            time.sleep(0.5)
        else:
            pytest.fail("training never started")
        ranks = [p for p in psutil.Process(proc.pid).children(recursive=True) if "hvrep.cli" in " ".join(p.cmdline())]
        assert len(ranks) == 2, ranks
        ranks[-1].send_signal(signal.SIGUSR1)  # one rank only, as mpirun may deliver it
        stdout, stderr = proc.communicate(timeout=180)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, stderr[-3000:]
    final = _events(out)[-1]
    assert final["stopped"] == "signal" and final["epoch"] < 50
    assert Path(final["checkpoint"]).name == f"ckpt-{final['step']:08d}"
    assert "hvrep train: signal at step" in stdout


def test_config_typo_names_the_key_and_the_choices(tmp_path):
    res = _train(["--config", "demo", "train.global_bach=128"])
    assert res.returncode == 2 and "train has no setting 'global_bach'" in res.stderr and "global_batch" in res.stderr
    res = _train(["--config", "demo", "train.precision=fp8"])
    assert res.returncode == 2 and "('fp32', 'fp16', 'bf16')" in res.stderr
    res = _train(["--config", "nope"])
    assert res.returncode == 2 and "'nope'" in res.stderr


def test_print_config_resolves_presets_and_overrides():
    res = _train(["--config", "resnet50_imagenet", "--print-config", "train.global_batch=4096",
                  "comm.compression=fp16"])
    assert res.returncode == 0, res.stderr
    cfg = json.loads(res.stdout)
    assert cfg["train"]["global_batch"] == 4096 and cfg["comm"]["compression"] == "fp16"
    assert cfg["model"]["name"] == "resnet50" and cfg["data"]["backend"] == "dali"


@pytest.mark.parametrize("options", [
    ["train.precision=fp16", "train.jit_compile=true", "data.backend=dali"],
    ["train.precision=bf16", "comm.compression=fp16", "comm.fusion_threshold_bytes=0"],
], ids=["fp16-xla-dali", "bf16-fp16compression-unfused"])
def test_fast_path_options_run_and_are_recorded(demo_data, tmp_path, options):
    out = tmp_path / "fast"
    res = _train(["--config", "demo", f"data.data_dir={demo_data}", f"output_dir={out}", "train.max_steps=3",
                  "train.log_every=1", *options])
    assert res.returncode == 0, res.stderr[-3000:]
    events = _events(out)
    fast = events[0]["fast_path"]
    for option in options:
        key, value = option.split("=")
        field = {"data.backend": "input"}.get(key, key.split(".")[1])
        assert str(fast[field]).lower() == value, (field, fast)
    assert all(np.isfinite(e["loss"]) for e in events if e["event"] == "train")


def test_threads_caps_tensorflows_pools(demo_data, tmp_path):
    out = tmp_path / "threads"
    probe = ("import sys, tensorflow as tf; from hvrep.train import config, main; "
             f"main.run(config.build('demo', ['data.data_dir={demo_data}', 'output_dir={out}', 'train.max_steps=2', "
             "'train.threads=1'])); t = tf.config.threading; "
             "print('POOLS', t.get_intra_op_parallelism_threads(), t.get_inter_op_parallelism_threads())")
    res = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=_env(), timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "POOLS 1 1" in res.stdout, res.stdout[-2000:]
    assert _events(out)[0]["env"]["threads"] == 1


def test_threads_must_be_positive(tmp_path):
    res = _train(["--config", "demo", "train.threads=0", "--print-config"])
    assert res.returncode == 2 and "train.threads must be an integer >= 1, got 0" in res.stderr
