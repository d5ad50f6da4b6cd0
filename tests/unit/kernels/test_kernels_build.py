"""kernels/build.py and what it leaves behind: the libraries, the CUDA harness, the fallbacks."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from hvrep import kernels
from hvrep.cluster import doctor
from hvrep.models import resnet50_variable_shapes

ROOT = Path(__file__).resolve().parents[3]
BUILD = ROOT / "kernels" / "build.py"
SHAPES_FILE = ROOT / "kernels" / "harness" / "resnet50_shapes.txt"
NVCC = shutil.which("nvcc") or (Path("/usr/local/cuda/bin/nvcc").exists() and "/usr/local/cuda/bin/nvcc")


def _record() -> dict:
    return json.loads((kernels.LIB_DIR / "build.json").read_text())


def _run(args, env_extra=None, timeout=600):
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3", **(env_extra or {})}
    return subprocess.run(args, capture_output=True, text=True, env=env, timeout=timeout, cwd=ROOT)


def test_the_harness_shapes_file_is_resnet50():
    rows = [line.split() for line in SHAPES_FILE.read_text().splitlines() if line and not line.startswith("#")]
    assert [(r[0], tuple(int(d) for d in r[1:])) for r in rows] == resnet50_variable_shapes()


def test_setup_built_the_cpu_ops_for_this_tensorflow():
    import tensorflow as tf

    assert shutil.which("g++"), "CI has a C++ compiler; without one this test has nothing to check"
    record = _record()
    assert record["cpu"]["built"], record["cpu"].get("reason")
    assert record["tensorflow"] == kernels.tf_identity() == tf.__version__  # the CPU wheel: no "+cuda"
    assert (kernels.LIB_DIR / record["cpu"]["library"]).exists()
    assert doctor.collect()["kernels"]["path"].startswith("fused (CPU")


@pytest.mark.skipif(not NVCC, reason="no nvcc on this machine: the CUDA kernels are not compiled here")
def test_setup_compiled_the_cuda_kernels_and_they_link_into_this_tensorflow():
    record = _record()
    assert record["cuda"]["built"], record["cuda"].get("reason")
    # The GPU library loads (every symbol resolves) even into CPU-only TensorFlow;
    # hvrep loads it only where TF sees a GPU.
    code = ("import tensorflow as tf\nfrom hvrep import kernels\nfrom hvrep.kernels import loader\n"
            f"tf.load_op_library({str(kernels.LIB_DIR / 'libhvrep_ops.so')!r})\n"
            f"tf.load_op_library({str(kernels.LIB_DIR / 'libhvrep_ops_cuda.so')!r})\n"
            f"print('loaded', *loader._cuda_versions(kernels.LIB_DIR / 'libhvrep_ops_cuda.so'))\n")
    res = _run([sys.executable, "-c", code])
    assert res.returncode == 0 and "loaded" in res.stdout, res.stderr[-2000:]
    # The probe answers without a GPU: the runtime it was linked with, and the driver (0: none here).
    _, driver, runtime = res.stdout.split()[-3:]
    assert int(runtime) >= 12000 and int(driver) >= 0
    assert record["cuda"]["min_compute_capability"] == [7, 5]


def test_gpu_problem_names_an_old_driver_an_old_gpu_or_no_driver():
    assert kernels.gpu_problem(13000, 13000, [(9, 0), (8, 6)]) is None
    assert kernels.gpu_problem(0, 13000, [(9, 0)]) == "no NVIDIA driver is installed"
    old_driver = kernels.gpu_problem(12040, 13000, [(9, 0)])
    assert "supports CUDA 12.4, older than the CUDA 13.0 runtime" in old_driver and "update the driver" in old_driver
    assert "compute capability 7.0 is older than the kernels' minimum 7.5" in kernels.gpu_problem(
        13000, 13000, [(9, 0), (7, 0)])


@pytest.mark.skipif(not NVCC, reason="no nvcc on this machine: the harness is not built here")
def test_the_cuda_harness_runs_its_cpu_side_and_says_whether_a_gpu_was_there(tmp_path):
    harness = kernels.LIB_DIR / _record()["cuda"]["harness"]
    out = tmp_path / "h.json"
    res = _run([str(harness), "--shapes", str(SHAPES_FILE), "--out", str(out)])
    result = json.loads(out.read_text())
    checks = result["checks"]
    assert checks and all(c["pass"] for c in checks), [c for c in checks if not c["pass"]]
    if res.returncode == 3:  # no GPU (CI): the CPU reference and the argument checks ran
        assert "no CUDA device" in res.stdout + res.stderr
        assert any("CPU LARS" in c["name"] for c in checks)
    else:
        assert res.returncode == 0, (res.stdout + res.stderr)[-3000:]
        assert result["timings"], result


def test_a_failed_build_leaves_the_reference_path_and_says_why(tmp_path):
    out = tmp_path / "lib"
    env = {"CXX": "/bin/false", "HVREP_CACHE_DIR": str(tmp_path / "cache")}
    res = _run([sys.executable, str(BUILD), "--no-cuda", "--out", str(out)], env)
    assert res.returncode == 0, res.stdout + res.stderr
    record = json.loads((out / "build.json").read_text())
    assert not record["cpu"]["built"] and "failed" in record["cpu"]["reason"]
    # The same inputs again come from the cache; --strict turns the failure into an exit code.
    res = _run([sys.executable, str(BUILD), "--no-cuda", "--out", str(out), "--strict"], env)
    assert res.returncode == 1 and "cached" in res.stdout, res.stdout + res.stderr
    code = ("from hvrep import kernels; from hvrep.optimizers import LARS; import keras\n"
            "print(kernels.status().describe())\n"
            "v = keras.Variable([1.0, 2.0], name='w'); opt = LARS(0.1, exclude_from_weight_decay=[])\n"
            "opt.apply_gradients([(keras.ops.ones(2), v)]); print('step ok', v.numpy().tolist())\n")
    res = _run([sys.executable, "-c", code], {"HVREP_KERNELS_DIR": str(out)})
    assert res.returncode == 0, res.stderr[-2000:]
    assert "reference (pure TF): the build failed: compiling kernels/src/cpu.cc failed" in res.stdout
    assert "step ok" in res.stdout


def test_a_library_built_for_another_tensorflow_is_never_loaded(tmp_path):
    lib = tmp_path / "lib"
    shutil.copytree(kernels.LIB_DIR, lib)
    record = json.loads((lib / "build.json").read_text())
    record["tensorflow"] = "2.0.0"
    (lib / "build.json").write_text(json.dumps(record))
    res = _run([sys.executable, "-c", "from hvrep import kernels; print(kernels.status().describe())"],
               {"HVREP_KERNELS_DIR": str(lib)})
    assert res.returncode == 0, res.stderr[-2000:]
    assert "built for TensorFlow 2.0.0" in res.stdout and "rebuild" in res.stdout
    res = _run([sys.executable, "-c", "from hvrep import kernels; print(kernels.status().describe())"],
               {"HVREP_KERNELS_DIR": str(tmp_path / "nothing")})
    assert "not built" in res.stdout and "make setup" in res.stdout
