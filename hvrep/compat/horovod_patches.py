"""hvrep's changes to Horovod 0.28.1's C++: the background thread waits for work instead of cycling, hvrep's own
reductions skip the fusion window, a lone all-reduce runs in its input's buffer, and small Gloo all-reduces take
Gloo's halving-doubling algorithm.

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

**hvrep's own reductions skip the fusion window** (``FLUSH_PATCHES``). Horovod waits one ``HOROVOD_CYCLE_TIME``
(1 ms) after a cycle starts before the next reads its queue, so that tensors enqueued close together fuse into
one collective; a woken thread too waits a cycle from the first tensor. hvrep fuses its reductions itself (its
buckets: ``hvrep.all_reduce``, ``wrap_optimizer``'s gradients, PowerSGD's P and Q, local SGD's averaging), so for
them the window is only latency: at 16 KB under ``mpirun`` it was 1-2 ms of a 1.4-2.4 ms all-reduce
(docs/performance.md, "Small steps"). Their ops carry ``FLUSH_NAME`` in their name (in a traced step: an eager
op's name does not reach Horovod's C++, which sees the op type, so hvrep's eager collectives keep the window);
enqueueing one (with ``HVREP_HOROVOD_FLUSH`` unset or not ``0``, read at each such enqueue, so a benchmark can
switch it between steps) ends the wait of a thread that sleeps out the window, or has just been woken: the
cycle starts at once. Tensors without the marker (a user's own ``hvd.allreduce``) keep the window: they fuse as
before, unless a marked tensor cuts the window they are waiting in short.
Why this is safe: the protocol is unchanged, only when a rank starts its next cycle. Every cycle is a
collective of all ranks, so a rank that starts early waits in it for the others; tensors a rank has not yet
enqueued are negotiated in a later cycle, as they are when they miss a window. A peer that has its tensor
but sleeps out a window started before the tensor arrived is woken by its own marked enqueue, so two ranks
enqueueing the same marked tensor meet in the next cycle; a rank whose marked tensor is still pending after a
cycle (the peer was not ready) waits at most the usual window before the next. It applies with process sets,
``hvd.join`` (a joined rank cycles as before; the others' marked tensors start their cycles) and elastic
resets (the counters are per process and only compared, a new background thread starts from them) alike;
not while Horovod's autotuner runs (it measures the window it sets). ``hvd.shutdown()`` ends the wait too.

**A lone all-reduce runs in its input's buffer** (``FLUSH_PATCHES``): Horovod's TensorFlow op allocated a new
output and reduced into it (MPI out of place, Gloo after copying the input into it); it now forwards its input's
buffer as the output when TensorFlow says nothing else holds it (``forward_input_or_allocate_output``: an hvrep
bucket made by a concat, not a variable), so MPI runs in place and Gloo skips its copy.

**Small Gloo all-reduces take Gloo's halving-doubling algorithm** (``GLOO_PATCHES``). Horovod calls
``gloo::allreduce`` with Gloo's default, the ring: on p ranks 2(p-1) steps of 1/p of the buffer in 2p segments,
each a rendezvous of two ranks. For a buffer of a few KB that is only latency: each step waits for the peer's
threads to be woken (under ``horovodrun --gloo`` on one core per rank, ~0.3-0.6 ms a step on this machine).
Gloo's ``BCUBE`` is recursive halving and doubling: 2 log2(p) steps for p a power of two (the same bytes per
rank as the ring), a direct reduce-scatter and all-gather among the remaining factor otherwise. All-reduces of
at most ``HVREP_GLOO_BCUBE_BYTES`` bytes take it (default ``GLOO_BCUBE_BYTES``, 1 MiB; read at each all-reduce;
0 keeps the ring for every size; like every Horovod setting, the same on every rank, as launchers pass it): on
2 ranks 2.0x faster at 16 KB and 1.4x at 256 KB, even at 1-4 MB, and 0.9x at 32 MB, where the ring's
pipelining wins (``benchmarks/gloo_algorithms.py``, docs/performance.md). Why this is safe: every rank takes
the same branch (the size is the negotiated response's), both algorithms leave every rank with the same bits,
and the sum is exact where the ring's is; only the order of the additions differs on more than 2 ranks, as
between any two all-reduce algorithms (tests/multirank/test_gloo_algorithms.py).

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

# hvrep's own pre-fused reductions skip the fusion window (HVREP_HOROVOD_FLUSH), and a lone all-reduce runs in its
# input's buffer. Applied after the pieces above: some replace text those put in.
FLUSH_PATCHES: tuple[tuple[str, str, str], ...] = (
    ("horovod/common/tensor_queue.h",
     "void NotifyTensorEnqueued();\n",
     "// `flush`: the tensor is one of hvrep's pre-fused reductions (HvrepFlushes): the cycle need not wait.\n"
     "void NotifyTensorEnqueued(bool flush = false);\n"
     "// Whether `tensor_name` names one of hvrep's pre-fused reductions (it holds \"HvrepFlush\") and\n"
     "// HVREP_HOROVOD_FLUSH is not 0 (read at each such enqueue: a benchmark may switch it between steps).\n"
     "bool HvrepFlushes(const std::string& tensor_name);\n"
     "// The count of flushing tensors enqueued so far.\n"
     "uint64_t FlushesEnqueued();\n"
     "// Sleeps `duration`, or less: until the count of flushing tensors differs from `seen` or `shut_down` is set.\n"
     "void SleepUnlessFlushed(uint64_t seen, std::chrono::steady_clock::duration duration,\n"
     "                        const std::atomic_bool& shut_down);\n"),
    ("horovod/common/tensor_queue.cc",
     '#include <assert.h>\n#include <condition_variable>\n',
     '#include <assert.h>\n#include <condition_variable>\n#include <cstdlib>\n#include <cstring>\n'),
    ("horovod/common/tensor_queue.cc",
     "  tensor_table_.emplace(e.tensor_name, std::move(e));\n  message_queue_.push(std::move(message));\n"
     "  NotifyTensorEnqueued();\n",
     "  const bool flush = HvrepFlushes(e.tensor_name);\n"
     "  tensor_table_.emplace(e.tensor_name, std::move(e));\n  message_queue_.push(std::move(message));\n"
     "  NotifyTensorEnqueued(flush);\n"),
    ("horovod/common/tensor_queue.cc",
     "  std::lock_guard<std::mutex> guard(mutex_);\n\n  for (std::size_t i = 0; i < entries.size(); ++i) {\n",
     "  std::lock_guard<std::mutex> guard(mutex_);\n  bool flush = false; // hvrep\n\n"
     "  for (std::size_t i = 0; i < entries.size(); ++i) {\n"),
    ("horovod/common/tensor_queue.cc",
     "    tensor_table_.emplace(entries[i].tensor_name, std::move(entries[i]));\n"
     "    message_queue_.push(std::move(messages[i]));\n  }\n  NotifyTensorEnqueued();\n",
     "    flush = flush || HvrepFlushes(entries[i].tensor_name);\n"
     "    tensor_table_.emplace(entries[i].tensor_name, std::move(entries[i]));\n"
     "    message_queue_.push(std::move(messages[i]));\n  }\n  NotifyTensorEnqueued(flush);\n"),
    ("horovod/common/tensor_queue.cc",
     "uint64_t hvrep_enqueued = 0; // guarded by hvrep_idle_mutex\n} // namespace\n\n"
     "void NotifyTensorEnqueued() {\n  {\n    std::lock_guard<std::mutex> guard(hvrep_idle_mutex);\n"
     "    ++hvrep_enqueued;\n  }\n",
     "uint64_t hvrep_enqueued = 0; // guarded by hvrep_idle_mutex\n"
     "uint64_t hvrep_flushes = 0; // guarded by hvrep_idle_mutex\n} // namespace\n\n"
     "bool HvrepFlushes(const std::string& tensor_name) {\n"
     "  if (tensor_name.find(\"HvrepFlush\") == std::string::npos) {\n"
     "    return false;\n"
     "  }\n"
     "  const char* v = std::getenv(\"HVREP_HOROVOD_FLUSH\");\n"
     "  return v == nullptr || std::strcmp(v, \"0\") != 0;\n"
     "}\n\n"
     "uint64_t FlushesEnqueued() {\n"
     "  std::lock_guard<std::mutex> guard(hvrep_idle_mutex);\n"
     "  return hvrep_flushes;\n"
     "}\n\n"
     "void SleepUnlessFlushed(uint64_t seen, std::chrono::steady_clock::duration duration,\n"
     "                        const std::atomic_bool& shut_down) {\n"
     "  std::unique_lock<std::mutex> lock(hvrep_idle_mutex);\n"
     "  hvrep_idle_cv.wait_until(lock, std::chrono::steady_clock::now() + duration,\n"
     "                           [&] { return hvrep_flushes != seen || shut_down.load(); });\n"
     "}\n\n"
     "void NotifyTensorEnqueued(bool flush) {\n  {\n    std::lock_guard<std::mutex> guard(hvrep_idle_mutex);\n"
     "    ++hvrep_enqueued;\n    if (flush) {\n      ++hvrep_flushes;\n    }\n  }\n"),
    ("horovod/common/operations.cc",
     "bool RunLoopOnce(HorovodGlobalState& state) {\n  HvrepWaitWhileIdle(state);\n",
     "// hvrep: the flushing tensors enqueued before the running cycle read its queues (background thread only).\n"
     "static uint64_t hvrep_flushes_seen = 0;\n\n"
     "bool RunLoopOnce(HorovodGlobalState& state) {\n  HvrepWaitWhileIdle(state);\n"),
    ("horovod/common/operations.cc",
     "  if (sleep_duration > std::chrono::steady_clock::duration::zero()) {\n"
     "    std::this_thread::sleep_for(sleep_duration);\n  }\n"
     "  state.last_cycle_start = std::chrono::steady_clock::now();\n",
     "  if (sleep_duration > std::chrono::steady_clock::duration::zero()) {\n"
     "    // hvrep: one of hvrep's pre-fused reductions (HvrepFlushes) enqueued since the last cycle began ends\n"
     "    // the fusion window now; the autotuner measures the window as configured.\n"
     "    if (state.parameter_manager.IsAutoTuning()) {\n"
     "      std::this_thread::sleep_for(sleep_duration);\n"
     "    } else {\n"
     "      SleepUnlessFlushed(hvrep_flushes_seen, sleep_duration, state.shut_down);\n"
     "    }\n  }\n"
     "  state.last_cycle_start = std::chrono::steady_clock::now();\n"
     "  hvrep_flushes_seen = FlushesEnqueued();\n"),
    # Horovod's TF all-reduce allocated a new output and reduced into it: MPI out of place (its own copy inside),
    # Gloo after a memcpy of the input. The output now takes the input's buffer when nothing else holds it (TF
    # decides: a fused bucket from a concat, nobody's variable), and Gloo skips the copy onto itself.
    ("horovod/tensorflow/mpi_ops.cc",
     "    auto device = GetDeviceID(context);\n    auto tensor = context->input(0);\n"
     "    horovod::common::ReduceOp reduce_op = static_cast<horovod::common::ReduceOp>(reduce_op_);\n"
     "    Tensor* output;\n    OP_REQUIRES_OK_ASYNC(\n"
     "        context, context->allocate_output(0, tensor.shape(), &output), done);\n",
     "    auto device = GetDeviceID(context);\n"
     "    horovod::common::ReduceOp reduce_op = static_cast<horovod::common::ReduceOp>(reduce_op_);\n"
     "    Tensor* output;\n"
     "    // hvrep: before `tensor` below holds a second reference to the input's buffer.\n"
     "    OP_REQUIRES_OK_ASYNC(\n"
     "        context, context->forward_input_or_allocate_output({0}, 0, context->input(0).shape(), &output),\n"
     "        done);\n"
     "    auto tensor = context->input(0);\n"),
    ("horovod/common/ops/gloo_operations.cc",
     "    buffer_data = (void*)first_entry.output->data();\n"
     "    std::memcpy(buffer_data, first_entry.tensor->data(),\n"
     "                (size_t)first_entry.tensor->size());\n"
     "    fused_input_data = buffer_data;\n",
     "    buffer_data = (void*)first_entry.output->data();\n"
     "    if (buffer_data != first_entry.tensor->data()) { // hvrep: the output may be the input's buffer\n"
     "      std::memcpy(buffer_data, first_entry.tensor->data(),\n"
     "                  (size_t)first_entry.tensor->size());\n"
     "    }\n"
     "    fused_input_data = buffer_data;\n"),
)

# Gloo all-reduces of at most HVREP_GLOO_BCUBE_BYTES (default GLOO_BCUBE_BYTES) take Gloo's halving-doubling
# algorithm instead of its ring (see the module's docstring).
GLOO_BCUBE_BYTES = 1 << 20
GLOO_PATCHES: tuple[tuple[str, str, str], ...] = (
    ("horovod/common/ops/gloo_operations.cc",
     '#include "gloo/allreduce.h"\n',
     '#include "gloo/allreduce.h"\n'
     "#include <cstdlib>\n"
     "\n"
     "namespace {\n"
     "// hvrep (hvrep/compat/horovod_patches.py, GLOO_PATCHES): whether an all-reduce of `bytes` takes Gloo's\n"
     "// halving-doubling algorithm (BCUBE): at most HVREP_GLOO_BCUBE_BYTES (read at each call, so a benchmark\n"
     "// may switch it; 0 keeps the ring for every size).\n"
     "bool HvrepGlooBcube(size_t bytes) {\n"
     "  const char* v = std::getenv(\"HVREP_GLOO_BCUBE_BYTES\");\n"
     f"  long long limit = {GLOO_BCUBE_BYTES}LL;\n"
     "  if (v != nullptr && *v != '\\0') {\n"
     "    char* end = nullptr;\n"
     "    const long long parsed = std::strtoll(v, &end, 10);\n"
     "    if (end != nullptr && *end == '\\0' && parsed >= 0) limit = parsed;\n"
     "  }\n"
     "  return (long long)bytes <= limit;\n"
     "}\n"
     "} // namespace\n"),
    ("horovod/common/ops/gloo_operations.cc",
     "  gloo::allreduce(opts);\n",
     "  if (HvrepGlooBcube((size_t)num_elements * sizeof(T))) {\n"
     "    opts.setAlgorithm(gloo::AllreduceOptions::Algorithm::BCUBE);\n"
     "  }\n"
     "  gloo::allreduce(opts);\n"),
)

PATCHES = PATCHES + FLUSH_PATCHES + GLOO_PATCHES
# What an all-reduce's name holds to be one of hvrep's pre-fused reductions (HvrepFlushes in FLUSH_PATCHES).
FLUSH_NAME = "HvrepFlush"

# Names the patch set in logs; the cache key hashes PATCHES themselves.
PATCH_ID = "idlewait3+flush1+bcube1"
# A string only a library built with every patch holds (the variable GLOO_PATCHES reads).
MARKER = b"HVREP_GLOO_BCUBE_BYTES"


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
