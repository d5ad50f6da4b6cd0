"""hvrep's fused kernels (kernels/ in the repository) and their pure-TF references.

Three ops, each with a CPU kernel, a CUDA kernel and a reference written in
plain TensorFlow that gives the same result:

* :func:`fused_lars_apply`: one LARS step (``hvrep.optimizers.LARS``) for a
  whole list of variables and their momentum slots, in one op instead of
  about ten per variable.
* :func:`pack` / :func:`unpack`: a list of tensors to one rank-1 buffer and
  back, with a cast (e.g. to fp16 for the wire) and a scale (e.g. 1/N before a
  sum across N replicas), for the fused all-reduce (``hvrep.fusion``).

The kernels are built by ``make setup`` (``python kernels/build.py``) into
``hvrep/_lib``. Where they were not built, could not load, are switched off
(``HVREP_KERNELS=off``) or cannot run (inside an XLA cluster; a GPU variable
without the CUDA library), every function here runs its reference instead:
hvrep always works. :func:`status` (and ``hvrep doctor``) says which path is
active and why.
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
from hvrep.errors import ConfigError, KernelError

# Where `make setup` (kernels/build.py) installs them; HVREP_KERNELS_DIR overrides.
LIB_DIR = _env.kernels_dir(Path(__file__).resolve().parents[1] / "_lib")
CPU_LIB = "libhvrep_ops.so"
CUDA_LIB = "libhvrep_ops_cuda.so"

LARS_DTYPES = (tf.float32, tf.float64)
PACK_DTYPES = (tf.float16, tf.bfloat16, tf.float32, tf.float64)
_DECAY, _ADAPT = 1, 2  # the op's per-variable flags (kernels/include/hvrep_kernels.h)

__all__ = [
    "KernelStatus",
    "available",
    "fused_lars_apply",
    "gpu_problem",
    "lars_update",
    "pack",
    "reference_lars_apply",
    "reference_pack",
    "reference_unpack",
    "status",
    "tf_identity",
    "unpack",
]


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
    _register_gradients()
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
      driver, runtime: CUDA versions (1000 * major + 10 * minor); driver 0: none installed.
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


def status() -> KernelStatus:
    """Which path (fused or reference) this process uses, and why."""
    return _load()[1]


def available(device_type: str = "CPU") -> bool:
    """True if the fused kernels are loaded for ``device_type`` ("CPU" or "GPU")."""
    return device_type.upper() in _load()[1].devices


def _device_type(device: str) -> str:
    return "GPU" if ":GPU:" in device.upper() or device.upper().startswith("/GPU") else "CPU"


def _choose(use_kernel: bool | None, what: str, devices: Sequence[str], problem: str | None) -> ModuleType | None:
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


# ---------------------------------------------------------------------------
# LARS.


def lars_update(w: tf.Tensor, v: tf.Tensor, g: tf.Tensor, lr: tf.Tensor, *, momentum: float, weight_decay: float,
                eta: float, epsilon: float, nesterov: bool, adapt: bool) -> tuple[tf.Tensor, tf.Tensor]:
    """One variable's LARS step in plain TF: returns (new momentum slot, amount to subtract from w).

    The definition the fused kernel is tested against and the per-variable path
    of ``hvrep.optimizers.LARS``. ``weight_decay`` is 0 for a variable excluded from
    decay; arguments are Python floats so a float64 variable computes in float64.
    """
    g_total = g + weight_decay * w if weight_decay else g
    if adapt:
        w_norm = tf.sqrt(tf.reduce_sum(tf.square(w)))
        g_norm = tf.sqrt(tf.reduce_sum(tf.square(g)))
        ok = tf.logical_and(w_norm > 0, g_norm > 0)
        denom = g_norm + weight_decay * w_norm + epsilon
        ratio = tf.where(ok, eta * w_norm / tf.where(ok, denom, tf.ones_like(denom)), tf.ones_like(denom))
        scaled = lr * ratio * g_total
    else:
        scaled = lr * g_total
    new_v = momentum * v + scaled
    return new_v, (momentum * new_v + scaled if nesterov else new_v)


def _as_tf_variable(v: Any) -> tf.Variable:
    if isinstance(v, tf.Variable):
        return v
    # A Keras 3 variable holds its tf.Variable in `.value` (TF backend).
    inner = getattr(v, "value", None)
    if not isinstance(inner, tf.Variable):
        raise ConfigError(f"expected a tf.Variable or keras.Variable, got a {type(v).__name__} ({_name(v)!r}); "
                          "the fused LARS updates variables in place.")
    return inner


def _name(v: Any) -> str:
    return str(getattr(v, "path", None) or getattr(v, "name", "?"))


def _check_lars_args(variables: Sequence[Any], momentums: Sequence[Any], gradients: Sequence[Any],
                     decay: Sequence[bool], adapt: Sequence[bool]) -> None:
    lengths = {"variables": len(variables), "momentums": len(momentums), "gradients": len(gradients),
               "decay": len(decay), "adapt": len(adapt)}
    if len(set(lengths.values())) != 1:
        raise ConfigError(f"fused_lars_apply: the lists must have one entry per variable; got lengths {lengths}.")
    for i, (w, v, g) in enumerate(zip(variables, momentums, gradients, strict=True)):
        if g is None:
            raise ConfigError(f"fused_lars_apply: gradient {i} (of variable {_name(w)!r}) is None; "
                              "drop variables without gradients before the call.")
        ws, vs, gs = tf.TensorShape(w.shape), tf.TensorShape(v.shape), tf.TensorShape(g.shape)
        if not (ws.is_compatible_with(gs) and ws.is_compatible_with(vs)):
            raise ConfigError(f"fused_lars_apply: variable {i} ({_name(w)!r}) has shape {ws}, its momentum slot "
                              f"{vs} and its gradient {gs}; they must be equal.")
        if not tf.as_dtype(w.dtype).is_floating:
            raise ConfigError(f"fused_lars_apply: variable {i} ({_name(w)!r}) is {tf.as_dtype(w.dtype).name}; "
                              "LARS updates floating-point variables only.")


def reference_lars_apply(variables: Sequence[Any], momentums: Sequence[Any], gradients: Sequence[Any],
                         learning_rate: Any, *, momentum: float, weight_decay: float, eta: float,
                         epsilon: float = 0.0, nesterov: bool = False, decay: Sequence[bool],
                         adapt: Sequence[bool]) -> None:
    """:func:`fused_lars_apply` in plain TF: one variable at a time (the per-variable path)."""
    _check_lars_args(variables, momentums, gradients, decay, adapt)
    _reference_lars(variables, momentums, gradients, learning_rate, momentum=momentum, weight_decay=weight_decay,
                    eta=eta, epsilon=epsilon, nesterov=nesterov, decay=decay, adapt=adapt)


def _reference_lars(variables: Sequence[Any], momentums: Sequence[Any], gradients: Sequence[Any],
                    learning_rate: Any, *, momentum: float, weight_decay: float, eta: float, epsilon: float,
                    nesterov: bool, decay: Sequence[bool], adapt: Sequence[bool]) -> None:
    """:func:`reference_lars_apply` on arguments already checked."""
    for w, v, grad, d, a in zip(variables, momentums, gradients, decay, adapt, strict=True):
        tw, tv = _as_tf_variable(w), _as_tf_variable(v)
        g = tf.cast(tf.convert_to_tensor(grad), tw.dtype)
        lr = tf.cast(learning_rate, tw.dtype)
        new_v, delta = lars_update(tf.convert_to_tensor(tw), tf.convert_to_tensor(tv), g, lr, momentum=momentum,
                                   weight_decay=weight_decay if d else 0.0, eta=eta, epsilon=epsilon,
                                   nesterov=nesterov, adapt=bool(a))
        tv.assign(new_v)
        tw.assign_sub(delta)


def fused_lars_apply(variables: Sequence[Any], momentums: Sequence[Any], gradients: Sequence[Any],
                     learning_rate: Any, *, momentum: float, weight_decay: float, eta: float,
                     epsilon: float = 0.0, nesterov: bool = False, decay: Sequence[bool], adapt: Sequence[bool],
                     use_kernel: bool | None = None) -> None:
    """One LARS step for every variable, updating variables and momentum slots in place.

    The update (You et al. 2017; see ``hvrep.optimizers``) of each variable w
    with momentum slot v and gradient g:
    ``g' = g + wd*w``; ``ratio = eta*|w| / (|g| + wd*|w| + epsilon)`` (1 where
    not adapted or a norm is 0); ``v = momentum*v + lr*ratio*g'``; ``w -= v``
    (Nesterov: ``w -= momentum*v + lr*ratio*g'``); ``wd`` is 0 where not decayed.

    Args:
      variables, momentums: ``tf.Variable`` or ``keras.Variable``, one slot per variable, same shape.
      gradients: tensors of the variables' shapes (cast to the variable's dtype, as Keras does).
      learning_rate: a scalar (float, tensor or variable).
      momentum, weight_decay, eta, epsilon, nesterov: the LARS hyper-parameters.
      decay, adapt: per variable, whether it gets weight decay / layer adaptation.
      use_kernel: None: the fused op where it can run (float32/float64
        variables, loaded for their device, not under XLA), the reference
        elsewhere; True: the fused op or KernelError; False: the reference.
    """
    _check_lars_args(variables, momentums, gradients, decay, adapt)
    hyper = dict(momentum=momentum, weight_decay=weight_decay, eta=eta, epsilon=epsilon, nesterov=nesterov)
    # One op call per dtype; other dtypes (e.g. float16 variables) take the reference.
    groups: dict[tf.DType, list[int]] = {}
    for i, w in enumerate(variables):
        groups.setdefault(tf.as_dtype(w.dtype), []).append(i)
    for dtype, idx in groups.items():
        problem = None if dtype in LARS_DTYPES else f"the fused LARS takes float32/float64 variables, not {dtype.name}"
        tf_vars = [_as_tf_variable(variables[i]) for i in idx]
        module = _choose(use_kernel, "fused_lars_apply", [v.device for v in tf_vars], problem)
        pick = [variables[i] for i in idx], [momentums[i] for i in idx], [gradients[i] for i in idx]
        flags = [(_DECAY if decay[i] else 0) | (_ADAPT if adapt[i] else 0) for i in idx]
        if module is None:
            _reference_lars(*pick, learning_rate, **hyper, decay=[decay[i] for i in idx],
                            adapt=[adapt[i] for i in idx])
            continue
        grads = [tf.cast(tf.convert_to_tensor(g), dtype) for g in pick[2]]
        module.hvrep_fused_lars_apply(
            var=[v.handle for v in tf_vars], mom=[_as_tf_variable(m).handle for m in pick[1]], grad=grads,
            lr=tf.cast(learning_rate, dtype),
            hyper=tf.constant([momentum, weight_decay, eta, epsilon], tf.float64), nesterov=bool(nesterov),
            flags=flags)


# ---------------------------------------------------------------------------
# Pack / unpack.


def _scale64(scale: Any) -> tf.Tensor:
    s = tf.cast(scale, tf.float64)
    if s.shape.rank not in (0, None):
        raise ConfigError(f"scale must be a scalar, got shape {s.shape}.")
    return s


def _pack_dtype(tensors: Sequence[tf.Tensor], dtype: Any) -> tf.DType:
    if dtype is not None:
        return tf.as_dtype(dtype)
    kinds = sorted({t.dtype.name for t in tensors})
    if len(kinds) > 1:
        raise ConfigError(f"pack: the tensors have dtypes {kinds}; pass dtype= to say which the buffer is.")
    if not kinds:
        raise ConfigError("pack: dtype= is needed for an empty list (the buffer's dtype).")
    return tensors[0].dtype


def reference_pack(tensors: Sequence[Any], dtype: Any = None, scale: Any = 1.0) -> tf.Tensor:
    """:func:`pack` in plain TF: ``concat([reshape(cast(t * cast(scale, t.dtype), dtype), [-1]) ...])``."""
    tensors = [tf.convert_to_tensor(t) for t in tensors]
    out = _pack_dtype(tensors, dtype)
    s = _scale64(scale)
    parts = [tf.reshape(tf.cast(t * tf.cast(s, t.dtype), out), [-1]) for t in tensors]
    if not parts:
        return tf.zeros([0], out)
    return parts[0] if len(parts) == 1 else tf.concat(parts, axis=0)


def pack(tensors: Sequence[Any], dtype: Any = None, scale: Any = 1.0, *, use_kernel: bool | None = None) -> tf.Tensor:
    """Packs tensors into one rank-1 buffer: each multiplied by ``scale`` in its own dtype, cast to ``dtype``.

    Args:
      tensors: float16/bfloat16/float32/float64 tensors, dtypes may differ.
      dtype: the buffer's dtype (e.g. tf.float16 to halve the bytes on the
        wire); None: the tensors' common dtype.
      scale: a scalar, e.g. 1/N before summing over N replicas (so fp16 sums
        do not overflow). 1 leaves values unchanged.
      use_kernel: as in :func:`fused_lars_apply`.

    Returns:
      A rank-1 tensor of ``sum(t.size)`` elements, the tensors in order.
    """
    tensors = [tf.convert_to_tensor(t) for t in tensors]
    out = _pack_dtype(tensors, dtype)
    bad = sorted({t.dtype.name for t in tensors if t.dtype not in PACK_DTYPES} |
                 ({out.name} if out not in PACK_DTYPES else set()))
    problem = f"the fused pack takes float16/bfloat16/float32/float64, not {bad}" if bad else None
    module = _choose(use_kernel, "pack", [t.device for t in tensors], problem)
    if module is None:
        return reference_pack(tensors, out, scale)
    return module.hvrep_pack(tensors=tensors, scale=_scale64(scale), out_type=out)


def _unpack_args(buffer: tf.Tensor, shapes: Sequence[Any], dtypes: Any) -> tuple[list[tf.TensorShape], list[tf.DType]]:
    shapes = [tf.TensorShape(s) for s in shapes]
    if dtypes is None or isinstance(dtypes, tf.DType | str) or not isinstance(dtypes, Sequence):
        dtypes = [buffer.dtype if dtypes is None else dtypes] * len(shapes)
    dtypes = [tf.as_dtype(d) for d in dtypes]
    if len(dtypes) != len(shapes):
        raise ConfigError(f"unpack: {len(shapes)} shapes but {len(dtypes)} dtypes; give one dtype per shape.")
    for i, s in enumerate(shapes):
        if not s.is_fully_defined():
            raise ConfigError(f"unpack: shape {i} is {s}; every shape must be fully defined.")
    if buffer.shape.rank not in (1, None):
        raise ConfigError(f"unpack: the buffer must be rank 1, got shape {buffer.shape}.")
    total = sum(s.num_elements() for s in shapes)
    if buffer.shape.rank == 1 and buffer.shape[0] is not None and buffer.shape[0] != total:
        raise ConfigError(f"unpack: the buffer has {buffer.shape[0]} elements but the {len(shapes)} shapes "
                          f"need {total}.")
    return shapes, dtypes


def reference_unpack(buffer: Any, shapes: Sequence[Any], dtypes: Any = None, scale: Any = 1.0) -> list[tf.Tensor]:
    """:func:`unpack` in plain TF: ``[reshape(cast(piece, dtype) * cast(scale, dtype), shape) ...]``."""
    buffer = tf.convert_to_tensor(buffer)
    shapes, dtypes = _unpack_args(buffer, shapes, dtypes)
    s = _scale64(scale)
    pieces = tf.split(buffer, [s_.num_elements() for s_ in shapes]) if shapes else []
    return [tf.reshape(tf.cast(p, d) * tf.cast(s, d), sh) for p, d, sh in zip(pieces, dtypes, shapes, strict=True)]


def unpack(buffer: Any, shapes: Sequence[Any], dtypes: Any = None, scale: Any = 1.0, *,
           use_kernel: bool | None = None) -> list[tf.Tensor]:
    """Splits a rank-1 buffer into tensors: each piece cast to its dtype, then multiplied by ``scale``.

    Args:
      buffer: rank 1, as :func:`pack` made it.
      shapes: the tensors' shapes (fully defined), in buffer order.
      dtypes: one dtype per shape, or one for all; None: the buffer's dtype.
      scale: a scalar multiplied in after the cast (1 leaves values unchanged).
      use_kernel: as in :func:`fused_lars_apply`.
    """
    buffer = tf.convert_to_tensor(buffer)
    shapes, dtypes = _unpack_args(buffer, shapes, dtypes)
    bad = sorted({d.name for d in [*dtypes, buffer.dtype] if d not in PACK_DTYPES})
    problem = f"the fused unpack takes float16/bfloat16/float32/float64, not {bad}" if bad else None
    module = _choose(use_kernel, "unpack", [buffer.device], problem)
    if module is None:
        return reference_unpack(buffer, shapes, dtypes, scale)
    return module.hvrep_unpack(packed=buffer, scale=_scale64(scale), Tout=dtypes, shapes=shapes)


def _register_gradients() -> None:
    # pack and unpack are each other's gradient: d(cast(t*s))/dt = s (cast back).
    @tf.RegisterGradient("HvrepPack")
    def _pack_grad(op: tf.Operation, grad: tf.Tensor) -> list[tf.Tensor | None]:
        inputs = op.inputs[:-1]
        shapes = [t.shape if t.shape.is_fully_defined() else tf.shape(t) for t in inputs]
        if all(isinstance(s, tf.TensorShape) for s in shapes):
            parts = unpack(grad, shapes, [t.dtype for t in inputs], op.inputs[-1])
        else:
            sizes = [tf.size(t) for t in inputs]
            parts = [tf.reshape(tf.cast(p, t.dtype) * tf.cast(op.inputs[-1], t.dtype), tf.shape(t))
                     for p, t in zip(tf.split(grad, sizes), inputs, strict=True)]
        return [*parts, None]

    @tf.RegisterGradient("HvrepUnpack")
    def _unpack_grad(op: tf.Operation, *grads: tf.Tensor | None) -> list[tf.Tensor | None]:
        dense = [tf.zeros(o.shape, o.dtype) if g is None else g for g, o in zip(grads, op.outputs, strict=True)]
        return [pack(dense, op.inputs[0].dtype, op.inputs[1]), None]
