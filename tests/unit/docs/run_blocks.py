"""Runs markdown python blocks one after another in this process and writes what each did as JSON.

    python run_blocks.py BLOCKS.json OUT_DIR        (one process, or each rank of a launch)

Each block is written to a file and run as ``__main__`` (``runpy``: its functions have a module and a source
file, as autograph needs) in a fresh working folder, with its stdout captured;
an exception is recorded, not raised (a rank that raised under ``python -m mpi4py`` would abort the job and
hide the other blocks' results). Between blocks Keras' global state is reset. Writes OUT_DIR/rank-<r>.json:
``{block id: {"ok": bool, "stdout": str, "error": str, "seconds": float, "weights": str | None}}``; a block that
leaves a Keras model named ``model`` in its globals has its final weights saved to the ``weights`` file (an
``.npz`` in OUT_DIR, in ``model.weights`` order), so runs of one block can be compared.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import runpy
import sys
import tempfile
import time
import traceback
from pathlib import Path


def _rank() -> int:
    for var in ("OMPI_COMM_WORLD_RANK", "HOROVOD_RANK", "PMI_RANK"):
        if var in os.environ:
            return int(os.environ[var])
    return 0


def _reset_keras() -> None:
    if "keras" in sys.modules:
        keras = sys.modules["keras"]
        keras.backend.clear_session()
        keras.config.set_dtype_policy("float32")


def _save_weights(namespace: dict, path: Path) -> str | None:
    """The final weights of the block's ``model`` (a Keras model), saved to ``path``; None without one."""
    model = namespace.get("model")
    keras = sys.modules.get("keras")
    if keras is None or not isinstance(model, keras.Model):
        return None
    import numpy as np

    np.savez(path, *[np.asarray(w.numpy()) for w in model.weights])
    return str(path)


def main(blocks_json: str, out_dir: str) -> None:
    blocks = json.loads(Path(blocks_json).read_text())
    results = {}
    home = os.getcwd()
    out = Path(out_dir).resolve()  # before the blocks change the working folder
    for block in blocks:
        stdout = io.StringIO()
        weights = None
        start = time.perf_counter()
        with tempfile.TemporaryDirectory(prefix="hvrep-docs-block-") as work:
            os.chdir(work)
            script = Path(work, re.sub(r"\W", "_", block["id"]) + ".py")
            script.write_text(block["code"])
            try:
                with contextlib.redirect_stdout(stdout):
                    namespace = runpy.run_path(str(script), run_name="__main__")
                weights = _save_weights(namespace, out / f"weights-rank{_rank()}-{script.stem}.npz")
                error = ""
            except BaseException:  # a block's SystemExit or KeyboardInterrupt is its failure, not the runner's
                error = traceback.format_exc()
            finally:
                os.chdir(home)
                _reset_keras()
        results[block["id"]] = {"ok": not error, "stdout": stdout.getvalue(), "error": error,
                                "seconds": round(time.perf_counter() - start, 2), "weights": weights}
    (out / f"rank-{_rank()}.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main(*sys.argv[1:])
