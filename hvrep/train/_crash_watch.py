"""The watcher ``hvrep.train.crash`` starts beside each rank: standalone (``python -I``, no hvrep, no TensorFlow).

argv: the pipe's read end, the rank, its pid, its step record, its faulthandler file. Waits for EOF on the
pipe (the rank ended), then prints one report on stderr if faulthandler recorded a fatal signal.
"""

import os
import re
import sys

# faulthandler's words for each fatal signal it handles (CPython's Modules/faulthandler.c).
_SIGNALS = {"Segmentation fault": "SIGSEGV", "Aborted": "SIGABRT", "Bus error": "SIGBUS",
            "Floating-point exception": "SIGFPE", "Floating point exception": "SIGFPE", "Illegal instruction": "SIGILL"}


def main(argv: list[str]) -> int:
    fd, rank, pid, step_path, stacks_path = int(argv[1]), argv[2], argv[3], argv[4], argv[5]
    while os.read(fd, 4096):
        pass
    try:
        with open(stacks_path, errors="replace") as f:
            stacks = f.read()
    except OSError:
        return 0
    found = re.search(r"Fatal Python error: ([^\n]+)", stacks)
    if not found:
        return 0  # ended without a fatal signal: nothing to add
    words = found.group(1).strip()
    signal = _SIGNALS.get(words, words)
    try:
        with open(step_path, "rb") as f:
            step = f.read().split(b"\0", 1)[0].decode(errors="replace").strip()
    except OSError:
        step = ""
    print(f"hvrep train: rank {rank} (pid {pid}) died of {signal} ({words}) in {step or 'an unknown step'}. Its "
          f"Python stacks at the crash are in {stacks_path}. A crash in native code (TensorFlow, oneDNN, Horovod), "
          "not in hvrep's Python: see docs/troubleshooting.md, \"Known issues\" (to narrow it down: train.threads=1, "
          "then TF_ENABLE_ONEDNN_OPTS=0).", file=sys.stderr, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
