"""The one change hvrep makes to Horovod 0.28.1's C++: its background thread waits for work instead of cycling.

Horovod's background thread runs a cycle every ``HOROVOD_CYCLE_TIME`` (1 ms) for as long as Horovod is up, and
every cycle is a collective among all ranks (a bitwise AND of the response cache's bits, then the negotiation),
whether or not any rank has a tensor to reduce. Under Gloo that collective is a TCP exchange: each cycle wakes
Gloo's event-loop thread and Horovod's thread on every rank, several times. A rank whose training step keeps its
core busy pays for those wake-ups out of its step: on the 2-rank demo (one core per rank, one gradient all-reduce
per ~45 ms step) Gloo's loop and Horovod's thread took about a tenth of each core, and the step's one all-reduce
waited 2.4 ms (median) on the peer's threads being scheduled (Horovod timeline; ``mpirun``: 0.14 ms).

With this patch, a cycle that would find nothing pending on this process (every process set's tensor table and
message queue empty) first waits, on a condition variable, until a tensor is enqueued, Horovod shuts down, or
``HVREP_HOROVOD_IDLE_WAIT_MS`` (default 20; a value that is not a whole number >= 0 gets a warning and the
default) passes. A tensor's arrival starts the cycle's clock, so Horovod's
fusion window (one cycle) is kept: tensors enqueued within a cycle of the first still share one collective.

Why this is safe: the protocol is unchanged. A waiting rank joins the cycle's collective when it has a tensor,
which is when the other ranks need it (they wait in that collective for it, as they waited for its tensor before),
or at the timeout: a peer that needs a rank with nothing to give (an error response, a stall check, the
coordinator's bookkeeping) waits at most that long. Not used (stock cycling) while a process set has joined
(``hvd.join``: the joined rank must answer every cycle with zeros), with more than the global process set (a
rank outside a busy set still meets its members in each cycle's collectives of the global set: waiting, it
would hold every cycle of theirs up), with dynamic process sets, while Horovod's autotuner runs, or with
``HVREP_HOROVOD_IDLE_WAIT_MS=0``. ``hvd.shutdown()`` wakes the thread at once.

Each patch replaces one exact piece of Horovod 0.28.1's source; a piece that is not there (another version) stops
the build with a message instead of building something else. ``build_horovod`` hashes this file into the wheel's
cache key.
"""

from __future__ import annotations

from pathlib import Path

from hvrep.errors import SetupError

