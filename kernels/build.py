"""Builds hvrep's kernels: the TF op libraries and the standalone CUDA harness.

    python kernels/build.py [--out DIR] [--no-cuda] [--strict] [--force]
    python kernels/build.py --harness-only [--out DIR]      # no TensorFlow needed

Products (in ``--out``, default ``$HVREP_KERNELS_DIR`` or ``hvrep/_lib``, where
``hvrep.kernels`` looks):
  libhvrep_ops.so       op definitions + CPU kernels, compiled with TensorFlow's
                        own flags (``tf.sysconfig``) against the installed TF
  libhvrep_ops_cuda.so  GPU kernels (where nvcc is found)
  hvrep_harness         the CUDA harness, plain CUDA C++ (where nvcc is found)
  build.json            what was built, for which TensorFlow, and why not

A failed or impossible build is not an error (exit 0, unless ``--strict``):
``build.json`` records the reason, and hvrep runs its pure-TF reference path,
which ``hvrep doctor`` reports. Builds are cached under hvrep's cache folder
(``$HVREP_CACHE_DIR`` or ``~/.cache/hvrep``), keyed by a hash of the sources,
the compilers, TensorFlow's version and flags, and the machine architecture.
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import importlib.util
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
DEFAULT_OUT = ROOT / "hvrep" / "_lib"
SOURCES = sorted(p for p in HERE.rglob("*") if p.suffix in {".h", ".cc", ".cu", ".cuh", ".py", ".txt"} and p.is_file())

CPU_LIB = "libhvrep_ops.so"
CUDA_LIB = "libhvrep_ops_cuda.so"
HARNESS = "hvrep_harness"

# -ffp-contract=off: round after every multiply and add, as TensorFlow's own
# element-wise kernels do, so fused and per-variable results agree bit for bit
# wherever the order of operations is the same. x86-64-v2 (SSE4.2), not
# -march=native: clusters build on a login node and run on compute nodes of
# another CPU model from the same shared venv, and an AVX-512 library there
# dies with SIGILL. It costs nothing measurable: the loops are memory-bound
# (the CPU LARS step over ResNet-50 took 20.2 ms with -march=native on an
# AVX-512 EPYC and 20.0 ms with x86-64-v2, median of 25, one thread).
CXXFLAGS = ["-std=c++17", "-O3", "-fPIC", "-ffp-contract=off", "-Wall", "-Wextra",
            *(["-march=x86-64-v2"] if platform.machine() in ("x86_64", "AMD64") else [])]
# The TF wrapper: TF's headers use deprecated names of their own; silence only that.
TF_CXXFLAGS = ["-O2", "-fPIC", "-Wno-deprecated-declarations", "-Wno-interference-size"]
# sm_75 (T4), sm_80 (A100; also runs on the other 8.x parts) and sm_90 (H100/H200)
# as machine code, and compute_90 PTX that the driver JIT-compiles for newer
# GPUs. nvcc 13 no longer targets anything older than sm_75, so hvrep.kernels
# uses the CUDA kernels only on GPUs of compute capability >= MIN_COMPUTE_CAPABILITY.
NVCC_ARCH = ["-gencode", "arch=compute_75,code=sm_75", "-gencode", "arch=compute_80,code=sm_80",
             "-gencode", "arch=compute_90,code=sm_90", "-gencode", "arch=compute_90,code=compute_90"]
MIN_COMPUTE_CAPABILITY = (7, 5)
CUDA_SOURCES = ("lars", "pack", "probe")  # kernels/src/<name>.cu
NVCCFLAGS = ["-std=c++17", "-O3", "-Xcompiler", "-fPIC", "-Xcompiler", "-ffp-contract=off", *NVCC_ARCH]


def _log(msg: str) -> None:
    print(f"[build_kernels] {msg}", flush=True)


def _env_module():
    # hvrep/_env.py names every environment variable hvrep reads; load it by
    # path, because `import hvrep` imports TensorFlow, which --harness-only
    # must not need.
    # It imports hvrep.errors (standard library only), so the repository must be importable: on a GPU
    # machine with no hvrep installed, `python kernels/build.py --harness-only` runs from a bare checkout.
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    spec = importlib.util.spec_from_file_location("_hvrep_env", ROOT / "hvrep" / "_env.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _version(cmd: list[str], line: int = 0) -> str | None:
    """One line of a tool's --version output (g++: the first; nvcc: the last)."""
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return None
    lines = (out.stdout or out.stderr).strip().splitlines()
    return lines[line] if out.returncode == 0 and lines else None


def find_nvcc(cuda_home: str | None) -> str | None:
    for cand in ([str(Path(cuda_home) / "bin" / "nvcc")] if cuda_home else []) + [
            shutil.which("nvcc") or "", "/usr/local/cuda/bin/nvcc"]:
        if cand and Path(cand).is_file() and os.access(cand, os.X_OK):
            return cand
    return None


