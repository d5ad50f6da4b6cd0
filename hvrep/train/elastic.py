"""``hvrep train`` under horovodrun's elastic driver: the controller's loop inside ``hvrep.elastic.run``.

    horovodrun --gloo -np 4 --min-np 2 --max-np 4 --host-discovery-script ./hosts.sh \
        hvrep train --config demo train.global_batch=48 elastic.min_np=2 elastic.max_np=4

The loop commits in memory every ``elastic.commit_every_steps`` steps and at each epoch's end (after its
evaluation and checkpoint): the model's and optimizer's variables (the loss scale under fp16 included), the
accumulated gradients and micro-step (``comm.accumulation_steps``), PowerSGD's state, and the step, epoch,
position and the epoch's segments (``hvrep.data.plan``). A commit between two updates makes the accumulated
gradients (and PowerSGD's error feedback) their mean over the replicas first, as a checkpoint does, so it holds
on every worker and at any world size. On a lost worker it rolls back to that commit; on a host update it goes
on from where it stands. Either way the loop starts again in the new world: the global batch is kept (the
per-replica batch changes), the epoch goes on with the samples it has not trained on (a new segment at the
new size), and the learning rate is anchored to the samples trained, as a resume at another size does.
Each reset is one ``reset`` line in metrics.jsonl. The chief is whoever is rank 0 after the reset: it takes
over metrics.jsonl and the checkpoints.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from hvrep import elastic
from hvrep.data import Segment
from hvrep.train.controller import Controller


class ElasticLoop:
    """What the controller's loop commits and reads back in an elastic run.

    Args:
      controller: the run's controller (its ``elastic`` is set to this).
      every: ``elastic.commit_every_steps``.
      after_reset: called after each reset, before anything is written: the chief may have changed (it opens
        the chief's writers) and so has the watchdog.
      segments: the interrupted epoch's segments when resuming from a checkpoint, else [].
    """

    def __init__(self, controller: Controller, every: int, after_reset: Callable[[], None],
                 segments: list[Segment]) -> None:
        self.controller = controller
        self.every = every
        runner, loop = controller.runner, controller.state
        self.state = elastic.State(runner.repl, runner.model, runner.update_optimizer, step=int(loop.step.numpy()),
                                   epoch=int(loop.epoch.numpy()), position=int(loop.position.numpy()),
                                   segments=[s.to_json() for s in segments])
        self._after_reset = after_reset
        self.state.register_reset_callbacks([self._on_reset])
        controller.elastic = self

    def enter(self) -> list[Segment]:
        """At the loop's (re)start: the loop's variables from the state; returns the epoch's segments."""
        loop = self.controller.state
        loop.step.assign(self.state.step)
        loop.epoch.assign(self.state.epoch)
        loop.position.assign(self.state.position)
        return [Segment.from_json(s) for s in self.state.segments]

    def due(self, step: int) -> bool:
        return step % self.every == 0

    def commit(self, step: int, epoch: int, position: int, segments: list[Segment]) -> None:
        """Commits where the loop stands (every rank, at the same step); raises a host update for ``run``."""
        self.state.step, self.state.epoch, self.state.position = step, epoch, position
        self.state.segments = [s.to_json() for s in segments]
        self.state.commit()

    def _on_reset(self) -> None:
        c = self.controller
        self._after_reset()
        r = self.state.resets[-1]
        c.metrics.write("reset", int(self.state.step), why=r.why, old_world=r.old_size, new_world=r.new_size,
                        steps_rolled_back=int(r.rolled_back.get("step", 0)), seconds_lost=round(r.seconds_lost, 3),
                        work_lost_s=r.work_lost_s, reform_s=r.reform_s)
        c.metrics.say(f"hvrep train: elastic reset ({r.why}): world {r.old_size} -> {r.new_size}, "
                      f"{int(r.rolled_back.get('step', 0))} step(s) rolled back, {r.seconds_lost:.1f} s lost")

    def run(self) -> dict[str, Any]:
        """The controller's loop, through resets."""
        return elastic.run(lambda state: self.controller.run())(self.state)

