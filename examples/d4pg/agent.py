"""The D4PG learner, written for one replica: a distributional critic and a deterministic policy.

- Critic: ``Z(s, a)`` a categorical distribution on ``atoms`` evenly spaced values in [v_min, v_max]; its target is
  the n-step Bellman target ``r + discount * Z'(s', pi'(s'))`` of the target networks, projected back onto the
  atoms (each atom's mass split between its two nearest neighbours); the loss is the cross-entropy to it.
- Policy: ascends the critic's mean ``E[Z(s, pi(s))]``.
- One collective per step: ``hvrep.all_reduce(critic grads + policy grads, "mean")``, so every replica applies
  the mean gradient of the global batch, and N replicas x B equal 1 x N*B.
- Target networks: after each step, ``target += tau * (online - target)`` (``target_period`` > 0: a copy every
  that many steps instead). Like the SN-GAN's EMA, they are plain variables of each process; every process updates
  its copy identically. With one replica per process (Horovod, one process) the update runs at the end of the
  replicated step, in the same compiled call; with in-graph replicas it is a call of its own after the step.

A row of a batch is the replay's (``replay.py``) less its last column: obs, action, n-step reward, discount, next
obs.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any

import keras
import numpy as np
import tensorflow as tf

import hvrep
from hvrep.errors import ConfigError
from hvrep.train.settings import check_ranges


@dataclasses.dataclass(frozen=True)
class D4PGConfig:
    """The agent and its optimisation.

    Attributes:
      hidden: units of the policy's and the critic's hidden layers (ReLU).
      atoms, v_min, v_max: the critic's support (values of the scaled, discounted return).
      reward_scale: rewards are multiplied by it before the target (Pendulum's -16..0 per step x 0.1 keeps
        returns inside [-150, 150]).
      gamma: discount per environment step (the n-step discount comes with each row).
      lr_policy, lr_critic: Adam learning rates.
      tau: soft target update per step (used when target_period = 0).
      target_period: copy the online networks to the targets every this many steps (0: soft updates).
      optimizer: "adam" (the app) or "sgd" (the exactness tests may use it).
      seed: the networks' initial weights.
    """

    hidden: tuple[int, ...] = (256, 256)
    atoms: int = 51
    v_min: float = -150.0
    v_max: float = 150.0
    reward_scale: float = 0.1
    gamma: float = 0.99
    lr_policy: float = 1e-4
    lr_critic: float = 3e-4
    tau: float = 0.005
    target_period: int = 0
    optimizer: str = "adam"
    seed: int = 0

    def __post_init__(self) -> None:
        check_ranges(self, _RANGES, prefix="agent.")
        if not self.hidden or min(self.hidden) < 1:
            raise ConfigError(f"agent.hidden must be one or more layer widths >= 1, got {self.hidden}. Fix: e.g. "
                              "agent.hidden=256,256 (the default).")
        if not self.v_min < self.v_max:
            raise ConfigError(f"v_min must be < v_max, got v_min={self.v_min}, v_max={self.v_max}.")
        if self.optimizer not in ("adam", "sgd"):
            raise ConfigError(f"optimizer must be 'adam' or 'sgd', got {self.optimizer!r}.")


_RANGES = {"atoms": "[2, inf)", "v_min": "(-inf, inf)", "v_max": "(-inf, inf)", "reward_scale": "(0, inf)",
           "gamma": "[0, 1]", "lr_policy": "(0, inf)", "lr_critic": "(0, inf)", "tau": "(0, 1]",
           "target_period": "[0, inf)", "seed": "[0, inf)"}


def _mlp(inputs: int, hidden: tuple[int, ...], outputs: int, name: str) -> keras.Model:
    # The layout examples.d4pg.policy.act computes in NumPy: Dense kernels (in, out), ReLU, a linear last layer.
    layers = [keras.Input((inputs,))]
    layers += [keras.layers.Dense(h, activation="relu") for h in hidden]
    layers += [keras.layers.Dense(outputs)]
    return keras.Sequential(layers, name=name)


def project(rewards: tf.Tensor, discounts: tf.Tensor, probs: tf.Tensor, atoms: tf.Tensor) -> tf.Tensor:
    """The categorical projection of ``rewards + discounts * Z`` onto ``atoms``.

    Args:
      rewards, discounts: (B,). probs: (B, A), the next state's distribution on ``atoms`` (A,), evenly spaced.

    Returns:
      (B, A): each shifted atom's mass split between the two atoms around it (all of it to the edge atom when it
      falls outside); rows sum to 1.
    """
    v_min, v_max = atoms[0], atoms[-1]
    dz = atoms[1] - atoms[0]
    shifted = tf.clip_by_value(rewards[:, None] + discounts[:, None] * atoms[None, :], v_min, v_max)
    where = (shifted - v_min) / dz  # (B, A) in atom units
    index = tf.range(tf.shape(atoms)[0], dtype=where.dtype)
    share = tf.nn.relu(1.0 - tf.abs(where[:, :, None] - index[None, None, :]))  # (B, A source, A target)
    return tf.einsum("bj,bjk->bk", probs, share)


class D4PG:
    """The networks, their optimizers, the target networks and the replicated step.

    Args:
      repl: runs the step on every replica; the online networks and optimizers are built in its scope.
      cfg: the agent's settings.
      obs_dim, act_dim: the environment's (flattened) sizes.
      low, high: the action bounds (act_dim,).
    """

    def __init__(self, repl: hvrep.Replicator, cfg: D4PGConfig, obs_dim: int, act_dim: int, low: Any,
                 high: Any) -> None:
        self.repl, self.cfg, self.obs_dim, self.act_dim = repl, cfg, obs_dim, act_dim
        self.low = tf.constant(np.asarray(low, np.float32).reshape(act_dim))
        self.high = tf.constant(np.asarray(high, np.float32).reshape(act_dim))
        self.atoms = tf.constant(np.linspace(cfg.v_min, cfg.v_max, cfg.atoms), tf.float32)
        # Replicas of this process: an in-graph backend's run gets one host batch of all of them, each slices its own.
        self.local_replicas = max(1, repl.num_replicas // max(1, repl.num_processes))
        with repl.scope():
            keras.utils.set_random_seed(cfg.seed)
            self.policy = _mlp(obs_dim, cfg.hidden, act_dim, "policy")
            self.critic = _mlp(obs_dim + act_dim, cfg.hidden, cfg.atoms, "critic")
            self.opt_policy, self.opt_critic = self._optimizer(cfg.lr_policy), self._optimizer(cfg.lr_critic)
            self.opt_policy.build(self.policy.trainable_variables)
            self.opt_critic.build(self.critic.trainable_variables)
        # Updated after the online networks: inside the replicated step with one replica per process (so built in
        # its scope, where the step's variables belong: Horovod's starts them equal on every rank), else plain
        # variables of this process, updated outside the step.
        with repl.scope() if self.local_replicas == 1 else contextlib.nullcontext():
            self.target_policy = _mlp(obs_dim, cfg.hidden, act_dim, "target_policy")
            self.target_critic = _mlp(obs_dim + act_dim, cfg.hidden, cfg.atoms, "target_critic")
        self.target_policy.trainable = self.target_critic.trainable = False  # no gradient ever reaches them
        self._copy_targets()

    def _optimizer(self, lr: float) -> Any:
        if self.cfg.optimizer == "sgd":
            return keras.optimizers.SGD(lr)
        return keras.optimizers.Adam(lr)

    def checkpoint_items(self) -> dict[str, Any]:
        """What a checkpoint carries: the online and target networks and both optimizers."""
        return {"policy": self.policy, "critic": self.critic, "target_policy": self.target_policy,
                "target_critic": self.target_critic, "opt_policy": self.opt_policy, "opt_critic": self.opt_critic}

    def _pairs(self) -> list[tuple[Any, Any]]:
        return [*zip(self.target_policy.weights, self.policy.weights, strict=True),
                *zip(self.target_critic.weights, self.critic.weights, strict=True)]

    def _copy_targets(self) -> None:
        for t, w in self._pairs():
            t.assign(tf.convert_to_tensor(w))

    @tf.function
    def _update_targets(self, step: tf.Tensor) -> None:
        self._target_update(step)

    def _target_update(self, step: tf.Tensor) -> None:
        if self.cfg.target_period:
            tau = tf.cast(step % self.cfg.target_period == 0, tf.float32)
        else:
            tau = tf.constant(self.cfg.tau, tf.float32)
        for t, w in self._pairs():
            t.assign(t + tau * (tf.convert_to_tensor(w) - t))

    def _act(self, net: keras.Model, obs: tf.Tensor) -> tf.Tensor:
        return self.low + (tf.tanh(net(obs)) + 1.0) * 0.5 * (self.high - self.low)

    def step_fn(self, batch: tf.Tensor) -> dict[str, tf.Tensor]:
        """One replica's step on ``batch`` (local_replicas * B, 2 obs_dim + act_dim + 2); returns its losses."""
        if self.local_replicas > 1:
            b = tf.shape(batch)[0] // self.local_replicas
            i = tf.cast(hvrep.replica_id(), tf.int32) % self.local_replicas
            batch = batch[i * b:(i + 1) * b]
        o, a = batch[:, :self.obs_dim], batch[:, self.obs_dim:self.obs_dim + self.act_dim]
        r = batch[:, self.obs_dim + self.act_dim] * self.cfg.reward_scale
        d = batch[:, self.obs_dim + self.act_dim + 1]
        o2 = batch[:, self.obs_dim + self.act_dim + 2:]
        next_logits = self.target_critic(tf.concat([o2, self._act(self.target_policy, o2)], 1))
        target = tf.stop_gradient(project(r, d, tf.nn.softmax(next_logits), self.atoms))
        with tf.GradientTape(persistent=True) as tape:
            logits = self.critic(tf.concat([o, a], 1))
            critic_loss = tf.reduce_mean(tf.nn.softmax_cross_entropy_with_logits(target, logits))
            q = tf.reduce_sum(tf.nn.softmax(self.critic(tf.concat([o, self._act(self.policy, o)], 1)))
                              * self.atoms, -1)
            policy_loss = -tf.reduce_mean(q)
        critic_vars, policy_vars = self.critic.trainable_variables, self.policy.trainable_variables
        grads = tape.gradient(critic_loss, critic_vars) + tape.gradient(policy_loss, policy_vars)
        grads = hvrep.all_reduce(grads, "mean")  # the step's one collective: both networks' gradients
        self.opt_critic.apply_gradients(zip(grads[:len(critic_vars)], critic_vars, strict=True))
        self.opt_policy.apply_gradients(zip(grads[len(critic_vars):], policy_vars, strict=True))
        return {"critic_loss": critic_loss, "policy_loss": policy_loss, "q": tf.reduce_mean(q)}

    def step_and_targets_fn(self, batch: tf.Tensor, step: tf.Tensor) -> dict[str, tf.Tensor]:
        """``step_fn``, then the target update for global step ``step`` (int64, 1-based), in one compiled call:
        for one replica per process only (the targets are this process's variables)."""
        out = self.step_fn(batch)
        self._target_update(step)  # reads the online weights after the optimizers wrote them (program order)
        return out

    def train_step(self, batch: Any, step: int) -> Any:
        """Runs the step on every replica, then the target update for global step ``step`` (1-based); returns
        the per-replica losses (``repl.reduce`` them)."""
        batch, step = tf.constant(batch, tf.float32), tf.constant(step, tf.int64)
        if self.local_replicas == 1:
            # One dispatch per learner step, not two: 1 rank at load 44, 6.1 -> 5.3 CPU ms and 2.9 -> 1.4 context
            # switches per step (docs/performance.md, "Learners that scale").
            return self.repl.run(self.step_and_targets_fn, args=(batch, step))
        # In-graph replicas would each update this process's one copy: the update stays outside the step.
        out = self.repl.run(self.step_fn, args=(batch,))
        self._update_targets(step)
        return out

    def policy_weights(self) -> np.ndarray:
        """The online policy as one flat float32 vector (``examples.d4pg.policy``'s layout)."""
        return np.concatenate([np.asarray(w.numpy() if hasattr(w, "numpy") else w, np.float32).reshape(-1)
                               for w in self.policy.weights])
