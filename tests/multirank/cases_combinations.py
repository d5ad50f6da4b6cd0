"""Issue 46's combination test on 2 horovod ranks (see runner.py; the in-graph twin:
tests/unit/replica/test_combinations.py): the support table's covering array of the launch's backend (horovod
over MPI under mpirun, over Gloo under horovodrun --gloo), each case trained a few updates and compared with its
reference (tests/combinations.py); and the refusals that need a real Horovod.

The array is ``hvrep.replica.support.tested_cases()``, shared with the in-graph test: each case runs where its
backend does. A resume at another world size goes on in this process alone (a local Replicator of one replica
over the 2 logical CPU devices below, the global batch kept): one launch has one world.
"""

import tensorflow as tf

# devices_per_replica = k: a rank without GPUs spans its first k logical CPU devices. Before TensorFlow starts
# its runtime (this module is its launch's first).
_cpus = tf.config.list_physical_devices("CPU")
try:
    tf.config.set_logical_device_configuration(_cpus[0], [tf.config.LogicalDeviceConfiguration()] * 2)
except RuntimeError:  # already started: the devices_per_replica = k cases say so
    pass

import keras  # noqa: E402
import numpy as np  # noqa: E402

import hvrep  # noqa: E402
import hvrep.keras  # noqa: E402
from hvrep.errors import ConfigError  # noqa: E402
from hvrep.replica import support  # noqa: E402
from tests import combinations as combos  # noqa: E402

_repls: dict = {}


def _repl(config, dpr: int = 1):
    if (config, dpr) not in _repls:
        _repls[config, dpr] = hvrep.Replicator("horovod", config=config, devices_per_replica=dpr)
    return _repls[config, dpr]


def _backend() -> str:
    return support.backend_setting("horovod", _repl(hvrep.CommConfig())._backend.controller).values[0]


def case_every_combination_of_the_covering_array_trains_like_its_reference():
    backend = _backend()
    cases = [c for c in support.tested_cases() if c["backend"] == backend]
    assert len(cases) >= 5, cases
    failures = []
    for case in cases:
        dpr = 2 if case["devices_per_replica"] == "k" else 1
        config = combos.comm_config(case)
        repl = _repl(config, dpr)
        other = None
        if case["resume"] == "other-world":
            other = hvrep.Replicator("local", config=config, devices_per_replica=len(tf.config.list_logical_devices(
                "CPU")))
        got = combos.train(repl, case, other)
        want = combos.simulate(case, repl.num_replicas, other.num_replicas if other else None)
        diff, tol = combos.difference(got, want, case)
        flat = np.concatenate([np.ravel(g) for g in got])
        spread = float(np.max(np.abs(repl.reduce(flat, "max") - repl.reduce(flat, "min"))))  # ranks agree
        line = (f"{' '.join(case.values())}: {support.reference(case).describe()}: {diff:.3g} "
                f"(ranks differ by {spread:.3g})")
        print("combination", line, flush=True)
        if not diff <= tol or spread != 0.0:
            failures.append(line)
    assert not failures, "trained unlike the reference:\n" + "\n".join(failures)


def case_refused_combinations_that_need_horovod_are_refused_before_the_first_step():
    try:
        hvrep.Replicator("horovod", config=hvrep.CommConfig(compression="bf16"))
    except ConfigError as e:
        assert "bfloat16" in str(e) and "Fix:" in str(e), e
    else:
        raise AssertionError("bf16 compression was accepted on horovod")
    # Keras' fit through DistributedOptimizer would update every micro-batch: it ignored accumulation_steps.
    repl = _repl(hvrep.CommConfig(accumulation_steps=2))
    with repl.scope():
        model = combos.make_model("fp32")
    try:
        hvrep.keras.DistributedOptimizer(keras.optimizers.SGD(0.1), repl)
    except ConfigError as e:
        assert "accumulation_steps=2 with loop=fit cannot be combined" in str(e), e
    else:
        raise AssertionError("DistributedOptimizer accepted accumulation_steps=2")
    assert model.built