def cuda_lib_dir(nvcc: str) -> Path:
    # nvcc may be a wrapper script (it is on this project's CI machine), so the
    # toolkit is found from the real path of nvcc's folder, then the usual place.
    for home in (Path(os.path.realpath(nvcc)).parent.parent, Path("/usr/local/cuda")):
        for sub in ("lib64", "lib", "targets/x86_64-linux/lib", "targets/sbsa-linux/lib"):
            if (home / sub / "libcudart_static.a").exists():
                return home / sub
    return Path(os.path.realpath(nvcc)).parent.parent / "lib64"


def build_key(tf_version: str, tf_flags: list[str], cxx_version: str, nvcc_version: str | None) -> str:
    h = hashlib.sha256()
    for p in SOURCES:
        h.update(str(p.relative_to(HERE)).encode())
        h.update(p.read_bytes())
    # Include and library paths name this venv; leaving them out lets another
    # clone or venv with the same TensorFlow reuse the build.
    flags = [f for f in tf_flags if not f.startswith(("-I", "-L"))]
    for part in (tf_version, " ".join(flags), cxx_version, nvcc_version or "no-nvcc", platform.machine(),
                 " ".join(CXXFLAGS + TF_CXXFLAGS + NVCCFLAGS)):
        h.update(b"\0" + str(part).encode())
    return f"tf{tf_version}-{'cuda' if nvcc_version else 'cpu'}-{h.hexdigest()[:16]}"


class _Builder:
    def __init__(self, work: Path, log: Path) -> None:
        self.work = work
        self.log = log

    def run(self, what: str, cmd: list[str]) -> None:
        with self.log.open("a") as f:
            f.write(f"\n$ {' '.join(cmd)}\n")
            f.flush()
            res = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=self.work)
        if res.returncode != 0:
            tail = self.log.read_text().splitlines()[-15:]
            raise RuntimeError(f"{what} failed (exit {res.returncode}); last lines of {self.log}:\n" + "\n".join(tail))


def _build_harness(b: _Builder, nvcc: str, cuda_objs: list[str] | None = None) -> Path:
    """The harness links the CUDA kernels and kernels/src/cpu.cc, its CPU reference."""
    inc = ["-I", str(HERE / "include")]
    out = b.work / HARNESS
    kernels = cuda_objs or [str(HERE / "src" / f"{name}.cu") for name in CUDA_SOURCES]
    b.run("compiling the CUDA harness", [nvcc, *NVCCFLAGS, *inc, "-o", str(out), str(HERE / "harness" / "harness.cu"),
                                          *kernels, str(HERE / "src" / "cpu.cc")])
    return out


def build(work: Path, *, tf_flags: tuple[list[str], list[str]] | None, cxx: str, nvcc: str | None,
          log: Path, no_cuda_reason: str) -> dict:
    """Builds into ``work``; returns the build record. Never raises for a compiler failure."""
    b = _Builder(work, log)
    inc = ["-I", str(HERE / "include")]
    record: dict = {"cpu": {"built": False}, "cuda": {"built": False}}
    cpu_obj = work / "cpu.o"
    if tf_flags is not None:
        cflags, lflags = tf_flags
        try:
            b.run("compiling kernels/src/cpu.cc", [cxx, *CXXFLAGS, *inc, "-c", str(HERE / "src" / "cpu.cc"),
                                                   "-o", str(cpu_obj)])
            b.run("linking the TF op library", [cxx, "-shared", *TF_CXXFLAGS, *cflags, *inc,
                                                str(HERE / "tf" / "ops.cc"), str(HERE / "tf" / "watch.cc"),
                                                str(HERE / "tf" / "shm.cc"),
                                                str(cpu_obj), "-o",
                                                str(work / CPU_LIB), *lflags])
            record["cpu"] = {"built": True, "library": CPU_LIB}
        except RuntimeError as e:
            record["cpu"] = {"built": False, "reason": str(e)}
    if nvcc is None:
        record["cuda"] = {"built": False, "reason": no_cuda_reason}
        return record
    try:
        objs = []
        for name in CUDA_SOURCES:
            obj = work / f"{name}.cu.o"
            b.run(f"compiling kernels/src/{name}.cu", [nvcc, *NVCCFLAGS, *inc, "-c", str(HERE / "src" / f"{name}.cu"),
                                                      "-o", str(obj)])
            objs.append(str(obj))
        record["cuda"] = {"built": False, "objects": True}
        record["cuda"]["harness"] = _build_harness(b, nvcc, objs).name
        if tf_flags is not None and record["cpu"]["built"]:
            cflags, lflags = tf_flags
            b.run("linking the TF GPU op library", [
                cxx, "-shared", *TF_CXXFLAGS, *cflags, *inc, str(HERE / "tf" / "gpu_kernels.cc"), *objs,
                str(cpu_obj), "-o", str(work / CUDA_LIB), *lflags,
                # cudart linked statically: the library then needs only the driver (libcuda), as TF does.
                "-L", str(cuda_lib_dir(nvcc)), "-l:libcudart_static.a", "-ldl", "-lrt", "-lpthread"])
            record["cuda"].update(built=True, library=CUDA_LIB, min_compute_capability=list(MIN_COMPUTE_CAPABILITY))
        elif tf_flags is not None:
            record["cuda"]["reason"] = "the CPU op library failed, and the GPU kernels need its op definitions"
    except RuntimeError as e:
        record["cuda"] = {"built": False, "reason": str(e)}
    return record


