"""The compat layer: its headers really compile against TF 2.21's, its shim exports
what Horovod's NCCL build needs, and its cache keys follow what went into a build."""

from __future__ import annotations

import importlib.metadata as md
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from hvrep import compat
from hvrep.compat import _wheels, build_horovod, horovod_patches
from hvrep.errors import SetupError

CXX = shutil.which("c++") or shutil.which("g++")
needs_cxx = pytest.mark.skipif(CXX is None, reason="no C++ compiler on PATH")

# The TensorFlow headers Horovod 0.28.1's TensorFlow sources include
# (horovod/tensorflow/mpi_ops.cc and xla_mpi_ops.cc).
HOROVOD_TF_INCLUDES = """
#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/shape_inference.h"
#include "tensorflow/core/framework/common_shape_fns.h"
#include "tensorflow/core/framework/resource_mgr.h"
#include "tensorflow/core/framework/resource_var.h"
#include "tensorflow/core/kernels/training_op_helpers.h"
#include "tensorflow/compiler/tf2xla/xla_op_kernel.h"
#include "tensorflow/compiler/tf2xla/xla_op_registry.h"
#include "tensorflow/compiler/xla/client/xla_builder.h"
#include "tensorflow/compiler/xla/service/custom_call_target_registry.h"
#include "tensorflow/compiler/xla/shape.h"
#include "tensorflow/core/lib/hash/hash.h"
#include "tensorflow/core/platform/human_readable_json.h"
#include "tensorflow/core/platform/strong_hash.h"
"""


@pytest.fixture(scope="module")
def tf_flags() -> tuple[list[str], list[str]]:
    import tensorflow as tf

    return tf.sysconfig.get_compile_flags(), tf.sysconfig.get_link_flags()


def _compile(source: str, flags: list[str], tmp_path: Path, extra: list[str] = ()) -> subprocess.CompletedProcess:
    src = tmp_path / "t.cc"
    src.write_text(source)
    return subprocess.run([CXX, "-fsyntax-only", "-w", *flags, *extra, str(src)], capture_output=True, text=True)


@needs_cxx
def test_horovods_tf_includes_compile_with_the_forwarding_header_and_standins(tf_flags, tmp_path):
    includes = [f"-I{compat.FORWARD_INCLUDE_DIR}", f"-I{compat.STANDIN_INCLUDE_DIR}"]
    res = _compile(HOROVOD_TF_INCLUDES, tf_flags[0], tmp_path, includes)
    assert res.returncode == 0, res.stderr[-3000:]


@needs_cxx
def test_without_the_forwarding_header_the_old_xla_path_is_missing(tf_flags, tmp_path):
    # Proves the forwarding header is what makes the build work (TF moved the file).
    res = _compile('#include "tensorflow/compiler/xla/client/xla_builder.h"\n', tf_flags[0], tmp_path)
    assert res.returncode != 0 and "xla_builder.h" in res.stderr


@needs_cxx
@pytest.mark.skipif(build_horovod.debian_hash_headers_present(), reason="Debian hash headers are installed")
def test_without_standins_tfs_headers_do_not_compile_here(tf_flags, tmp_path):
    res = _compile('#include "tensorflow/core/platform/strong_hash.h"\n', tf_flags[0], tmp_path)
    assert res.returncode != 0 and "highwayhash" in res.stderr


@needs_cxx
def test_gpu_compat_header_aliases_statusor_and_is_inert_without_tf(tf_flags, tmp_path):
    uses_alias = (
        "#include <type_traits>\n"
        "static_assert(std::is_same_v<xla::StatusOr<int>, absl::StatusOr<int>>);\n"
    )
    forced = ["-include", str(compat.GPU_COMPAT_HEADER)]
    res = _compile(uses_alias, tf_flags[0], tmp_path, forced)
    assert res.returncode == 0, res.stderr[-2000:]
    # Gloo's sources see the same CXXFLAGS without TensorFlow's include path.
    res = _compile("int main() { return 0; }\n", [], tmp_path, forced)
    assert res.returncode == 0, res.stderr[-2000:]


