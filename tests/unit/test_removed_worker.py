"""hvrep.compat.removed_worker: a C++ exception nothing catches in a thread (Horovod's "removed from elastic job"
in hvd.init()) ends the process with one line, not libstdc++'s abort. A real uncaught throw, from a library
compiled here (skipped without g++)."""

from __future__ import annotations

import shutil
import subprocess
import sys

import pytest

THROWER = r"""
#include <stdexcept>
#include <string>
#include <thread>
extern "C" void throw_in_thread(const char* msg) {
  std::string m(msg);
  std::thread t([m] { throw std::runtime_error(m); });
  t.join();
}
"""


@pytest.fixture(scope="module")
def thrower(tmp_path_factory) -> str:
    if shutil.which("g++") is None:
        pytest.skip("no g++ to compile the throwing library")
    folder = tmp_path_factory.mktemp("thrower")
    (folder / "thrower.cc").write_text(THROWER)
    subprocess.run(["g++", "-shared", "-fPIC", "-pthread", "-o", str(folder / "libthrower.so"),
                    str(folder / "thrower.cc")], check=True, timeout=120)
    return str(folder / "libthrower.so")


def _throw(library: str, message: str, guarded: bool) -> subprocess.CompletedProcess:
    code = (f"import ctypes\nfrom hvrep.compat.removed_worker import one_line_on_removal\n"
            f"lib = ctypes.CDLL({library!r})\n"
            + ("with one_line_on_removal('hvrep: elastic worker'):\n    " if guarded else "")
            + f"lib.throw_in_thread({message.encode()!r})\nprint('not reached')\n")
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)


def test_a_removed_worker_exits_0_with_one_line(thrower):
    unguarded = _throw(thrower, "localhost[1] has been removed from elastic job", guarded=False)
    assert unguarded.returncode != 0 and "terminate called after throwing" in unguarded.stderr  # what Horovod does
    res = _throw(thrower, "localhost[1] has been removed from elastic job", guarded=True)
    assert res.returncode == 0 and res.stdout == "", (res.returncode, res.stdout, res.stderr)
    assert res.stderr.splitlines() == [
        "hvrep: elastic worker: the elastic driver dropped this worker (localhost[1] has been removed from elastic "
        "job: the host discovery script no longer lists its host); it exits, the job goes on without it"]


def test_another_exception_there_exits_1_naming_it(thrower):
    res = _throw(thrower, "Connection closed by peer", guarded=True)
    assert res.returncode == 1 and res.stderr.splitlines() == [
        "hvrep: elastic worker: Horovod failed while the elastic world re-formed: std::runtime_error: Connection "
        "closed by peer"], res.stderr