def _tf_flags() -> tuple[str, tuple[list[str], list[str]]]:
    """(the TensorFlow build's identity, (compile flags, link flags))."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import tensorflow as tf

    from hvrep.kernels import tf_identity

    return tf_identity(), (list(tf.sysconfig.get_compile_flags()), list(tf.sysconfig.get_link_flags()))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=None,
                   help="where the products go (default: $HVREP_KERNELS_DIR, else hvrep/_lib)")
    p.add_argument("--no-cuda", action="store_true", help="do not build the CUDA kernels even if nvcc is found")
    p.add_argument("--harness-only", action="store_true", help="build only the CUDA harness (no TensorFlow needed)")
    p.add_argument("--strict", action="store_true", help="exit 1 if anything that could be built was not")
    p.add_argument("--force", action="store_true", help="rebuild even if the cache has this build")
    args = p.parse_args(argv)
    env = _env_module()
    args.out = args.out or env.kernels_dir(DEFAULT_OUT)
    cxx = os.environ.get("CXX") or shutil.which("g++") or "g++"
    nvcc = None if args.no_cuda else find_nvcc(env.cuda_home())
    args.out.mkdir(parents=True, exist_ok=True)

    if args.harness_only:
        if nvcc is None:
            _log("nvcc not found: set CUDA_HOME or put nvcc on PATH")
            return 1
        log = args.out / "harness-build.log"
        log.write_text("")
        try:
            path = _build_harness(_Builder(args.out, log), nvcc)
        except RuntimeError as e:
            _log(str(e))
            return 1
        _log(f"built {path}")
        return 0

    tf_version, tf_flags = _tf_flags()
    cxx_version = _version([cxx, "--version"])
    nvcc_version = (_version([nvcc, "--version"], -1) or nvcc) if nvcc else None
    key = build_key(tf_version, tf_flags[0] + tf_flags[1], cxx_version or cxx, nvcc_version)
    cached = env.cache_dir() / "kernels" / key
    if args.force or not (cached / "build.json").exists():
        if shutil.which(cxx) is None and not Path(cxx).exists():
            record = {"cpu": {"built": False, "reason": f"no C++ compiler ({cxx!r} not found; install g++ or set CXX)"},
                      "cuda": {"built": False, "reason": "no C++ compiler"}}
            work = None
        else:
            _log(f"building {key} (about 30 s for the CPU ops{', 1-2 min more for CUDA' if nvcc else ''})")
            cached.parent.mkdir(parents=True, exist_ok=True)
            work = Path(tempfile.mkdtemp(prefix=f".{key}-", dir=cached.parent))
            record = build(work, tf_flags=tf_flags, cxx=cxx, nvcc=nvcc, log=work / "build.log",
                           no_cuda_reason="--no-cuda was given" if args.no_cuda else
                           "nvcc not found (set CUDA_HOME or put nvcc on PATH)")
        record.update(key=key, tensorflow=tf_version, compiler=cxx_version, nvcc=nvcc_version,
                      built_at=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"))
        if work is not None:
            for name in ("cpu.o", *(f"{n}.cu.o" for n in CUDA_SOURCES)):
                (work / name).unlink(missing_ok=True)
            (work / "build.json").write_text(json.dumps(record, indent=2) + "\n")
            # Only a finished build goes in the cache (rename is atomic); a build
            # that failed is cached too, so a missing compiler is not retried per run.
            shutil.rmtree(cached, ignore_errors=True)
            work.rename(cached)
        else:
            # Nothing to cache: a compiler installed later must be picked up.
            (args.out / "build.json").write_text(json.dumps(record, indent=2) + "\n")
            _log(f"cpu: not built: {record['cpu']['reason']}")
            return 1 if args.strict else 0
    else:
        _log(f"cached: {key}")
    # Install: replace the products in --out with the cached ones.
    for name in (CPU_LIB, CUDA_LIB, HARNESS, "build.json", "build.log"):
        (args.out / name).unlink(missing_ok=True)
        if (cached / name).exists():
            shutil.copy2(cached / name, args.out / name)
    record = json.loads((args.out / "build.json").read_text())
    for part in ("cpu", "cuda"):
        r = record[part]
        _log(f"{part}: " + ("built " + r.get("library", "") if r["built"] else "not built: " + r.get("reason", "")))
    if args.strict and not record["cpu"]["built"]:
        return 1
    if args.strict and nvcc is not None and not record["cuda"]["built"]:
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