@needs_cxx
def test_stream_shim_exports_the_symbol_horovods_nccl_build_imports(tf_flags, tmp_path):
    out = tmp_path / "shim.so"
    cmd = [CXX, "-O0", "-fPIC", "-shared", "-w", *tf_flags[0], f"-I{compat.STANDIN_INCLUDE_DIR}",
           str(compat.STREAM_SHIM_SOURCE), "-o", str(out), *tf_flags[1]]
    res = subprocess.run(cmd, capture_output=True, text=True)
    assert res.returncode == 0, res.stderr[-3000:]
    symbols = subprocess.run(["nm", "-D", "--defined-only", str(out)], capture_output=True, text=True).stdout
    # The exact name from the undefined-symbol error of an unshimmed NCCL build.
    assert "_ZN15stream_executor3gpu16AsGpuStreamValueEPNS_6StreamE" in symbols


def test_debian_header_detection_follows_the_include_path(tmp_path, monkeypatch):
    for header in ("farmhash.h", "highwayhash/sip_hash.h", "highwayhash/highwayhash.h"):
        (tmp_path / header).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / header).write_text("// test\n")
    monkeypatch.setenv("CPATH", str(tmp_path))
    assert build_horovod.debian_hash_headers_present()
    (tmp_path / "highwayhash" / "sip_hash.h").unlink()
    if not any((Path(d) / "highwayhash/sip_hash.h").is_file() for d in ("/usr/include", "/usr/local/include")):
        assert not build_horovod.debian_hash_headers_present()


def test_cache_key_changes_with_a_compat_header(tmp_path, monkeypatch):
    copy = tmp_path / "include"
    shutil.copytree(compat.INCLUDE_DIR, copy)
    monkeypatch.setattr(build_horovod, "INCLUDE_DIR", copy)
    before = build_horovod._compat_hash()
    assert before == build_horovod._compat_hash()
    (copy / "standins" / "farmhash.h").write_text("// changed\n")
    assert build_horovod._compat_hash() != before


def test_cache_key_names_every_input():
    plan = build_horovod.make_plan("off")
    assert plan.key.startswith(f"horovod-{compat.HOROVOD_VERSION}-tf{plan.tf_version}-cp311-")
    assert plan.key.endswith(f"-cpu-{plan.compat_hash}")
    assert build_horovod.make_plan("on").key.replace("-nccl-", "-cpu-") == plan.key


def test_publish_replaces_atomically_and_leaves_no_staging(tmp_path):
    wheel = tmp_path / "pkg-1.0-py3-none-any.whl"
    wheel.write_bytes(b"new")
    dest = tmp_path / "cache" / "key"
    dest.mkdir(parents=True)
    (dest / "stale.whl").write_bytes(b"old")
    published = _wheels.publish(wheel, dest)
    assert published.read_bytes() == b"new"
    assert sorted(p.name for p in dest.iterdir()) == [wheel.name]
    assert sorted(p.name for p in dest.parent.iterdir()) == ["key"]


def test_this_environment_holds_the_horovod_its_plan_asks_for():
    # make setup installed Horovod through build_horovod; the marker must match a fresh plan.
    assert md.version("horovod") == compat.HOROVOD_VERSION
    assert _wheels.is_current("horovod", build_horovod.installed_key(build_horovod.make_plan("auto")))
    hvd = compat.import_horovod()
    assert hvd.mpi_built() and hvd.gloo_built()


def test_cache_key_changes_with_the_horovod_patch(monkeypatch):
    before = build_horovod._compat_hash()
    old, new, *_ = horovod_patches.PATCHES[0][1:]
    monkeypatch.setattr(horovod_patches, "PATCHES", (("horovod/common/tensor_queue.h", old, new + "// x\n"),))
    assert build_horovod._compat_hash() != before


