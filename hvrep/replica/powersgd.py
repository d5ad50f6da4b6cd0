"""PowerSGD: rank-r compression of gradient all-reduces with error feedback (Vogels et al., NeurIPS 2019).

For each gradient matrix M (n x m) of a replica, one step of power iteration
against last step's Q (m x r) gives the mean gradient's rank-r approximation
with two small all-reduces instead of one of n*m values::

    M  = G + e                    this replica's gradient plus what compression lost last step
    P  = mean over replicas(M Q)  all-reduce n*r values
    P^ = orthonormal columns of P (Gram-Schmidt in float64)
    Q  = mean over replicas(M^T P^)    all-reduce m*r values
    M^ = P^ Q^T                   the same on every replica: the reduced gradient
    e  = M - M^                   per replica (error feedback)

Q is kept for the next step (warm start). Vectors, scalars and matrices that
would not shrink enough (``CommConfig.powersgd_min_compression_rate``) go
exact through the fused buckets, in the same all-reduce call as the P's.

The reducer needs the variables a gradient belongs to (its state is keyed by
them), so it runs where those are known: ``Replicator.wrap_optimizer``,
``hvrep.keras.DistributedOptimizer``, and ``hvrep.all_reduce(grads, op,
compress=True, powersgd=state)`` with a :class:`PowerSGDState` of your own.

Numbers from the paper and PyTorch's ``powerSGD_hook.py`` are facts carried
over; the code is hvrep's (docs/powersgd.md).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import tensorflow as tf

from hvrep.errors import ConfigError
from hvrep.replica import collectives
from hvrep.replica.comm import CommConfig, powersgd_matrix

# A column of Q whose norm is at most this fraction of Q's largest column norm (or any column when all are 0,
# e.g. after a zero gradient) carries no direction: it is redrawn, or M Q would stay rank-deficient forever.
_DEGENERATE = 1e-6


def random_q(cols: int, rank: int, variable_index: int, step: Any) -> tf.Tensor:
    """The Q (cols x rank, float32) every replica draws for variable ``variable_index`` at ``step``.

    Stateless: seeded from (variable, step), never from a per-rank generator, so every rank draws the same.
    """
    seed = tf.stack([tf.constant(variable_index, tf.int64), tf.cast(step, tf.int64)])
    return tf.random.stateless_normal([cols, rank], seed=seed, dtype=tf.float32)


def orthogonalize(p: tf.Tensor) -> tf.Tensor:
    """P's columns made orthonormal by modified Gram-Schmidt in float64 (stable for the r <= ~8 columns used here).

    A column that is zero, or lies in the span of the earlier ones, becomes 0 (never NaN).
    """
    p64 = tf.cast(p, tf.float64)
    cols: list[tf.Tensor] = []
    for j in range(p.shape[1]):
        c = p64[:, j]
        for q in cols:
            c = c - tf.reduce_sum(q * c) * q
        cols.append(tf.math.divide_no_nan(c, tf.norm(c)))
    return tf.cast(tf.stack(cols, axis=1), p.dtype)


def _redraw_degenerate(q: tf.Tensor, variable_index: int, step: tf.Tensor) -> tf.Tensor:
    norms = tf.norm(q, axis=0)
    bad = tf.logical_not(norms > _DEGENERATE * tf.reduce_max(norms))  # also NaN, and all-zero
    return tf.where(bad[None, :], random_q(q.shape[0], q.shape[1], variable_index, step), q)


def _per_replica_variable(initial: Any, name: str, aggregation: tf.VariableAggregation) -> tf.Variable:
    # ON_READ: under an in-graph strategy every replica holds its own copy (its own error feedback); reading it
    # outside a replica (a checkpoint) aggregates. Without a strategy (horovod) a plain variable of this rank.
    return tf.Variable(initial, trainable=False, name=name, synchronization=tf.VariableSynchronization.ON_READ,
                       aggregation=aggregation)


class PowerSGDState(tf.Module):
    """One replica's PowerSGD state for a list of variables: a ``tf.Module``, so a checkpoint holds it.

    Create it under ``repl.scope()`` (the wrappers do, in ``build``). On an in-graph backend every replica keeps
    its own copy, and a checkpoint saves the replicas' mean error; on horovod each rank's copy is its own. Call
    :meth:`average_errors` before saving so every replica holds what the checkpoint holds (then the chief's copy
    serves every rank). Restored at another world size than it was saved at, the state resets at the next
    reduction (errors zero, Q redrawn, the step counter kept): see docs/powersgd.md.

    Args:
      variables: the variables whose gradients will be reduced, in the order the gradients are passed.
      config: the ``CommConfig`` holding the ``powersgd_*`` settings.
      num_replicas: the world size the state is built for.

    Attributes:
      step: reductions done (int64; before ``powersgd_start_step`` they were exact).
      world_size: the world size the errors and Q's belong to.
      errors: per compressed variable, this replica's error feedback ([rows, cols] float32).
      qs: per compressed variable, the warm-start Q ([cols, r] float32).
      plan: per variable, ``(rows, cols, r)`` or None (sent exact).
    """

    def __init__(self, variables: Sequence[Any], config: CommConfig, num_replicas: int) -> None:
        super().__init__(name="hvrep_powersgd")
        self.config = config
        self.shapes = [tuple(int(d) for d in v.shape) for v in variables]
        self.plan = [powersgd_matrix(s, config.powersgd_rank, config.powersgd_min_compression_rate)
                     for s in self.shapes]
        first = tf.VariableAggregation.ONLY_FIRST_REPLICA  # the same on every replica
        self.step = _per_replica_variable(tf.constant(0, tf.int64), "hvrep_powersgd_step", first)
        self.world_size = _per_replica_variable(tf.constant(num_replicas, tf.int64), "hvrep_powersgd_world", first)
        self.errors: list[tf.Variable] = []
        self.qs: list[tf.Variable] = []
        for p in self.plan:
            if p is None:
                continue
            rows, cols, r = p
            if config.powersgd_error_feedback:
                self.errors.append(_per_replica_variable(tf.zeros([rows, cols]), "hvrep_powersgd_error",
                                                         tf.VariableAggregation.MEAN))
            # Zero: redrawn (seeded by variable and step) at the first compressed step, like any degenerate Q.
            self.qs.append(_per_replica_variable(tf.zeros([cols, r]), "hvrep_powersgd_q", first))

    def average_errors(self) -> None:
        """Inside a replica step (``repl.run(state.average_errors)``), on every replica before a checkpoint: each
        replica's error feedback becomes the replicas' mean.

        The reduced gradients depend on the errors only through their mean (P and Q are means of products linear
        in each M), so training continues the same up to float rounding, and the state is then the same on
        every replica: the chief's copy, saved, is every rank's, and the run that saved continues bit-identically
        to one restored from it.
        """
        if self.errors:
            mean = collectives.all_reduce(list(self.errors), "mean")
            for e, m in zip(self.errors, mean, strict=True):
                e.assign(m)

    def reduce(self, grads: Sequence[Any], op: str, backend: Any, loss_scale: Any = None) -> list[Any]:
        """Inside a replica step: ``grads`` (one per variable, None passes through) reduced across replicas.

        A step whose reduced values are not all finite (an fp16 overflow on any replica: every replica sees
        the same reduced P's, Q's and exact tensors, so every replica decides alike) leaves the state exactly as
        it was (errors, Q's, step counter, world size) and returns NaN for every gradient, so a
        ``LossScaleOptimizer`` skips the step and halves its scale on every replica.

        Args:
          grads: gradients in the order of the state's variables.
          op: "mean" or "sum".
          backend: the live backend (``hvrep.replica.context.live_backend()``).
          loss_scale: the factor ``grads`` carry (a ``LossScaleOptimizer``'s ``dynamic_scale``), or None. The
            compressed gradients are divided by it before the error feedback is added, so the errors stay in
            unscaled units whatever the scale does, and the reduction is multiplied by it again for the
            optimizer to unscale (exact for the powers of two dynamic loss scaling uses).
        """
        if len(grads) != len(self.shapes):
            raise ConfigError(f"PowerSGD state was built for {len(self.shapes)} variables but got {len(grads)} "
                              "gradients. Fix: build it with the variables whose gradients you reduce, in order.")
        for g, s in zip(grads, self.shapes, strict=True):
            if g is not None and tuple(g.shape) != s:
                raise ConfigError(f"PowerSGD state expects a gradient of shape {s} here, got {tuple(g.shape)}. "
                                  "Fix: pass the gradients in the order of the state's variables.")
        n = backend.num_replicas
        changed = tf.not_equal(self.world_size.read_value(), n)
        # A state restored at another world size starts from zero errors and Q's (see the class docstring); like
        # every other change of the state, the reset is committed only by a finite step.
        errors = [tf.where(changed, tf.zeros_like(e), e) for e in self.errors]
        qs = [tf.where(changed, tf.zeros_like(q), q) for q in self.qs]
        scale = None if loss_scale is None else tf.cast(loss_scale, tf.float32)
        step = self.step.read_value()
        start = self.config.powersgd_start_step
        present = [i for i, g in enumerate(grads) if g is not None]

        def compressed() -> tuple[list[Any], tf.Tensor, list[tf.Tensor], list[tf.Tensor]]:
            return self._compressed(grads, op, backend, step, errors, qs, scale)

        def exact() -> tuple[list[Any], tf.Tensor, list[tf.Tensor], list[tf.Tensor]]:
            return (*self._exact(grads, op, backend), errors, qs)

        if start == 0:
            out, finite, new_errors, new_qs = compressed()
        elif getattr(backend, "collectives_in_cond", False):
            def flat(branch: Any) -> Any:  # a branch returns tensors only
                def run() -> tuple[list[Any], tf.Tensor, list[tf.Tensor], list[tf.Tensor]]:
                    reduced, ok, es, qq = branch()
                    return [reduced[i] for i in present], ok, es, qq
                return run

            reduced, finite, new_errors, new_qs = tf.cond(step >= start, flat(compressed), flat(exact))
            out = [None] * len(grads)
            for i, r in zip(present, reduced, strict=True):
                out[i] = r
        else:
            # In-graph strategies cannot issue collectives inside tf.cond: both are reduced until the start step
            # is reached in the graph (one trace), the state is left alone before it. Costs bytes, not fidelity.
            late = step >= start
            x_out, x_finite, _, _ = exact()
            c_out, c_finite, c_errors, c_qs = compressed()
            out = [tf.where(late, c, x) if c is not None else None for c, x in zip(c_out, x_out, strict=True)]
            finite = tf.where(late, c_finite, x_finite)
            new_errors = [tf.where(late, c, e) for c, e in zip(c_errors, errors, strict=True)]
            new_qs = [tf.where(late, c, q) for c, q in zip(c_qs, qs, strict=True)]
        for var, new in zip([*self.errors, *self.qs], [*new_errors, *new_qs], strict=True):
            var.assign(tf.where(finite, new, var))
        self.world_size.assign(tf.where(finite, tf.constant(n, tf.int64), self.world_size))
        self.step.assign_add(tf.cast(finite, tf.int64))
        return [None if o is None else tf.where(finite, o, tf.constant(float("nan"), o.dtype)) for o in out]

    def _exact(self, grads: Sequence[Any], op: str, backend: Any) -> tuple[list[Any], tf.Tensor]:
        idx = [i for i, g in enumerate(grads) if g is not None]
        reduced = backend.all_reduce([tf.convert_to_tensor(grads[i]) for i in idx], op, compress=False)
        out: list[Any] = [None] * len(grads)
        for i, r in zip(idx, reduced, strict=True):
            out[i] = r
        return out, _all_finite(reduced)

    def _compressed(self, grads: Sequence[Any], op: str, backend: Any, step: tf.Tensor, errors: list[tf.Tensor],
                    qs: list[tf.Tensor], scale: tf.Tensor | None
                    ) -> tuple[list[Any], tf.Tensor, list[tf.Tensor], list[tf.Tensor]]:
        """The reduction, whether its reduced values are all finite, and the errors and Q's it leaves (to commit
        only when finite)."""
        cfg = self.config
        out: list[Any] = [None] * len(grads)
        new_errors, new_qs = list(errors), list(qs)
        exact_idx: list[int] = []
        mats: list[tuple[int, int, tf.Tensor, tf.Tensor]] = []  # (variable index, slot, M, Q)
        slot = 0
        for i, (g, p) in enumerate(zip(grads, self.plan, strict=True)):
            if p is None:
                if g is not None:
                    exact_idx.append(i)
                continue
            rows, cols, r = p
            k, slot = slot, slot + 1
            if g is None:
                continue
            m = tf.reshape(tf.cast(g, tf.float32), [rows, cols])
            if scale is not None:
                m = m / scale
            if cfg.powersgd_error_feedback:
                m = m + errors[k]
            q = _redraw_degenerate(qs[k], i, step) if cfg.powersgd_warm_start else random_q(cols, r, i, step)
            mats.append((i, k, m, q))
        # One all-reduce call for the P's and the exact tensors (fused into the same buckets).
        ps = [tf.matmul(m, q) for _, _, m, q in mats]
        first = backend.all_reduce(ps + [tf.convert_to_tensor(grads[i]) for i in exact_idx], op, compress=False)
        for i, r in zip(exact_idx, first[len(ps):], strict=True):
            out[i] = r
        p_hats = [orthogonalize(p) for p in first[:len(ps)]]
        reduced_qs = backend.all_reduce([tf.matmul(m, p, transpose_a=True) for (_, _, m, _), p in
                                         zip(mats, p_hats, strict=True)], op, compress=False)
        for (i, k, m, _), p_hat, q in zip(mats, p_hats, reduced_qs, strict=True):
            approx = tf.matmul(p_hat, q, transpose_b=True)  # the replicas' mean (or sum) of M, rank r
            if cfg.powersgd_error_feedback:
                new_errors[k] = m - (approx if op == "mean" else approx / backend.num_replicas)
            new_qs[k] = q
            if scale is not None:
                approx = approx * scale
            out[i] = tf.cast(tf.reshape(approx, self.shapes[i]), grads[i].dtype)
        # Every replica holds the same reduced values (and computes the same approximations from them), so every
        # replica reaches the same verdict without another collective.
        return out, _all_finite([*first[:len(ps)], *reduced_qs, *(o for o in out if o is not None)]), \
            new_errors, new_qs


def _all_finite(tensors: Sequence[tf.Tensor]) -> tf.Tensor:
    """Whether every element of ``tensors`` is finite (a bool scalar; True for none)."""
    checks = [tf.reduce_all(tf.math.is_finite(t)) for t in tensors if t.dtype.is_floating]
    return tf.reduce_all(tf.stack(checks)) if checks else tf.constant(True)
