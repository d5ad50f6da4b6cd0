"""Finding, loading and choosing hvrep's fused kernels (kernels/ in the repository).

The kernels are built by ``make setup`` (``python kernels/build.py``) into
``hvrep/_lib``. Where they were not built, could not load, are switched off
(``HVREP_KERNELS=off``) or cannot run (inside an XLA cluster; a GPU variable
without the CUDA library), the op families (:mod:`hvrep.kernels.lars`,
:mod:`hvrep.kernels.packing`) run their pure-TF references instead: hvrep always
works. :func:`status` (and ``hvrep doctor``) says which path is active and why.
"""

from __future__ import annotations

import ctypes
import functools
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

import tensorflow as tf

from hvrep import _env, compat
from hvrep.errors import KernelError

# Where `make setup` (kernels/build.py) installs them; HVREP_KERNELS_DIR overrides.
LIB_DIR = _env.kernels_dir(Path(__file__).resolve().parents[1] / "_lib")
CPU_LIB = "libhvrep_ops.so"
CUDA_LIB = "libhvrep_ops_cuda.so"




def tf_identity() -> str:
    """The TensorFlow build the kernels must match: its version, "+cuda" for a CUDA build.

    The CPU-only and CUDA wheels of one version are different builds of
    libtensorflow_framework; a library compiled against one is not loaded into the other.
    """
    cuda = tf.sysconfig.get_build_info().get("is_cuda_build", False)
    return tf.__version__ + ("+cuda" if cuda else "")


@dataclass(frozen=True)
class KernelStatus:
    """Which implementation hvrep's kernel functions run in this process.

    Attributes:
      path: "fused" (the C++/CUDA ops are loaded) or "reference" (pure TF).
      devices: device types with fused kernels loaded: ("CPU",) or ("CPU", "GPU").
      reason: why the path is "reference", or what is missing (e.g. no CUDA library); "" if nothing is.
      library: the loaded CPU library's path, or None.
      build: the build record (hvrep/_lib/build.json), {} if there is none.
    """

    path: str
    devices: tuple[str, ...] = ()
    reason: str = ""
    library: str | None = None
    build: dict[str, Any] = field(default_factory=dict)

    def describe(self) -> str:
        if self.path == "reference":
            return f"reference (pure TF): {self.reason}"
        text = f"fused ({', '.join(self.devices)})"
        return f"{text}; {self.reason}" if self.reason else text


@functools.cache
def _load() -> tuple[ModuleType | None, KernelStatus]:
    setting = _env.kernels_setting()
    if setting in ("off", "0", "false", "no"):
        return None, KernelStatus("reference", reason=f"switched off by {_env.HVREP_KERNELS}={setting}")
    record_path = LIB_DIR / "build.json"
    if not record_path.exists():
        return None, KernelStatus(
            "reference", reason=f"not built ({record_path} is missing): run `make setup` or `python kernels/build.py`")
    try:
        build = json.loads(record_path.read_text())
    except (OSError, ValueError) as e:
        return None, KernelStatus("reference", reason=f"{record_path} is unreadable ({e}): rebuild with "
                                                      "`python kernels/build.py --force`")
    if not build.get("cpu", {}).get("built"):
        return None, KernelStatus("reference", build=build, reason="the build failed: "
                                  + str(build.get("cpu", {}).get("reason", "unknown")).splitlines()[0]
                                  + f" (log: {LIB_DIR / 'build.log'})")
    if build.get("tensorflow") != tf_identity():
        # A library compiled against another TensorFlow fails to load with an
        # undefined symbol at best; never try it.
        return None, KernelStatus("reference", build=build, reason=(
            f"built for TensorFlow {build.get('tensorflow')}, this is {tf_identity()}: "
            "rebuild with `make setup` or `python kernels/build.py`"))
    try:
        module = tf.load_op_library(str(LIB_DIR / CPU_LIB))
    except (tf.errors.NotFoundError, OSError) as e:
        return None, KernelStatus("reference", build=build, reason=f"{LIB_DIR / CPU_LIB} failed to load: {e}")
    devices, note = ("CPU",), ""
    gpus = tf.config.list_physical_devices("GPU")
    if gpus:
        cuda = build.get("cuda", {})
        problem = None if cuda.get("built") else "the CUDA kernels were not built (" + str(
            cuda.get("reason", "unknown")).splitlines()[0] + ")"
        if problem is None:
            try:
                tf.load_op_library(str(LIB_DIR / CUDA_LIB))
                driver, runtime = _cuda_versions(LIB_DIR / CUDA_LIB)
                caps = [tuple(tf.config.experimental.get_device_details(g).get("compute_capability") or (0, 0))
                        for g in gpus]
                problem = gpu_problem(driver, runtime, caps, tuple(cuda.get("min_compute_capability", (7, 5))))
            except (tf.errors.NotFoundError, OSError) as e:
                problem = f"{LIB_DIR / CUDA_LIB} failed to load: {e}"
        if problem is None:
            devices = ("CPU", "GPU")
        else:
            note = f"GPU variables use the reference: {problem}"
    return module, KernelStatus("fused", devices=devices, reason=note, library=str(LIB_DIR / CPU_LIB), build=build)