def _fake_sdist(root: Path, drop: int | None = None) -> None:
    """A tree holding each piece the patch replaces (all but piece ``drop``), among other text. A piece that
    replaces text an earlier piece puts in (FLUSH_PATCHES builds on the idle wait's) is not written: the earlier
    piece writes it."""
    written: dict[Path, str] = {}
    patched: dict[Path, str] = {}  # `written` as the earlier pieces leave it
    for i, (rel, old, new) in enumerate(horovod_patches.PATCHES):
        path = root / rel
        text = written.get(path, "// Horovod 0.28.1\n")
        after = patched.get(path, text)
        if i != drop and after.count(old) != 1:
            text, after = text + old + "// more\n", after + old + "// more\n"
        written[path], patched[path] = text, after.replace(old, new)
    for path, text in written.items():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def _rewritten_later(i: int) -> bool:
    """Whether a later piece replaces part of piece ``i``'s text."""
    rel, _, new = horovod_patches.PATCHES[i]
    return any(r == rel and any(ln.strip() and ln in new for ln in old.splitlines())
               for r, old, _ in horovod_patches.PATCHES[i + 1:])


def test_the_horovod_patch_replaces_each_piece_once(tmp_path):
    _fake_sdist(tmp_path)
    changed = horovod_patches.apply(tmp_path)
    assert changed == sorted({rel for rel, _, _ in horovod_patches.PATCHES})
    for i, (rel, old, new) in enumerate(horovod_patches.PATCHES):
        text = (tmp_path / rel).read_text()
        if not _rewritten_later(i):
            assert new in text and text.count(old) == new.count(old), rel  # left only where the new text keeps it
    # Each of FLUSH_PATCHES' pieces is in the result (none is rewritten by a later one).
    for rel, _, new in horovod_patches.FLUSH_PATCHES:
        assert new in (tmp_path / rel).read_text(), rel
    # Applied again, pieces are gone: refused, not patched twice.
    with pytest.raises(SetupError, match="found it 0 times"):
        horovod_patches.apply(tmp_path)


def test_another_horovod_source_is_refused_with_the_file_and_the_fix(tmp_path):
    _fake_sdist(tmp_path, drop=len(horovod_patches.PATCHES) - 1)
    before = {p: p.read_text() for p in tmp_path.rglob("*") if p.is_file()}
    with pytest.raises(SetupError, match=r"(?s)operations\.cc.*found it 0 times.*Fix: build Horovod 0\.28\.1"):
        horovod_patches.apply(tmp_path)
    assert before == {p: p.read_text() for p in tmp_path.rglob("*") if p.is_file()}  # nothing half-patched


def test_the_installed_horovod_is_the_patched_build():
    # The waiting background thread (tests/multirank/test_horovod_idle.py shows what it does) is compiled in.
    hvd = compat.import_horovod()
    libs = list(Path(hvd.__file__).parent.glob("mpi_lib*.so"))
    assert libs, Path(hvd.__file__).parent
    assert horovod_patches.MARKER in libs[0].read_bytes()
    assert horovod_patches.installed() is True


def test_a_bad_idle_wait_is_named_with_the_fix_and_the_default_holds():
    script = ("import tensorflow as tf\nfrom hvrep import compat\nhvd = compat.import_horovod()\nhvd.init()\n"
              "print('SUM', float(hvd.allreduce(tf.constant(2.0), op=hvd.Sum)))\nhvd.shutdown()\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMPI_", "PMI_", "HOROVOD_"))}
    res = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                         env={**env, "HVREP_HOROVOD_IDLE_WAIT_MS": "20ms", "TF_CPP_MIN_LOG_LEVEL": "2"})
    assert res.returncode == 0 and "SUM 2.0" in res.stdout, res.stderr[-3000:]
    assert "HVREP_HOROVOD_IDLE_WAIT_MS=20ms is not a whole number of milliseconds >= 0; waiting at most 20 ms. " \
           "Fix: unset it, or 0 to cycle as stock Horovod does." in res.stderr, res.stderr[-3000:]
