"""``make check-gpu-build``: proves the GPU builds compile, link and import: Horovod's and hvrep's kernels.

No GPU is needed: in a throwaway virtual environment with the GPU-capable
``tensorflow[and-cuda]`` wheel, Horovod is built with
``HOROVOD_GPU_OPERATIONS=NCCL`` (nvcc, NCCL from its wheel, the GPU compat
header and the stream shim), then imported through hvrep and used for CPU
all-reduces on 1 and 2 ranks. hvrep's kernels (kernels/build.py) are then
built against that CUDA TensorFlow, their GPU library is loaded into it, and
the fused ops are checked against their references on the CPU. Whether NCCL
all-reduces and the CUDA kernels run on GPUs can only be checked on a GPU
machine; this check says so in its result.

The result is written as JSON to ``~/.cache/hvrep/gpu-build-check/result.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path

from hvrep import _env

_ROOT = Path(__file__).resolve().parents[2]

_SMOKE = r"""
import json, os, sys
import hvrep
from hvrep import compat
import tensorflow as tf
hvd = compat.import_horovod()
hvd.init()
x = tf.constant([float(hvd.rank() + 1)] * 4)
s = hvd.allreduce(x, op=hvd.Sum, name="gpu_check").numpy().tolist()
if hvd.rank() == 0:
    print("SMOKE " + json.dumps({
        "size": hvd.size(), "nccl_built": bool(hvd.nccl_built()), "cuda_built": bool(hvd.cuda_built()),
        "mpi_built": bool(hvd.mpi_built()), "gloo_built": bool(hvd.gloo_built()),
        "stream_shim_loaded": compat.load_runtime_shim(), "allreduce_sum": s,
        "tf": tf.__version__, "tf_built_with_cuda": tf.test.is_built_with_cuda(),
    }))
"""


# hvrep's kernels in the CUDA TensorFlow: the GPU library must load (every
# symbol resolves against this libtensorflow_framework), and the ops agree
# with their references (on the CPU: there is no GPU here).
_KERNELS_SMOKE = r"""
import json
import numpy as np, tensorflow as tf
from hvrep import kernels
st = kernels.status()
tf.load_op_library(str(kernels.LIB_DIR / kernels.CUDA_LIB))
xs = [tf.constant(np.random.default_rng(0).normal(size=s).astype(np.float32)) for s in [(3, 3, 64, 64), (64,), (1000,)]]
pack_ok = bool(np.array_equal(kernels.pack(xs, tf.float16, 0.125, use_kernel=True).numpy(),
                              kernels.reference_pack(xs, tf.float16, 0.125).numpy()))
ws = [[tf.Variable(x) for x in xs] for _ in range(2)]
vs = [[tf.Variable(tf.zeros_like(x)) for x in xs] for _ in range(2)]
args = dict(momentum=0.9, weight_decay=1e-4, eta=0.001, decay=[True, False, True], adapt=[True, False, True])
kernels.fused_lars_apply(ws[0], vs[0], xs, 0.1, use_kernel=True, **args)
kernels.reference_lars_apply(ws[1], vs[1], xs, 0.1, **args)
lars_err = max(float(np.linalg.norm(a.numpy() - b.numpy()) / np.linalg.norm(b.numpy())) for a, b in zip(*ws))
print("KERNELS " + json.dumps({"path": st.describe(), "build": st.build.get("key"), "tensorflow": kernels.tf_identity(),
                               "cuda_built": bool(st.build.get("cuda", {}).get("built")), "cuda_library_loads": True,
                               "pack_equals_reference": pack_ok, "lars_max_rel_err": lars_err}))
