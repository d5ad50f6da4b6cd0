"""Importing TensorFlow without its start-up chatter (``hvrep train`` without ``--verbose``).

TensorFlow 2.21 prints its oneDNN notice ("oneDNN custom operations are on ...", from each of its two native
libraries) and absl's "All log messages before absl::InitializeLog() ..." while it is imported, before absl's
logging starts, so ``TF_CPP_MIN_LOG_LEVEL`` does not filter them. They are written to file descriptor 2
directly; this module points that descriptor at a temporary file for the import and writes back every line
that is not one of them. oneDNN itself stays on (``TF_ENABLE_ONEDNN_OPTS=0`` would change the numerics).
"""

from __future__ import annotations

import os
import re
import sys
import tempfile

from hvrep import _env

# The lines the import prints on every start (TensorFlow 2.21 on x86; a notice that is absent is no matter).
_CHATTER = re.compile(
    r"WARNING: All log messages before absl::InitializeLog\(\) is called are written to STDERR"
    r"|^I\d{4} .*(oneDNN custom operations are on|This TensorFlow binary is optimized)"
    r"|^To enable the following instructions:")


def import_tensorflow_quietly() -> None:
    """Imports tensorflow and keras with C++ logging at errors only and the import's notices dropped."""
    _env.quiet_tensorflow_logs()
    if "tensorflow" in sys.modules:
        return
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as caught:
        os.dup2(caught.fileno(), 2)
        try:
            import keras  # noqa: F401  (imports tensorflow)
            import tensorflow  # noqa: F401
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            caught.seek(0)
            rest = [line for line in caught.read().decode(errors="replace").splitlines(keepends=True)
                    if not _CHATTER.search(line)]
            sys.stderr.write("".join(rest))
            sys.stderr.flush()
    from absl import logging as absl_logging

    absl_logging.set_verbosity(absl_logging.ERROR)
