"""The fault campaign's bad-data, stopped-rank and D4PG kinds (benchmarks/_faults/{data,sigstop,d4pg}.py), one
injection of each at a fixed point, with the campaign's own checks of "nothing lost" (docs/reliability.md):

- a corrupt JPEG met at step 4 with data.on_error=raise: exit 2 naming the file; put back, ``--resume`` ends
  with the weights of an uninterrupted run, bit for bit; with on_error=skip the run ends and names the file;
- a TFRecord shard cut short after a first segment: ``--resume`` stops with exit 2 naming it; put back, the
  weights of an uninterrupted run;
- SIGSTOP of one rank in the custom loop under mpirun (rank 1) and horovodrun --gloo (rank 0, the watchdog's
  host): every rank ends (exit 75 / horovodrun's 1), the checkpoints are intact, ``--resume`` gives the
  uninterrupted run's weights bit for bit;
- D4PG: every actor stopped (restarted after actor_timeout_s, the run completes), the learner SIGKILLed with an
  actor stopped under mpirun (actors end with it, the next start removes its replay from /dev/shm, resume).

Each injection is a ``kind.run`` of the campaign, 3 at a time (threads: most of it is waiting on processes);
each test waits for its own. Every one also checks that no process of its run is left behind.
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor

import pytest

pytestmark = pytest.mark.multirank

# (kind module, kind name, point, launcher): fixed points, each of the grammar the kind's points() draws from.
INJECTIONS = {
    "sigstop_mpirun": ("sigstop", "sigstop", "custom:rank=1:step=5", "mpirun"),
    "sigstop_horovodrun": ("sigstop", "sigstop", "custom:rank=0:step=4", "horovodrun"),
    "learner_killed_mpirun": ("d4pg", "d4pg", "learner_killed:step=100:stopped_actor=0", "mpirun"),
    "corrupt_jpeg_raise": ("data", "corrupt_jpeg", "raise:sample=200", "local"),
    "truncated_tfrecord": ("data", "truncated_tfrecord", "raise:shard=2:record=40:at=4", "local"),
    "actors_stopped": ("d4pg", "d4pg", "actors_stopped:step=75", "local"),
    "corrupt_jpeg_skip": ("data", "corrupt_jpeg", "skip:sample=300", "local"),
}


def _inject(name: str, base) -> object:
    import importlib

    from benchmarks._faults import Injection

    module, kind_name, point, launcher = INJECTIONS[name]
    (kind,) = [k for k in importlib.import_module(f"benchmarks._faults.{module}").KINDS if k.name == kind_name]
    grammar = {p.split("=")[0] for p in kind.points(random.Random(0))}
    assert point.split("=")[0] in grammar, (point, grammar)
    return kind.run(Injection(kind=kind_name, point=point, seed=0, launcher=launcher), base / name / "s0")


@pytest.fixture(scope="module")
def outcome(request, tmp_path_factory) -> Iterator[Callable[[str], object]]:
    """``get(name)``: that injection's Outcome; the first call starts every selected one, 3 at a time."""
    wanted = [item.callspec.params["name"] for item in request.session.items
              if item.module is request.module and hasattr(item, "callspec")]
    futures: dict[str, Future] = {}
    with ThreadPoolExecutor(max_workers=3) as pool:

        def get(name: str):
            if not futures:
                base = tmp_path_factory.mktemp("faults")
                for each in [n for n in INJECTIONS if n in wanted]:  # in order: the long SIGSTOP launches first
                    futures[each] = pool.submit(_inject, each, base)
            return futures[name].result()

        yield get


# The first test waits for the first 3 injections (a SIGSTOP one: 3 launches of 2 ranks and the timeout).
@pytest.mark.timeout(900)
@pytest.mark.parametrize("name", list(INJECTIONS))
def test_nothing_is_lost(outcome, name):
    got = outcome(name)
    report = dataclasses.asdict(got)
    assert got.lost == [], report
    assert got.exit_code == got.expected_exit, report
    assert got.recovered, report
    _, _, point, _ = INJECTIONS[name]
    if point.startswith(("custom", "raise")):
        assert got.steps_lost <= 2, report  # the checkpoint interval: checkpoint.every_steps=2