def _cuda_versions(library: Path) -> tuple[int, int]:
    """(driver, runtime) CUDA versions as the GPU library sees them (kernels/src/probe.cu)."""
    lib = ctypes.CDLL(str(library))  # already loaded by TensorFlow: this only looks the symbol up
    driver, runtime = ctypes.c_int(0), ctypes.c_int(0)
    rc = lib.hvrep_cuda_versions(ctypes.byref(driver), ctypes.byref(runtime))
    if rc != 0:
        raise OSError(f"hvrep_cuda_versions failed with code {rc}")
    return driver.value, runtime.value


def _cuda_version_text(v: int) -> str:
    return f"{v // 1000}.{v % 1000 // 10}"


def gpu_problem(driver: int, runtime: int, capabilities: Sequence[tuple[int, int]],
                min_capability: tuple[int, int] = (7, 5)) -> str | None:
    """Why the CUDA kernels cannot run here, or None if they can.

    Args:
      driver: the CUDA driver's version (1000 * major + 10 * minor); 0: none installed.
      runtime: the CUDA runtime's version, numbered the same way.
      capabilities: each visible GPU's compute capability, e.g. (9, 0).
      min_capability: the oldest GPU the kernels were compiled for.
    """
    if driver == 0:
        return "no NVIDIA driver is installed"
    if driver < runtime:
        return (f"the NVIDIA driver supports CUDA {_cuda_version_text(driver)}, older than the CUDA "
                f"{_cuda_version_text(runtime)} runtime the kernels were built with; update the driver, "
                "or rebuild with an older CUDA toolkit (CUDA_HOME=... python kernels/build.py --force)")
    old = sorted({c for c in capabilities if tuple(c) < tuple(min_capability)})
    if old:
        have = ", ".join(f"{a}.{b}" for a, b in old)
        return (f"a GPU of compute capability {have} is older than the kernels' minimum "
                f"{min_capability[0]}.{min_capability[1]}")
    return None


def op_module() -> ModuleType | None:
    """The loaded CPU op library's module (``tf.load_op_library``), or None on the reference path."""
    return _load()[0]


def status() -> KernelStatus:
    """Which path (fused or reference) this process uses, and why."""
    return _load()[1]


def with_library(op: str) -> tuple[ModuleType, ctypes.CDLL] | None:
    """The op module and the loaded library's C functions, where the library has ``op`` (a newer build's op);
    else None. dlopen of the path TensorFlow loaded returns its handle, so the C functions share the ops' state."""
    ops, st = op_module(), status()
    if ops is None or st.library is None or not hasattr(ops, op):
        return None
    return ops, ctypes.CDLL(st.library)


def available(device_type: str = "CPU") -> bool:
    """True if the fused kernels are loaded for ``device_type`` ("CPU" or "GPU")."""
    return device_type.upper() in _load()[1].devices


def _device_type(device: str) -> str:
    return "GPU" if ":GPU:" in device.upper() or device.upper().startswith("/GPU") else "CPU"


def choose(use_kernel: bool | None, what: str, devices: Sequence[str], problem: str | None) -> ModuleType | None:
    """The op module if the fused kernel should run, None for the reference.

    ``use_kernel``: None picks the kernel when it can run; True requires it
    (KernelError naming the reason if it cannot); False always picks the reference.
    """
    if use_kernel is False:
        return None
    module, st = _load()
    if problem is None and module is None:
        problem = st.reason
    if problem is None and compat.in_xla_context():
        problem = "it is being compiled with XLA, and the fused ops have no XLA kernels"
    if problem is None:
        # An unplaced tensor ("") runs where TensorFlow puts it: on a GPU if there is one.
        wanted = {_device_type(d) for d in devices if d}
        if not all(devices):
            wanted.add("GPU" if tf.config.list_physical_devices("GPU") else "CPU")
        missing = sorted(wanted - set(st.devices))
        if missing:
            problem = f"the fused kernels are not loaded for {', '.join(missing)} ({st.reason or 'not built'})"
    if problem is None:
        return module
    if use_kernel:
        raise KernelError(f"{what}: use_kernel=True but the fused kernel cannot run: {problem}. "
                          "Fix that, or pass use_kernel=None to fall back to the reference.")
    return None
