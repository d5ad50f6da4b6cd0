"""The public surface of `import hvrep`: what it names, and that it stays light until used."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from hvrep import compat


def _run(code: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)


@pytest.mark.skipif(compat.shim_path().is_file(),
                    reason="a GPU (NCCL) build of Horovod: `import hvrep` loads its stream shim, which needs TF")
def test_import_hvrep_does_not_import_tensorflow_until_a_name_needs_it():
    res = _run("import sys, hvrep\n"
               "print('tensorflow' in sys.modules, hvrep.__version__, hvrep.resolve_placement.__name__)\n"
               "hvrep.Replicator\n"
               "print('tensorflow' in sys.modules)\n")
    assert res.returncode == 0, res.stderr[-2000:]
    before, after = res.stdout.split("\n")[:2]
    assert before.startswith("False ") and after == "True", res.stdout


def test_every_public_name_resolves_and_unknown_names_say_so():
    import hvrep

    for name in hvrep.__all__:
        assert getattr(hvrep, name) is not None, name
    assert set(hvrep.__all__) <= set(dir(hvrep))
    from hvrep.replica.api import Replicator

    assert hvrep.Replicator is Replicator
    with pytest.raises(AttributeError, match="no attribute 'Replicatr'"):
        hvrep.Replicatr  # noqa: B018
