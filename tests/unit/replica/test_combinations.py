"""Issue 46's combination test, in-graph: the cases of the support table's covering array
(``support.tested_cases()``) on the local backend (2 logical CPU devices), trained a few updates and compared with
their references (tests/combinations.py); the array covers every pair; and every combination the table refuses is
refused by the object that carries it before the first step.

The multi-rank twin: tests/multirank/cases_combinations.py (mpirun and horovodrun --gloo, one launch each).
"""

from __future__ import annotations

import keras
import pytest

import hvrep
import hvrep.keras
from hvrep.errors import ConfigError
from hvrep.replica import support
from hvrep.train import config as configs
from tests import combinations as combos

CASES = [c for c in support.tested_cases() if c["backend"] == "local"]


def test_the_covering_array_holds_every_pair_some_accepted_combination_holds_and_no_refused_one():
    cases = support.pairwise_cases()
    assert all(support.accepted(c) for c in cases)
    axes = list(support.AXES)

    def pairs(c: dict) -> set:
        return {((a, c[a]), (b, c[b])) for i, a in enumerate(axes) for b in axes[i + 1:]}

    possible = set()
    for c in support.all_combinations():  # ~37,000: brute force, not the generator's own search
        if support.accepted(c):
            possible |= pairs(c)
    covered = set().union(*(pairs(c) for c in cases))
    assert covered == possible, sorted(possible - covered)[:5]
    # What is trained: every pair but those only a TPU or the untestable rule hold.
    tested = set().union(*(pairs(c) for c in support.tested_cases()))
    untestable = [r.matches for r in support.NOT_TESTABLE]
    left = {p for p in possible - tested
            if ("backend", "tpu") not in p and not any(m({a: (v,) for a, v in p}) for m in untestable)}
    assert not left, sorted(left)[:5]


@pytest.mark.parametrize("case", CASES, ids=["-".join(c.values()) for c in CASES])
def test_an_accepted_combination_trains_like_its_reference(case):
    dpr = 2 if case["devices_per_replica"] == "k" else 1
    config = combos.comm_config(case)
    repl = hvrep.Replicator("local", config=config, devices_per_replica=dpr)
    other = hvrep.Replicator("local", config=config, devices_per_replica=3 - dpr) \
        if case["resume"] == "other-world" else None
    got = combos.train(repl, case, other)
    want = combos.simulate(case, repl.num_replicas, other.num_replicas if other else None)
    diff, tol = combos.difference(got, want, case)
    assert diff <= tol, (support.reference(case).describe(), diff)


def _model(precision: str = "fp32") -> keras.Model:
    try:
        return combos.make_model(precision)
    finally:
        keras.mixed_precision.set_global_policy("float32")


def _sgd() -> keras.optimizers.Optimizer:
    return keras.optimizers.SGD(0.1)


# How each rule of the table is met in the real objects, in-process; the multi-rank twin checks the horovod ones
# (bf16 compression, accumulation in fit) with a real Horovod.
def _local_sgd_and_fp16() -> None:
    repl = hvrep.Replicator("local", config=hvrep.CommConfig(local_steps=2))
    with repl.scope():
        model = _model()
        repl.wrap_optimizer(keras.optimizers.LossScaleOptimizer(_sgd()), model=model)


def _elastic_and_local_sgd() -> None:
    repl = hvrep.Replicator("local", config=hvrep.CommConfig(local_steps=2))
    with repl.scope():
        model = _model()
        opt = repl.wrap_optimizer(_sgd(), model=model)
    hvrep.elastic.State(repl, model, opt)


ENTRY_POINTS = {
    0: lambda: hvrep.CommConfig(local_steps=2, accumulation_steps=2),
    1: lambda: hvrep.CommConfig(local_steps=2, compression="fp16"),
    2: _local_sgd_and_fp16,
    3: lambda: hvrep.Replicator("local", config=hvrep.CommConfig(accumulation_steps=2)),
    4: lambda: configs.build("demo", ["train.loop=fit", "comm.accumulation_steps=2"]),
    5: lambda: support.check([support.backend_setting("horovod"),
                              *support.comm_settings(hvrep.CommConfig(compression="bf16"))], "Replicator"),
    6: lambda: hvrep.Replicator("tpu", devices_per_replica=2),
    7: lambda: support.check([support.backend_setting("local"), support.Setting("loop", ("elastic-custom",), "e")],
                             "hvrep.elastic.State"),
    8: lambda: support.check([support.backend_setting("horovod", "mpi"),
                              support.Setting("loop", ("elastic-fit",), "e")], "hvrep.elastic.State"),
    9: _elastic_and_local_sgd,
    10: lambda: configs.build("demo", ["train.loop=fit", "comm.local_steps=2"]),
    11: lambda: configs.check_combinations(configs.build("demo", ["train.loop=fit"]), elastic=True),
}


def test_every_refused_pair_is_refused_before_the_first_step():
    assert sorted(ENTRY_POINTS) == list(range(len(support.RULES))), "a rule without its check here"
    refused = support.refused_pairs(app=True)
    assert {id(rule) for *_, rule in refused} == {id(r) for r in support.RULES}
    for i, rule in enumerate(support.RULES):
        with pytest.raises(ConfigError, match=r"cannot be combined|is not supported") as e:
            ENTRY_POINTS[i]()
        assert rule.reason in str(e.value) and f"Fix: {rule.fix}" in str(e.value), (i, str(e.value))
    for (a, va), (b, vb), _ in refused:
        assert not support.accepted({a: va, b: vb}, app=True), (a, va, b, vb)
