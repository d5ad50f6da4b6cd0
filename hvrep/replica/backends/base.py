"""The interface every backend implements, and what they share.

What is the same on every backend lives here once (STYLE.md, "Each seam is an
interface first"): the all-reduce of a list of tensors (floating-point
sum/mean through fused buffers, everything else one collective per tensor),
the integer floor-mean, and the bfloat16 wrappers (sums travel as float32,
gathers and broadcasts as int16 bits). A backend supplies one collective on
one tensor (:meth:`Backend._reduce_wire`) and the gather/broadcast primitives.
"""

from __future__ import annotations

import abc
import collections
import contextlib
import inspect
import logging
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import tensorflow as tf

from hvrep import kernels
from hvrep.compat import keras_batch_norm
from hvrep.errors import CollectiveError
from hvrep.replica import context, fusion
from hvrep.replica.comm import CommConfig
from hvrep.replica.context import InputContext, check_op

# CommConfig.compression -> the dtype fused buffers travel in (None: each tensor's own).
# PowerSGD's factors and exact tensors travel in their own dtype (hvrep.replica.powersgd).
WIRE_DTYPES: dict[str, tf.DType | None] = {"none": None, "fp16": tf.float16, "bf16": tf.bfloat16, "powersgd": None}


def mean_from_sum(total: Any, n: int, integer: bool) -> Any:
    """A sum over ``n`` replicas divided into their mean; integers floor (documented in ``all_reduce``).

    Works on tensors and NumPy arrays alike.
    """
    return total // n if integer else total / n


def reduce_bf16_as_f32(t: tf.Tensor, op: str, n: int, collective: Callable[[tf.Tensor], tf.Tensor]) -> tf.Tensor:
    """``collective(t)`` (a sum, max or min over ``n`` replicas), the mean's division if ``op`` is "mean", in t's dtype.

    bfloat16 travels and is divided as float32: neither Horovod nor TF's CPU
    collectives reduce bfloat16.
    """
    wire = tf.cast(t, tf.float32) if t.dtype == tf.bfloat16 else t
    r = collective(wire)
    if op == "mean":
        r = mean_from_sum(r, n, t.dtype.is_integer)
    return tf.cast(r, t.dtype)


def move_bf16_as_bits(x: tf.Tensor, collective: Callable[[tf.Tensor], tf.Tensor]) -> tf.Tensor:
    """``collective(x)`` for a gather or broadcast; bfloat16 moves as its int16 bits (exact; Horovod has no bf16)."""
    if x.dtype == tf.bfloat16:
        return tf.bitcast(collective(tf.bitcast(x, tf.int16)), tf.bfloat16)
    return collective(x)


_log = logging.getLogger("hvrep")


def function_key(fn: Callable[..., Any]) -> tuple[Any, list[Any]]:
    """What decides the step ``run`` compiles, and the objects that key names by id.

    The key is the code and what it closes over, not the function object: a
    fresh ``lambda x: step(x, model)`` each iteration has the same code and
    the same closure contents, so it reuses the compiled step instead of
    retracing (and growing the cache) every time; a lambda over a different
    value gets its own. The cache keeps the named objects alive, so no other
    object can take one of their ids while the key is cached (a closure cell
    can be rebound after the fact, so keeping the function is not enough).
    """
    if inspect.ismethod(fn):  # a bound method (which also answers __code__): one per (function, instance)
        key, refs = function_key(fn.__func__)
        return ("method", key, id(fn.__self__)), [*refs, fn.__self__]
    code = getattr(fn, "__code__", None)
    if code is None or not inspect.isfunction(fn):
        return ("object", id(fn)), [fn]
    refs: list[Any] = []
    cells = []
    for cell in fn.__closure__ or ():
        try:
            value = cell.cell_contents
        except ValueError:  # an empty cell
            cells.append(None)
            continue
        refs.append(value)
        cells.append(id(value))
    defaults = (*(fn.__defaults__ or ()), *(fn.__kwdefaults__ or {}).values())
    refs += [*defaults, fn.__globals__]
    return ("code", code, tuple(cells), tuple(map(id, defaults)), id(fn.__globals__)), refs


