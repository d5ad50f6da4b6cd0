"""Where hvrep's shared-memory all-reduce applies (hvrep.replica.shm) and how it is asked for; the transport
itself runs in tests/unit/kernels/test_shm.py and on the launchers in tests/multirank/cases_shm.py."""

from __future__ import annotations

import pytest

import hvrep
from hvrep.errors import ConfigError, SetupError
from hvrep.replica import shm


def test_it_applies_to_several_ranks_on_one_host_without_a_gpu():
    assert shm.why_not(size=4, local_size=4, elastic=False, gpu=False) == ""


@pytest.mark.parametrize(("kw", "words", "differs_per_rank"), [
    ({"size": 1, "local_size": 1}, "one rank", False),
    ({"size": 16, "local_size": 8}, "16 ranks on several hosts (8 on this one)", False),
    ({"elastic": True}, "elastic", False),
    ({"gpu": True}, "GPU", True),
])
def test_why_not_names_the_reason_and_whether_ranks_must_agree(kw, words, differs_per_rank):
    args = {"size": 4, "local_size": 4, "elastic": False, "gpu": False, **kw}
    reason = shm.why_not(**args)
    assert words in reason
    assert shm.per_rank(reason) is differs_per_rank


def test_the_environment_replaces_auto_only(monkeypatch):
    monkeypatch.setenv("HVREP_LOCAL_TRANSPORT", "horovod")
    assert shm.setting("auto") == "horovod"
    assert shm.setting("shm") == "shm"  # the config's explicit choice wins
    monkeypatch.setenv("HVREP_LOCAL_TRANSPORT", "SHM")
    assert shm.setting("auto") == "shm"
    monkeypatch.setenv("HVREP_LOCAL_TRANSPORT", "nccl")
    with pytest.raises(ConfigError, match="HVREP_LOCAL_TRANSPORT='nccl' is not a local transport"):
        shm.setting("auto")
    monkeypatch.delenv("HVREP_LOCAL_TRANSPORT")
    assert shm.setting("auto") == "auto"


def test_comm_config_validates_local_transport():
    assert hvrep.CommConfig().local_transport == "auto"
    with pytest.raises(ConfigError, match="local_transport must be one of"):
        hvrep.CommConfig(local_transport="mpi")


def test_required_and_refused_raises_with_the_reason_and_auto_falls_back():
    with pytest.raises(SetupError, match="cannot apply: elastic training"):
        shm.refused("shm", shm.why_not(size=2, local_size=2, elastic=True, gpu=False))
    assert shm.refused("auto", "anything") is None


def test_a_small_dev_shm_shrinks_the_chunk_then_gives_way_to_the_temporary_folder(monkeypatch, tmp_path):
    if shm.native_shm.native() is None:
        pytest.skip("the kernels are not built: `make setup`")
    nat = shm.native_shm.native()
    monkeypatch.setattr(shm, "_SHM_DIR", str(tmp_path))

    class Fs:
        def __init__(self, free):
            self.f_bavail, self.f_frsize = free, 1

    monkeypatch.setattr(shm.os, "statvfs", lambda _: Fs(1 << 40))
    assert shm._place(8) == (str(tmp_path), shm.CAP_BYTES)
    # 4 MiB free: 8 ranks need 18 chunks; half of it holds 18 of 64 KiB, not of 128 KiB.
    monkeypatch.setattr(shm.os, "statvfs", lambda _: Fs(4 << 20))
    folder, cap = shm._place(8)
    assert folder == str(tmp_path) and cap == 64 << 10 and nat.file_bytes(8, cap) <= 2 << 20
    monkeypatch.setattr(shm.os, "statvfs", lambda _: Fs(1 << 20))
    folder, cap = shm._place(8)
    assert folder != str(tmp_path) and cap == shm.CAP_BYTES


def test_a_forked_child_does_not_close_its_parents_transport_at_exit(monkeypatch):
    # The child inherits the mapping and the native object, not the progress thread it would join.
    closed = []

    class Transport:
        def close(self):
            closed.append(True)

    monkeypatch.setattr(shm, "_open", Transport())
    monkeypatch.setattr(shm, "_open_pid", shm.os.getpid() + 1)  # opened by another process: the parent
    shm._close_at_exit()
    assert closed == []
    monkeypatch.setattr(shm, "_open_pid", shm.os.getpid())
    shm._close_at_exit()
    assert closed == [True]