"""


def _kernels(python: Path, out: Path, log) -> dict:
    _run([str(python), str(_ROOT / "kernels" / "build.py"), "--out", str(out), "--strict"], log)
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2", _env.HVREP_KERNELS_DIR: str(out)}
    res = subprocess.run([str(python), "-c", _KERNELS_SMOKE], capture_output=True, text=True, env=env, timeout=300)
    log.write(res.stdout + res.stderr)
    lines = [ln for ln in res.stdout.splitlines() if ln.startswith("KERNELS ")]
    if res.returncode != 0 or not lines:
        raise RuntimeError(f"hvrep's kernels in the CUDA TensorFlow failed (exit {res.returncode}):\n"
                           f"{res.stderr[-3000:]}")
    return json.loads(lines[0][len("KERNELS "):])


def _run(cmd: list[str], log, **kw) -> None:
    log.write(f"$ {' '.join(cmd)}\n")
    log.flush()
    subprocess.run(cmd, check=True, stdout=log, stderr=subprocess.STDOUT, **kw)


def _smoke(python: Path, np: int, log) -> dict:
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2", "OMPI_ALLOW_RUN_AS_ROOT": "1",
           "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}
    cmd = [str(python), "-c", _SMOKE]
    if np > 1:
        cmd = [str(python.parent / "mpirun"), "-np", str(np), "--oversubscribe", str(python), "-m", "mpi4py",
               "-c", _SMOKE]
    res = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    log.write(res.stdout + res.stderr)
    lines = [ln for ln in res.stdout.splitlines() if ln.startswith("SMOKE ")]
    if res.returncode != 0 or not lines:
        raise RuntimeError(f"smoke test on {np} rank(s) failed (exit {res.returncode}):\n{res.stderr[-3000:]}")
    return json.loads(lines[0][len("SMOKE "):])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--keep", action="store_true", help="keep the throwaway environment")
    args = parser.parse_args(argv)

    base = _env.cache_dir() / "gpu-build-check"
    venv = base / "venv"
    base.mkdir(parents=True, exist_ok=True)
    logfile = base / "check.log"
    result: dict = {"started": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "machine": platform.platform(),
                    "nvcc": shutil.which("nvcc"), "log": str(logfile)}
    t0 = time.monotonic()
    try:
        with open(logfile, "w") as log:
            if shutil.which("nvcc") is None:
                raise RuntimeError("nvcc is not on PATH: install the CUDA toolkit to check the GPU build")
            shutil.rmtree(venv, ignore_errors=True)
            _run([sys.executable, "-m", "venv", str(venv)], log)
            py = venv / "bin" / "python"
            reqs = base / "requirements-gpu.txt"
            reqs.write_text((_ROOT / "requirements.txt").read_text().replace(
                "tensorflow-cpu==", "tensorflow[and-cuda]=="))
            _run([str(py), "-m", "pip", "install", "-q", "--upgrade", "pip"], log)
            _run([str(py), "-m", "pip", "install", "-q", "-r", str(reqs)], log)
            _run([str(py), "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "-e",
                  str(_ROOT)], log)
            t_build = time.monotonic()
            _run([str(py), "-m", "hvrep.compat.build_horovod", "--gpu", "on"], log)
            result["build_seconds"] = round(time.monotonic() - t_build)
            result["smoke_1_rank"] = _smoke(py, 1, log)
            result["smoke_2_ranks"] = _smoke(py, 2, log)
            t_kernels = time.monotonic()
            result["kernels"] = _kernels(py, base / "kernels", log)
            result["kernels"]["seconds"] = round(time.monotonic() - t_kernels)
        ok = all(result[k]["nccl_built"] and result[k]["stream_shim_loaded"]
                 for k in ("smoke_1_rank", "smoke_2_ranks"))
        ok = ok and result["smoke_2_ranks"]["allreduce_sum"] == [3.0] * 4
        k = result["kernels"]
        ok = ok and k["cuda_built"] and k["cuda_library_loads"] and k["pack_equals_reference"]
        ok = ok and k["lars_max_rel_err"] <= 1e-6 and k["tensorflow"].endswith("+cuda")
        result["status"] = "passed" if ok else "failed"
    except (RuntimeError, subprocess.CalledProcessError, subprocess.TimeoutExpired) as e:
        result["status"] = "failed"
        result["error"] = str(e)[-3000:]
        ok = False
    result["not_checked_here"] = "NCCL all-reduce and hvrep's CUDA kernels on a GPU (no GPU on this machine)"
    result["total_seconds"] = round(time.monotonic() - t0)
    if not args.keep:
        shutil.rmtree(venv, ignore_errors=True)
        shutil.rmtree(base / "kernels", ignore_errors=True)
    (base / "result.json").write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    if not ok:
        print(f"GPU build check FAILED; log: {logfile}", file=sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