class FunctionCache:
    """The compiled steps of ``run``, keyed by :func:`function_key`, at most ``size`` of them (least recently
    used dropped). An entry holds the objects its key names by id."""

    def __init__(self, size: int = 32) -> None:
        self.size = size
        self.compiled = 0
        self._entries: collections.OrderedDict[Any, list[Any]] = collections.OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def entry(self, fn: Callable[..., Any], compile_fn: Callable[[Callable[..., Any]], Any]) -> list[Any]:
        """``[fn, compiled, state, refs]`` for ``fn``; ``compile_fn(fn)`` builds ``compiled`` on a miss (state
        None)."""
        key, refs = function_key(fn)
        found = self._entries.get(key)
        if found is not None:
            self._entries.move_to_end(key)
            return found
        found = [fn, compile_fn(fn), None, refs]
        self._entries[key] = found
        self.compiled += 1
        if len(self._entries) > self.size:
            self._entries.popitem(last=False)
        if self.compiled == self.size + 1:
            _log.warning("hvrep: run() has compiled %d different step functions; each one is traced anew. Pass "
                         "the same function every step (not a new one that closes over new objects).",
                         self.compiled)
        return found


class Backend(abc.ABC):
    """One way to run replicas. Chosen once, at start-up, by the registry."""

    name: str = ""
    # hvrep's bucket size when CommConfig.fusion_threshold_bytes is None (see CommConfig).
    default_fusion_threshold_bytes: int = 128 * 1024 * 1024
    # Whether a collective may sit inside tf.cond (every rank takes the same branch): Horovod's ops can; an
    # in-graph strategy's replica-context all-reduce (a merge_call) cannot.
    collectives_in_cond: bool = False

    def __init__(self, config: CommConfig, devices_per_replica: int = 1) -> None:
        self.config = config
        # Devices each replica owns (Replicator(devices_per_replica=...)).
        self.devices_per_replica = devices_per_replica
        # Collectives issued, and the bytes all-reduces were asked to reduce, for tests and reports (counted
        # when traced: per traced step, not per execution).
        self.collective_calls = 0
        self.reduced_bytes = 0
        # How Keras' BatchNormalization layers train in a step ``run`` traces: "fused" or "keras"
        # (the Replicator sets it; see Replicator's batch_norm).
        self.batch_norm = "fused"

    def step_body(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        """What ``run`` traces for the user's ``fn``, on each replica's thread: ``fn`` itself, inside
        ``hvrep.compat.keras_batch_norm.fused_in_this_thread`` when ``batch_norm`` is "fused"."""
        return keras_batch_norm.in_this_thread(fn) if self.batch_norm == "fused" else fn

    def close(self) -> None:
        """Releases what outlives a step (the horovod backend: its compiled steps and its use of the watchdog)."""
        return

    @classmethod
    @abc.abstractmethod
    def available(cls) -> bool:
        """Whether this backend can run in this process."""

    @property
    @abc.abstractmethod
    def num_replicas(self) -> int: ...

    @property
    @abc.abstractmethod
    def is_chief(self) -> bool: ...

    # This process's place in the job (Horovod's rank, size, local_rank, local_size).
    @property
    @abc.abstractmethod
    def rank(self) -> int: ...

    @property
    @abc.abstractmethod
    def num_processes(self) -> int: ...

    @property
    @abc.abstractmethod
    def local_rank(self) -> int: ...

    @property
    @abc.abstractmethod
    def local_size(self) -> int: ...

    @abc.abstractmethod
    def replica_devices(self) -> tuple[str, ...]:
        """The devices of the replica running this code (inside ``run``), or of this process's first replica
        (outside it): ``devices_per_replica`` TensorFlow device names."""

    @abc.abstractmethod
    def scope(self) -> contextlib.AbstractContextManager[None]:
        """Variables created inside start identical on every replica."""

    @abc.abstractmethod
    def distribute_dataset(self, input_fn: Callable[[InputContext], tf.data.Dataset],
                           global_batch_size: int | None) -> Any: ...

    @abc.abstractmethod
    def run(self, fn: Callable[..., Any], args: tuple, kwargs: dict) -> Any: ...

    @abc.abstractmethod
    def reduce(self, value: Any, op: str) -> Any: ...

    # In-replica collectives, on flat lists (the public functions handle nests).
    def all_reduce(self, tensors: Sequence[tf.Tensor], op: str, compress: bool = False) -> list[tf.Tensor]:
        """Floating-point sum/mean through fused buffers (``CommConfig``; in its compression dtype when
        ``compress``: gradients only); the rest one collective per tensor."""
        check_op(op)
        self._on_collective("all_reduce", tensors, op)
        n = self.num_replicas
        out: list[tf.Tensor | None] = [None] * len(tensors)
        floats = [i for i, t in enumerate(tensors) if t.dtype.is_floating] if op in ("sum", "mean") else []
        if floats:
            def reduce_buffer(buf: tf.Tensor) -> tf.Tensor:
                self.collective_calls += 1
                return reduce_bf16_as_f32(buf, "sum", n, lambda w: self._counted_wire(w, "sum"))

            def reduce_parts(parts: list[tf.Tensor], scale: float, align: int) -> tf.Tensor | None:
                got = self._reduce_parts(parts, scale, align)
                if got is not None:
                    self.collective_calls += 1
                    sizes = [t.shape.num_elements() for t in parts]
                    if None not in sizes:
                        self.reduced_bytes += kernels.packed_length(sizes, align) * parts[0].dtype.size
                return got

            reduced = fusion.fused_reduce([tensors[i] for i in floats], reduce_buffer,
                                          self.fusion_threshold_bytes, self.config.num_groups,
                                          wire_dtype=WIRE_DTYPES[self.config.compression] if compress else None,
                                          prescale=1.0 / n if op == "mean" else None, reduce_parts=reduce_parts)
            for i, r in zip(floats, reduced, strict=True):
                out[i] = r
        for i, t in enumerate(tensors):
            if out[i] is None:
                out[i] = self._reduce_tensor(t, op)
        return out  # type: ignore[return-value]

    def keep_local(self, tensors: Sequence[tf.Tensor]) -> list[tf.Tensor]:
        """Inside a replica step: ``tensors`` (this replica's own gradients, local SGD) as an optimizer should apply
        them, to this replica's copy only. One process per replica: nothing to do (in-graph: see there)."""
        return list(tensors)

    @property
    def fusion_threshold_bytes(self) -> int:
        """hvrep's bucket size: the config's, or this backend's default."""
        ft = self.config.fusion_threshold_bytes
        return self.default_fusion_threshold_bytes if ft is None else ft

    def _reduce_tensor(self, t: tf.Tensor, op: str) -> tf.Tensor:
        """One tensor reduced on its own (not floating point, or max/min): one collective."""
        self.collective_calls += 1
        return reduce_bf16_as_f32(t, op, self.num_replicas, lambda w: self._counted_wire(w, op))

    def _counted_wire(self, t: tf.Tensor, op: str) -> tf.Tensor:
        """``_reduce_wire``, its bytes (as they travel) added to ``reduced_bytes`` (unknown shapes count 0)."""
        n = t.shape.num_elements()
        self.reduced_bytes += 0 if n is None else int(n) * t.dtype.size
        return self._reduce_wire(t, op)

    def _reduce_parts(self, parts: list[tf.Tensor], scale: float, align: int) -> tf.Tensor | None:
        """The sum over the replicas of ``hvrep.kernels.pack(parts, None, scale, align)``, in one collective that
        takes the parts where they are (no packed copy), where this backend has one; None where it has not (the
        caller packs). The parts share one floating-point dtype."""
        return None

    @abc.abstractmethod
    def _reduce_wire(self, t: tf.Tensor, op: str) -> tf.Tensor:
        """One collective: ``t`` (never bfloat16) summed ("sum"/"mean": the division is the caller's), max'd or
        min'd across replicas."""

    def _on_collective(self, kind: str, tensors: Sequence[tf.Tensor], detail: str = "") -> None:
        """Called as each collective is traced (the horovod backend records the step's signature)."""
        return

    @abc.abstractmethod
    def all_gather(self, x: tf.Tensor, axis: int) -> tf.Tensor: ...

    def broadcast_variables(self, variables: Sequence[tf.Variable], root: int) -> None:
        """Eager: ``variables`` take process ``root``'s values. One process (in-graph backends) holds mirrored
        variables that are already equal: nothing to do."""
        if not 0 <= root < self.num_processes:
            raise CollectiveError(f"root_rank={root} is not a process rank in [0, {self.num_processes}).")

    def broadcast_object(self, obj: Any, root: int = 0) -> Any:
        """Eager: process ``root``'s ``obj`` (picklable) on every process. One process: ``obj`` itself."""
        return obj

    @abc.abstractmethod
    def broadcast(self, x: tf.Tensor, root: int) -> tf.Tensor: ...

    @abc.abstractmethod
    def replica_id(self) -> tf.Tensor | int: ...

    @contextlib.contextmanager
    def replica_section(self) -> Iterator[None]:
        """This backend is the live one (what the module-level collectives act on) inside."""
        with context.activated(self):
            yield