# (file under the sdist's root, the exact text in Horovod 0.28.1, what replaces it)
PATCHES: tuple[tuple[str, str, str], ...] = (
    ("horovod/common/tensor_queue.h",
     "#include <iostream>\n#include <mutex>\n#include <queue>\n",
     "#include <atomic>\n#include <chrono>\n#include <cstdint>\n#include <iostream>\n#include <mutex>\n"
     "#include <queue>\n"),
    ("horovod/common/tensor_queue.h",
     "  void RemoveJoinTensor();\n\nprotected:\n",
     "  void RemoveJoinTensor();\n\n"
     "  // hvrep: no tensor waits in this queue (see WaitForTensorEnqueued).\n"
     "  bool IsEmpty() const;\n\nprotected:\n"),
    ("horovod/common/tensor_queue.h",
     "  mutable std::mutex mutex_;\n};\n\n} // namespace common\n",
     "  mutable std::mutex mutex_;\n};\n\n"
     "// hvrep (hvrep/compat/horovod_patches.py): the background thread waits for work instead of cycling.\n"
     "// Counts tensors enqueued on any queue of this process and wakes a waiting background thread.\n"
     "void NotifyTensorEnqueued();\n"
     "// The count so far.\n"
     "uint64_t TensorsEnqueued();\n"
     "// Waits until the count differs from `seen`, `shut_down` is set, or `timeout` passes; true if a tensor came.\n"
     "bool WaitForTensorEnqueued(uint64_t seen, std::chrono::milliseconds timeout,\n"
     "                           const std::atomic_bool& shut_down);\n\n"
     "} // namespace common\n"),
    ("horovod/common/tensor_queue.cc",
     '#include <assert.h>\n',
     '#include <assert.h>\n#include <condition_variable>\n'),
    ("horovod/common/tensor_queue.cc",
     "  message_queue_.push(std::move(message));\n  return Status::OK();\n}\n",
     "  message_queue_.push(std::move(message));\n  NotifyTensorEnqueued();\n  return Status::OK();\n}\n"),
    ("horovod/common/tensor_queue.cc",
     "    message_queue_.push(std::move(messages[i]));\n  }\n  return Status::OK();\n}\n",
     "    message_queue_.push(std::move(messages[i]));\n  }\n  NotifyTensorEnqueued();\n  return Status::OK();\n}\n"),
    ("horovod/common/tensor_queue.cc",
     "// Remove JoinOp tensor from the table and execute the callback\n",
     "bool TensorQueue::IsEmpty() const {\n"
     "  std::lock_guard<std::mutex> guard(mutex_);\n"
     "  return tensor_table_.empty() && message_queue_.empty();\n"
     "}\n\n"
     "namespace {\n"
     "std::mutex hvrep_idle_mutex;\n"
     "std::condition_variable hvrep_idle_cv;\n"
     "uint64_t hvrep_enqueued = 0; // guarded by hvrep_idle_mutex\n"
     "} // namespace\n\n"
     "void NotifyTensorEnqueued() {\n"
     "  {\n"
     "    std::lock_guard<std::mutex> guard(hvrep_idle_mutex);\n"
     "    ++hvrep_enqueued;\n"
     "  }\n"
     "  hvrep_idle_cv.notify_all();\n"
     "}\n\n"
     "uint64_t TensorsEnqueued() {\n"
     "  std::lock_guard<std::mutex> guard(hvrep_idle_mutex);\n"
     "  return hvrep_enqueued;\n"
     "}\n\n"
     "bool WaitForTensorEnqueued(uint64_t seen, std::chrono::milliseconds timeout,\n"
     "                           const std::atomic_bool& shut_down) {\n"
     "  std::unique_lock<std::mutex> lock(hvrep_idle_mutex);\n"
     "  hvrep_idle_cv.wait_for(lock, timeout, [&] { return hvrep_enqueued != seen || shut_down.load(); });\n"
     "  return hvrep_enqueued != seen;\n"
     "}\n\n"
     "// Remove JoinOp tensor from the table and execute the callback\n"),
    ("horovod/common/operations.cc",
     "bool RunLoopOnce(HorovodGlobalState& state) {\n"
     "  // This delay determines thread frequency and communication message latency\n",
     "// hvrep (hvrep/compat/horovod_patches.py): with nothing pending on this process, wait for a tensor (or\n"
     "// HVREP_HOROVOD_IDLE_WAIT_MS, default 20; 0: cycle as stock Horovod does) instead of running a cycle.\n"
     "static long HvrepIdleWaitMs() {\n"
     "  static const long ms = [] {\n"
     "    const char* v = std::getenv(\"HVREP_HOROVOD_IDLE_WAIT_MS\");\n"
     "    if (v == nullptr || *v == '\\0') {\n"
     "      return 20L;\n"
     "    }\n"
     "    char* end = nullptr;\n"
     "    const long parsed = std::strtol(v, &end, 10);\n"
     "    if (*end != '\\0' || parsed < 0) {\n"
     "      LOG(WARNING) << \"HVREP_HOROVOD_IDLE_WAIT_MS=\" << v\n"
     "                   << \" is not a whole number of milliseconds >= 0; waiting at most 20 ms. Fix: \"\n"
     "                   << \"unset it, or 0 to cycle as stock Horovod does.\";\n"
     "      return 20L;\n"
     "    }\n"
     "    return parsed;\n"
     "  }();\n"
     "  return ms;\n"
     "}\n\n"
     "static void HvrepWaitWhileIdle(HorovodGlobalState& state) {\n"
     "  const long ms = HvrepIdleWaitMs();\n"
     "  if (ms <= 0 || state.shut_down || state.dynamic_process_sets ||\n"
     "      state.parameter_manager.IsAutoTuning()) {\n"
     "    return;\n"
     "  }\n"
     "  // With several process sets, a rank outside a busy one still meets its members in every cycle's\n"
     "  // collectives of the global set: it must keep cycling.\n"
     "  const auto ids = state.process_set_table.Ids();\n"
     "  if (ids.size() != 1) {\n"
     "    return;\n"
     "  }\n"
     "  const uint64_t seen = TensorsEnqueued();\n"
     "  for (auto id : ids) {\n"
     "    auto& process_set = state.process_set_table.Get(id);\n"
     "    if (!process_set.initialization_done || process_set.joined ||\n"
     "        !process_set.tensor_queue.IsEmpty()) {\n"
     "      return;\n"
     "    }\n"
     "  }\n"
     "  if (WaitForTensorEnqueued(seen, std::chrono::milliseconds(ms), state.shut_down)) {\n"
     "    // The first tensor opens the cycle: those enqueued within one cycle time still fuse with it.\n"
     "    state.last_cycle_start = std::chrono::steady_clock::now();\n"
     "  }\n"
     "}\n\n"
     "bool RunLoopOnce(HorovodGlobalState& state) {\n"
     "  HvrepWaitWhileIdle(state);\n"
     "  // This delay determines thread frequency and communication message latency\n"),
    ("horovod/common/operations.cc",
     "    horovod_global.shut_down = true;\n    horovod_global.background_thread.join();\n",
     "    horovod_global.shut_down = true;\n    NotifyTensorEnqueued(); // hvrep: wake a waiting background thread\n"
     "    horovod_global.background_thread.join();\n"),
)

# Names the patch set in logs; the cache key hashes PATCHES themselves.
PATCH_ID = "idlewait3"
# A string only the patched library holds (the variable its background thread reads).
MARKER = b"HVREP_HOROVOD_IDLE_WAIT_MS"


def installed() -> bool | None:
    """Whether the installed Horovod's TensorFlow library is built with :data:`PATCHES`; None without Horovod."""
    import importlib.util

    spec = importlib.util.find_spec("horovod")
    if spec is None or spec.origin is None:
        return None
    libs = sorted((Path(spec.origin).parent / "tensorflow").glob("mpi_lib*.so"))
    return bool(libs) and MARKER in libs[0].read_bytes()


def apply(source_root: Path) -> list[str]:
    """Applies :data:`PATCHES` to an unpacked Horovod sdist; returns the files changed.

    Raises:
      SetupError: a piece to replace is missing or not unique (not Horovod 0.28.1's source).
    """
    changed: dict[Path, str] = {}
    for rel, old, new in PATCHES:
        path = source_root / rel
        text = changed.get(path) if path in changed else path.read_text()
        count = text.count(old)
        if count != 1:
            raise SetupError(
                f"{path}: hvrep's Horovod patch expects this text exactly once, found it {count} times:\n{old}\n"
                "The sdist is not Horovod 0.28.1's. Fix: build Horovod 0.28.1 (`make setup`), or update "
                "hvrep/compat/horovod_patches.py for this version.")
        changed[path] = text.replace(old, new)
    for path, text in changed.items():
        path.write_text(text)
    return sorted(str(p.relative_to(source_root)) for p in changed)
