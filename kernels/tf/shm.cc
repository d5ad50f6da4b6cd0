// A shared-memory all-reduce for ranks on one host (hvrep/replica/shm.py decides where it applies).
//
// Horovod reaches the other ranks of a host through its controller's transport: Open MPI's shared memory
// under mpirun, TCP over loopback under horovodrun --gloo (about 1.9 ms for 589 KB on 2 ranks here, where the
// step it serves takes 1.4 ms), and its background thread between the op and the wire either way. hvrep's
// in-step reductions are buckets it has already fused, so on one host it can sum them itself: every rank maps
// one file, copies its bucket in, sums its 1/N of it across the ranks, and copies the whole sum out. A bucket
// of several tensors (HvrepShmAllreduceParts) is copied in from the tensors themselves, laid out and scaled as
// hvrep's pack would, so no packed copy of it is made first.
//
// Order. Ops are submitted by TensorFlow's executor in whatever order the dataflow allows, which may differ
// between ranks. Rank 0's order is the order: its progress thread takes its ops in submission order and
// announces each (key, count, dtype) in the file; every other rank's thread waits for the announcement and
// then for its own op of that key (an op of the same key submitted earlier goes first). An op is only ever
// waited for after its own submission on rank 0, so no rank waits for an op whose submission depends on a
// later one: the ranks run the same graph.
//
// One collective is done in chunks of at most `cap` bytes. Chunk t (counted from 1 over the whole job) uses
// double-buffered areas t % 2: (1) copy my chunk but my own shard of it into staging[t%2][rank]; arrived[rank] =
// t; wait for every rank's arrived >= t; (2) sum my shard of the chunk over the ranks, in rank order (mine read
// from my input), into result[t%2];
// reduced[rank] = t; wait for every reduced >= t; (3) copy result[t%2] out. A rank that writes the areas of
// t % 2 again, at chunk t + 2, has seen every rank arrive at t + 1, so every rank has finished chunk t; the
// announcement slot c % 2 is reused likewise (every collective has at least one chunk).
//
// Failure. A rank that finds a mismatch (another count or dtype for the same key) or a peer gone (its pid no
// longer exists) writes the reason into the file; every waiting rank sees it and fails its op with it, and the
// transport refuses every later op. Nothing waits without a stop check, so closing never hangs.

#include <errno.h>
#include <fcntl.h>
#include <sched.h>
#include <signal.h>
#include <sys/mman.h>
#include <linux/futex.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <climits>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/common_shape_fns.h"
#include "tensorflow/core/framework/shape_inference.h"
#include "unsupported/Eigen/CXX11/Tensor"

namespace hvrep {
namespace shm {
namespace {

using ::tensorflow::AsyncOpKernel;
using ::tensorflow::DataType;
using ::tensorflow::OpKernelConstruction;
using ::tensorflow::OpKernelContext;
using ::tensorflow::Tensor;

constexpr uint64_t kMagic = 0x31687376726576ULL;  // "hvrsh1" and a version byte
constexpr int kMaxRanks = 256;
constexpr size_t kHeaderBytes = 64 * 1024;

struct alignas(64) RankLine {
  uint64_t arrived;
  uint64_t reduced;
  int64_t pid;
};

struct alignas(64) Announce {
  uint64_t collective;  // written last (release): the others read the rest after seeing it
  uint64_t key;
  int64_t count;
  int64_t dtype;
};

struct Header {
  uint64_t magic;
  int64_t size;
  int64_t cap;
  alignas(64) uint32_t bell;  // +1 after every store others may wait for; sleepers wait on it (a futex)
  alignas(64) uint32_t sleepers;
  alignas(64) uint32_t error;  // 0, or 1 once `message` holds the job's first failure
  uint32_t message_done;
  char message[1024];
  alignas(64) Announce announce[2];
  RankLine ranks[kMaxRanks];
};
static_assert(sizeof(Header) <= kHeaderBytes, "header too large");

int64_t NowNs() {
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return int64_t{ts.tv_sec} * 1000000000 + ts.tv_nsec;
}

inline uint64_t Load(const uint64_t* p) { return __atomic_load_n(p, __ATOMIC_ACQUIRE); }
inline void Store(uint64_t* p, uint64_t v) { __atomic_store_n(p, v, __ATOMIC_RELEASE); }

long Futex(uint32_t* word, int op, uint32_t val, const timespec* timeout) {
  // Not FUTEX_PRIVATE_FLAG: the word is in memory that other processes map.
  return syscall(SYS_futex, word, op, val, timeout, nullptr, 0);
}

inline void Pause() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#endif
}

// The process exists and has not exited: kill(pid, 0) succeeds for a zombie too (a rank that exited and was not
// yet reaped by its launcher), so its state in /proc is read as well.
bool Alive(pid_t pid) {
  if (kill(pid, 0) != 0 && errno == ESRCH) return false;
  char path[64], buf[512];
  std::snprintf(path, sizeof(path), "/proc/%d/stat", static_cast<int>(pid));
  const int fd = open(path, O_RDONLY | O_CLOEXEC);
  if (fd < 0) return true;  // no /proc: kill's answer stands
  const ssize_t n = read(fd, buf, sizeof(buf) - 1);
  close(fd);
  if (n <= 0) return true;
  buf[n] = '\0';
  const char* paren = std::strrchr(buf, ')');  // the state follows the command name, which may hold spaces
  return paren == nullptr || paren[1] == '\0' || (paren[2] != 'Z' && paren[2] != 'X');
}

uint64_t Fnv1a(const std::string& s) {
  uint64_t h = 1469598103934665603ULL;
  for (unsigned char c : s) h = (h ^ c) * 1099511628211ULL;
  return h;
}

int64_t DtypeSize(DataType dt) { return ::tensorflow::DataTypeSize(dt); }

// dst[j] = src[j] * T(scale), the multiply in T (half and bfloat16: in float, rounded once), as hvrep's pack
// multiplies (kernels/src/cpu.cc, PackSpan; the parts test checks the bits against it).
template <typename T>
void ScaledCopy(const char* src, char* dst, int64_t n, double scale) {
  using Arr = Eigen::Array<T, Eigen::Dynamic, 1>;
  Eigen::Map<Arr>(reinterpret_cast<T*>(dst), n) =
      Eigen::Map<const Arr>(reinterpret_cast<const T*>(src), n) * static_cast<T>(scale);
}

void ScaledCopy(DataType dt, const char* src, char* dst, int64_t n, double scale) {
  switch (dt) {
    case ::tensorflow::DT_HALF: return ScaledCopy<Eigen::half>(src, dst, n, scale);
    case ::tensorflow::DT_BFLOAT16: return ScaledCopy<Eigen::bfloat16>(src, dst, n, scale);
    case ::tensorflow::DT_FLOAT: return ScaledCopy<float>(src, dst, n, scale);
    case ::tensorflow::DT_DOUBLE: return ScaledCopy<double>(src, dst, n, scale);
    default: return;  // the op's dtype constraint admits no other
  }
}

struct Op {
  uint64_t key;
  std::string name;
  Tensor input;  // HvrepShmAllreduce's tensor; unused by a gathering op
  Tensor* output;  // its element count and dtype are the collective's
  std::function<void(absl::Status)> done;
  int64_t submitted_ns = 0;
  // A gathering op (HvrepShmAllreduceParts): `parts` make the collective's input as hvrep's pack would lay them
  // out, part i from element starts[i], zeros between, each multiplied by `scale`; they are copied from where
  // they are straight into the staging area, so no packed copy of the bucket is made.
  std::vector<Tensor> parts;
  std::vector<int64_t> starts;
  double scale = 1.0;
};

// What this process's transport has done since it opened, for `hvrep_shm_stats` (benchmarks/d4pg.py and
// step_overhead.py split a step's all-reduce into its parts with it). Written by the progress thread only; read
// from any thread, so each is atomic (relaxed: they are counters, read as a snapshot).
enum Stat { kOps, kChunks, kBytes, kLatencyNs, kReduceNs, kWaitNs, kSleeps, kNumStats };

class Comm {
 public:
  Comm(void* base, size_t bytes, int rank, int size, int64_t cap)
      : base_(static_cast<char*>(base)), bytes_(bytes), rank_(rank), size_(size), cap_(cap) {
    hdr_ = reinterpret_cast<Header*>(base_);
    thread_ = std::thread([this] { Loop(); });
  }

  // Stops the progress thread, failing the ops still pending. Called once, by hvrep_shm_close, never from the
  // progress thread; ops submitted later fail at once.
  void Stop() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    Ring();  // a thread asleep on the bell sees the stop at once
    thread_.join();
    std::deque<Op*> left;
    {
      std::lock_guard<std::mutex> lock(mu_);
      left.swap(pending_);
    }
    for (Op* op : left) Finish(op, absl::CancelledError("hvrep: the shared-memory transport was closed."));
  }

  ~Comm() {
    if (thread_.joinable()) Stop();
    munmap(base_, bytes_);
  }

  void Submit(Op* op) {
    op->submitted_ns = NowNs();
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (!stop_ && broken_.empty()) {
        pending_.push_back(op);
        cv_.notify_all();
        return;
      }
    }
    Finish(op, Failure());
  }

  // The counters (Stat's order) into out[0..n).
  void Stats(int64_t* out, int n) const {
    for (int i = 0; i < n && i < kNumStats; ++i) out[i] = stats_[i].load(std::memory_order_relaxed);
  }

  int PeersSeen() const {
    int n = 0;
    for (int r = 0; r < size_; ++r) {
      const pid_t pid = static_cast<pid_t>(__atomic_load_n(&hdr_->ranks[r].pid, __ATOMIC_ACQUIRE));
      if (pid > 0 && Alive(pid)) ++n;
    }
    return n;
  }

 private:
  void Count(Stat s, int64_t v) { stats_[s].fetch_add(v, std::memory_order_relaxed); }

  // Publishes `v` at `p` and wakes the ranks sleeping on the bell.
  void Publish(uint64_t* p, uint64_t v) {
    Store(p, v);
    Ring();
  }

  void Ring() {
    __atomic_add_fetch(&hdr_->bell, 1u, __ATOMIC_SEQ_CST);
    if (__atomic_load_n(&hdr_->sleepers, __ATOMIC_SEQ_CST) != 0) Futex(&hdr_->bell, FUTEX_WAKE, INT_MAX, nullptr);
  }

  char* Staging(uint64_t t, int r) const { return base_ + kHeaderBytes + ((t % 2) * size_ + r) * cap_; }
  char* Result(uint64_t t) const { return base_ + kHeaderBytes + (2 * size_ + (t % 2)) * cap_; }

  static void Finish(Op* op, absl::Status s) {
    op->done(std::move(s));
    delete op;
  }

  absl::Status Failure() {
    std::string why;
    if (__atomic_load_n(&hdr_->message_done, __ATOMIC_ACQUIRE)) {
      why.assign(hdr_->message, strnlen(hdr_->message, sizeof(hdr_->message)));
    }
    if (why.empty()) {
      std::lock_guard<std::mutex> lock(mu_);  // Break writes it on the progress thread
      why = broken_.empty() ? "the transport was closed" : broken_;
    }
    return absl::AbortedError("hvrep shared-memory all-reduce failed: " + why);
  }

  // Records the job's first failure in the file (the others read it there) and breaks this rank's transport.
  void Break(const std::string& why) {
    uint32_t expected = 0;
    if (__atomic_compare_exchange_n(&hdr_->error, &expected, 1u, false, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE)) {
      const size_t n = std::min(why.size(), sizeof(hdr_->message) - 1);
      std::memcpy(hdr_->message, why.data(), n);
      hdr_->message[n] = '\0';
      __atomic_store_n(&hdr_->message_done, 1u, __ATOMIC_RELEASE);
      Ring();
    }
    std::lock_guard<std::mutex> lock(mu_);
    if (broken_.empty()) broken_ = why;
  }

  bool Stopping() {
    std::lock_guard<std::mutex> lock(mu_);
    return stop_;
  }

  // "" while every other rank's process exists.
  std::string GonePeer() const {
    for (int r = 0; r < size_; ++r) {
      if (r == rank_) continue;
      const pid_t pid = static_cast<pid_t>(__atomic_load_n(&hdr_->ranks[r].pid, __ATOMIC_ACQUIRE));
      if (pid > 0 && !Alive(pid)) {
        return "rank " + std::to_string(r) + " (pid " + std::to_string(pid) + ") exited while rank " +
               std::to_string(rank_) + " waited for it";
      }
    }
    return "";
  }

  // Waits until `ready()`: spins for a few microseconds, yields for up to 50 us, then sleeps on the bell (a
  // futex other ranks ring after each store), checking for a failure, a closed transport and a gone peer at
  // least every 100 ms. Returns false (with this rank broken) where it must give up.
  template <typename F>
  bool WaitFor(F ready, const char* what) {
    const int64_t start = NowNs();
    int64_t next_check = start + 100 * 1000 * 1000;
    for (int i = 0;; ++i) {
      const uint32_t bell = __atomic_load_n(&hdr_->bell, __ATOMIC_SEQ_CST);
      if (ready()) {
        if (i > 0) Count(kWaitNs, NowNs() - start);
        return true;
      }
      if (i < 128) {
        Pause();
        continue;
      }
      if (__atomic_load_n(&hdr_->error, __ATOMIC_ACQUIRE)) {
        Break("another rank failed");
        return false;
      }
      const int64_t now = NowNs();
      if (now - start < 50 * 1000) {
        sched_yield();
      } else {
        const int64_t left = std::max<int64_t>(next_check - now, 1000);
        const timespec ts{static_cast<time_t>(left / 1000000000), static_cast<long>(left % 1000000000)};
        Count(kSleeps, 1);
        __atomic_add_fetch(&hdr_->sleepers, 1u, __ATOMIC_SEQ_CST);
        Futex(&hdr_->bell, FUTEX_WAIT, bell, &ts);  // returns at once if the bell rang since it was read
        __atomic_sub_fetch(&hdr_->sleepers, 1u, __ATOMIC_SEQ_CST);
      }
      if (NowNs() >= next_check) {
        next_check = NowNs() + 100 * 1000 * 1000;
        if (Stopping()) {
          Break(std::string("the transport was closed while rank ") + std::to_string(rank_) + " waited " + what);
          return false;
        }
        const std::string gone = GonePeer();
        if (!gone.empty()) {
          Break(gone + " " + what);
          return false;
        }
      }
    }
  }

  bool WaitAll(size_t field_offset, uint64_t t, const char* what) {
    return WaitFor([&] {
      for (int r = 0; r < size_; ++r) {
        const uint64_t* p = reinterpret_cast<const uint64_t*>(reinterpret_cast<const char*>(&hdr_->ranks[r]) +
                                                              field_offset);
        if (Load(p) < t) return false;
      }
      return true;
    }, what);
  }

  // The next op this rank must run: rank 0 its oldest; the others the oldest of the key rank 0 announced.
  Op* Next(uint64_t c) {
    Announce& a = hdr_->announce[c % 2];
    if (rank_ == 0) {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait(lock, [&] { return stop_ || !pending_.empty(); });
      if (stop_) return nullptr;
      Op* op = pending_.front();
      pending_.pop_front();
      lock.unlock();
      a.key = op->key;
      a.count = op->output->NumElements();
      a.dtype = static_cast<int64_t>(op->output->dtype());
      Publish(&a.collective, c);
      return op;
    }
    // Idle until this rank has something to reduce, then watch for the announcement.
    {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait(lock, [&] { return stop_ || !pending_.empty(); });
      if (stop_) return nullptr;
    }
    if (!WaitFor([&] { return Load(&a.collective) == c; }, "for rank 0 to announce the next all-reduce")) {
      return nullptr;
    }
    const uint64_t key = a.key;
    const int64_t count = a.count;
    const auto dtype = static_cast<DataType>(a.dtype);
    Op* op = nullptr;
    while (op == nullptr) {
      std::unique_lock<std::mutex> lock(mu_);
      auto it = std::find_if(pending_.begin(), pending_.end(), [&](Op* o) { return o->key == key; });
      if (it != pending_.end()) {
        op = *it;
        pending_.erase(it);
        break;
      }
      if (stop_) return nullptr;
      cv_.wait_for(lock, std::chrono::milliseconds(100));
      lock.unlock();
      if (__atomic_load_n(&hdr_->error, __ATOMIC_ACQUIRE)) {
        Break("another rank failed");
        return nullptr;
      }
      const std::string gone = GonePeer();
      if (!gone.empty()) {
        Break(gone);
        return nullptr;
      }
    }
    if (op->output->NumElements() != count || op->output->dtype() != dtype) {
      const std::string why =
          "rank 0 reduces " + std::to_string(count) + " elements of " + ::tensorflow::DataTypeString(dtype) +
          " where rank " + std::to_string(rank_) + " reduces " + std::to_string(op->output->NumElements()) +
          " of " + ::tensorflow::DataTypeString(op->output->dtype()) + " under the same name (" + op->name +
          "): the ranks run different steps. Fix: make every rank run the same step on tensors of the same "
          "shapes and dtypes";
      Break(why);
      Finish(op, Failure());
      return nullptr;
    }
    return op;
  }

  // Rank r's chunk t in rank q's view: this rank's own input where q is this rank (its shard is summed from the
  // input itself, so it never copies that part in), else q's staging area.
  const char* Source(uint64_t t, int q, const char* mine) const { return q == rank_ ? mine : Staging(t, q); }

  template <typename T>
  void SumShard(uint64_t t, const char* mine, int64_t begin, int64_t end) {
    using Arr = Eigen::Array<T, Eigen::Dynamic, 1>;
    const int64_t n = end - begin;
    if (n <= 0) return;
    Eigen::Map<Arr> out(reinterpret_cast<T*>(Result(t)) + begin, n);
    out = Eigen::Map<const Arr>(reinterpret_cast<const T*>(Source(t, 0, mine)) + begin, n);
    for (int r = 1; r < size_; ++r) {
      out += Eigen::Map<const Arr>(reinterpret_cast<const T*>(Source(t, r, mine)) + begin, n);
    }
  }

  // Half and bfloat16: summed in float over the ranks and rounded once.
  template <typename T>
  void SumShardInFloat(uint64_t t, const char* mine, int64_t begin, int64_t end) {
    float acc[256];
    for (int64_t b = begin; b < end; b += 256) {
      const int64_t n = std::min<int64_t>(256, end - b);
      const T* s0 = reinterpret_cast<const T*>(Source(t, 0, mine)) + b;
      for (int64_t i = 0; i < n; ++i) acc[i] = static_cast<float>(s0[i]);
      for (int r = 1; r < size_; ++r) {
        const T* s = reinterpret_cast<const T*>(Source(t, r, mine)) + b;
        for (int64_t i = 0; i < n; ++i) acc[i] += static_cast<float>(s[i]);
      }
      T* out = reinterpret_cast<T*>(Result(t)) + b;
      for (int64_t i = 0; i < n; ++i) out[i] = static_cast<T>(acc[i]);
    }
  }

  void SumShard(DataType dt, uint64_t t, const char* mine, int64_t begin, int64_t end) {
    switch (dt) {
      case ::tensorflow::DT_FLOAT: return SumShard<float>(t, mine, begin, end);
      case ::tensorflow::DT_DOUBLE: return SumShard<double>(t, mine, begin, end);
      case ::tensorflow::DT_HALF: return SumShardInFloat<Eigen::half>(t, mine, begin, end);
      case ::tensorflow::DT_BFLOAT16: return SumShardInFloat<Eigen::bfloat16>(t, mine, begin, end);
      default: return;  // the op's dtype constraint admits no other
    }
  }

  // Elements [from, from + n) of a gathering op's input, as hvrep's pack lays it out, into `dst`: each part's
  // overlap multiplied by the scale as the pack multiplies (a plain copy at a scale of 1), zeros in the gaps
  // between parts.
  static void Gather(const Op& op, int64_t es, int64_t from, int64_t n, char* dst) {
    const int64_t end = from + n;
    const DataType dt = op.output->dtype();
    // The last part that starts at or before `from` (parts of no elements share the next one's start).
    size_t i = std::upper_bound(op.starts.begin(), op.starts.end(), from) - op.starts.begin();
    i = i > 0 ? i - 1 : 0;
    int64_t pos = from;
    for (; i < op.parts.size(); ++i) {
      const int64_t s = op.starts[i], z = op.parts[i].NumElements();
      if (s >= end) break;
      if (s + z <= pos) continue;
      const int64_t lo = std::max(pos, s), hi = std::min(end, s + z);
      if (lo > pos) std::memset(dst + (pos - from) * es, 0, (lo - pos) * es);
      const char* src = static_cast<const char*>(op.parts[i].data()) + (lo - s) * es;
      if (op.scale == 1.0) {
        std::memcpy(dst + (lo - from) * es, src, (hi - lo) * es);
      } else {
        ScaledCopy(dt, src, dst + (lo - from) * es, hi - lo, op.scale);
      }
      pos = hi;
    }
    if (pos < end) std::memset(dst + (pos - from) * es, 0, (end - pos) * es);
  }

  bool Reduce(Op* op) {
    const DataType dt = op->output->dtype();
    const int64_t es = DtypeSize(dt);
    const int64_t count = op->output->NumElements();
    const int64_t per_chunk = cap_ / es;
    const bool gather = !op->parts.empty();
    const char* in = gather ? nullptr : static_cast<const char*>(op->input.data());
    char* out = static_cast<char*>(op->output->data());
    int64_t done = 0;
    do {
      const int64_t n = std::min(per_chunk, count - done);
      const uint64_t t = ++chunk_;
      // Shards on 16-element boundaries, so that every rank's shard starts 64-byte aligned in the areas.
      const int64_t grain = 16;
      const int64_t units = (n + grain - 1) / grain;
      const int64_t b = std::min(n, units * rank_ / size_ * grain);
      const int64_t e = std::min(n, units * (rank_ + 1) / size_ * grain);
      // The others need every part of this rank's chunk but its own shard. A gathering op copies its own shard
      // in as well (into this rank's staging area, in cache for the sum), since it lies in several parts.
      const char* mine;
      if (gather) {
        Gather(*op, es, done, n, Staging(t, rank_));
        mine = Staging(t, rank_);
      } else {
        mine = in + done * es;
        if (b > 0) std::memcpy(Staging(t, rank_), mine, b * es);
        if (n > e) std::memcpy(Staging(t, rank_) + e * es, mine + e * es, (n - e) * es);
      }
      Publish(&hdr_->ranks[rank_].arrived, t);
      if (!WaitAll(offsetof(RankLine, arrived), t, "in an all-reduce (its inputs)")) return false;
      SumShard(dt, t, mine, b, e);
      Publish(&hdr_->ranks[rank_].reduced, t);
      if (!WaitAll(offsetof(RankLine, reduced), t, "in an all-reduce (the sums)")) return false;
      if (n > 0) std::memcpy(out + done * es, Result(t), n * es);
      done += n;
      Count(kChunks, 1);
    } while (done < count);
    Count(kBytes, count * es);
    return true;
  }

  void Loop() {
    prctl(PR_SET_TIMERSLACK, 1000UL);  // this thread's short sleeps: 1 us of slack, not Linux's 50 us
    prctl(PR_SET_NAME, "hvrep-shm");  // as top -H and /proc/PID/task/*/comm show it
    for (uint64_t c = 1;; ++c) {
      Op* op = Next(c);
      if (op == nullptr) break;
      const int64_t taken = NowNs();
      if (!Reduce(op)) {
        Finish(op, Failure());
        break;
      }
      const int64_t end = NowNs();
      Count(kOps, 1);
      Count(kReduceNs, end - taken);
      Count(kLatencyNs, end - op->submitted_ns);
      Finish(op, absl::OkStatus());
    }
    // Broken or stopping: fail what is pending, and what comes later (Submit sees broken_ or stop_).
    std::deque<Op*> left;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (broken_.empty() && !stop_) broken_ = "the transport stopped";
      left.swap(pending_);
    }
    for (Op* op : left) Finish(op, Failure());
  }

  char* base_;
  size_t bytes_;
  Header* hdr_;
  const int rank_, size_;
  const int64_t cap_;
  uint64_t chunk_ = 0;
  std::atomic<int64_t> stats_[kNumStats] = {};
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Op*> pending_;
  bool stop_ = false;
  std::string broken_;
  std::thread thread_;
};

std::mutex g_mu;
// Never destroyed at exit: its thread may be waiting, and a joinable std::thread's destructor aborts.
std::shared_ptr<Comm>* g_comm = new std::shared_ptr<Comm>();

size_t FileBytes(int size, int64_t cap) { return kHeaderBytes + static_cast<size_t>(2 * size + 2) * cap; }

// Hands `op` (its output allocated) to this process's transport; `done` runs when it ends.
void SubmitOp(OpKernelContext* ctx, const AsyncOpKernel::DoneCallback& done, Op* op) {
  std::shared_ptr<Comm> comm;
  {
    std::lock_guard<std::mutex> lock(g_mu);
    comm = *g_comm;
  }
  if (comm == nullptr) {
    delete op;
    ctx->SetStatus(absl::FailedPreconditionError(
        "HvrepShmAllreduce: the shared-memory transport is not open in this process (a step traced while it was "
        "open runs after it closed). Fix: trace the step again (a new Replicator)."));
    done();
    return;
  }
  op->done = [ctx, done](absl::Status s) {
    if (!s.ok()) ctx->SetStatus(s);
    done();
  };
  comm->Submit(op);  // outside g_mu: a failed op completes inline, and TF may run the next op here
}

class ShmAllreduceOp : public AsyncOpKernel {
 public:
  explicit ShmAllreduceOp(OpKernelConstruction* ctx) : AsyncOpKernel(ctx) {
    OP_REQUIRES_OK(ctx, ctx->GetAttr("key", &name_));
    key_ = Fnv1a(name_);
  }

  void ComputeAsync(OpKernelContext* ctx, DoneCallback done) override {
    const Tensor& input = ctx->input(0);
    Tensor* output = nullptr;
    OP_REQUIRES_OK_ASYNC(ctx, ctx->allocate_output(0, input.shape(), &output), done);
    if (input.NumElements() == 0) {
      done();
      return;
    }
    SubmitOp(ctx, done, new Op{key_, name_, input, output, nullptr});
  }

 private:
  std::string name_;
  uint64_t key_ = 0;
};

REGISTER_OP("HvrepShmAllreduce")
    .Input("tensor: T")
    .Output("sum: T")
    .Attr("T: {half, bfloat16, float, double}")
    .Attr("key: string")
    .SetIsStateful()
    .SetShapeFn(::tensorflow::shape_inference::UnchangedShape)
    .Doc("The sum of `tensor` over the ranks of one host, through hvrep's shared-memory transport "
         "(hvrep/replica/shm.py). `key` pairs the op across ranks: the same on every rank for the same reduction.");

REGISTER_KERNEL_BUILDER(Name("HvrepShmAllreduce").Device(::tensorflow::DEVICE_CPU), ShmAllreduceOp);

// Where each part starts in the packed layout, as hvrep.kernels.packing._starts places them, and its length.
int64_t PackedStarts(const std::vector<int64_t>& sizes, int64_t align, std::vector<int64_t>* starts) {
  int64_t at = 0;
  for (size_t i = 0; i < sizes.size(); ++i) {
    if (i > 0) at = (at + align - 1) / align * align;
    if (starts != nullptr) starts->push_back(at);
    at += sizes[i];
  }
  return at;
}

class ShmAllreducePartsOp : public AsyncOpKernel {
 public:
  explicit ShmAllreducePartsOp(OpKernelConstruction* ctx) : AsyncOpKernel(ctx) {
    OP_REQUIRES_OK(ctx, ctx->GetAttr("key", &name_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("align", &align_));
    key_ = Fnv1a(name_);
  }

  void ComputeAsync(OpKernelContext* ctx, DoneCallback done) override {
    ::tensorflow::OpInputList parts;
    OP_REQUIRES_OK_ASYNC(ctx, ctx->input_list("parts", &parts), done);
    const Tensor& scale = ctx->input(parts.size());
    OP_REQUIRES_ASYNC(ctx, ::tensorflow::TensorShapeUtils::IsScalar(scale.shape()),
                      absl::InvalidArgumentError("HvrepShmAllreduceParts: scale must be a scalar"), done);
    std::vector<int64_t> sizes, starts;
    for (int i = 0; i < parts.size(); ++i) sizes.push_back(parts[i].NumElements());
    const int64_t total = PackedStarts(sizes, align_, &starts);
    Tensor* output = nullptr;
    OP_REQUIRES_OK_ASYNC(ctx, ctx->allocate_output(0, ::tensorflow::TensorShape({total}), &output), done);
    if (total == 0) {
      done();
      return;
    }
    auto* op = new Op{key_, name_, Tensor(), output, nullptr};
    op->scale = scale.scalar<double>()();
    if (parts.size() == 1 && op->scale == 1.0) {
      op->input = parts[0];  // the layout is the tensor itself: its own shard is summed from it, as a plain op's
    } else {
      op->parts.assign(parts.begin(), parts.end());
      op->starts = std::move(starts);
    }
    SubmitOp(ctx, done, op);
  }

 private:
  std::string name_;
  uint64_t key_ = 0;
  int64_t align_ = 1;
};

REGISTER_OP("HvrepShmAllreduceParts")
    .Input("parts: N * T")
    .Input("scale: double")
    .Output("sum: T")
    .Attr("N: int >= 1")
    .Attr("T: {half, bfloat16, float, double}")
    .Attr("key: string")
    .Attr("align: int >= 1")
    .SetIsStateful()
    .SetShapeFn([](::tensorflow::shape_inference::InferenceContext* c) {
      int64_t align = 1;
      TF_RETURN_IF_ERROR(c->GetAttr("align", &align));
      std::vector<int64_t> sizes;
      for (int i = 0; i < c->num_inputs() - 1; ++i) {
        ::tensorflow::shape_inference::ShapeHandle s = c->input(i);
        if (!c->FullyDefined(s)) {
          c->set_output(0, c->Vector(::tensorflow::shape_inference::InferenceContext::kUnknownDim));
          return absl::OkStatus();
        }
        int64_t n = 1;
        for (int d = 0; d < c->Rank(s); ++d) n *= c->Value(c->Dim(s, d));
        sizes.push_back(n);
      }
      c->set_output(0, c->Vector(PackedStarts(sizes, align, nullptr)));
      return absl::OkStatus();
    })
    .Doc("The sum over the ranks of one host of the rank-1 buffer hvrep's pack would make of `parts` (each "
         "multiplied by `scale`, part i after the first starting at a multiple of `align` elements, zeros between), "
         "through hvrep's shared-memory transport, which copies the parts into its staging area itself: no packed "
         "buffer is made. `key` pairs the op across ranks.");

REGISTER_KERNEL_BUILDER(Name("HvrepShmAllreduceParts").Device(::tensorflow::DEVICE_CPU).HostMemory("scale"),
                        ShmAllreducePartsOp);

int Fail(char* err, int errlen, const std::string& what) {
  if (err != nullptr && errlen > 0) {
    const size_t n = std::min(what.size(), static_cast<size_t>(errlen - 1));
    std::memcpy(err, what.data(), n);
    err[n] = '\0';
  }
  return -1;
}

}  // namespace
}  // namespace shm
}  // namespace hvrep

extern "C" {

// Bytes the file needs for `size` ranks and `cap`-byte chunks.
int64_t hvrep_shm_file_bytes(int size, int64_t cap) {
  return static_cast<int64_t>(hvrep::shm::FileBytes(size, cap));
}

// Maps the transport's file and starts this process's progress thread. Rank 0 (create=1) sizes and
// initialises the file, which must exist and be empty; the others (create=0) check it. Returns 0, or -1 with
// the reason in err.
int hvrep_shm_open(const char* path, int rank, int size, int64_t cap, int create, char* err, int errlen) {
  using namespace hvrep::shm;
  std::lock_guard<std::mutex> lock(g_mu);
  if (*g_comm != nullptr) return Fail(err, errlen, "the shared-memory transport is already open in this process");
  if (size < 2 || size > kMaxRanks || rank < 0 || rank >= size || cap < 64 || cap % 64 != 0) {
    return Fail(err, errlen, "bad arguments: rank " + std::to_string(rank) + " of " + std::to_string(size) +
                                 ", cap " + std::to_string(cap));
  }
  const size_t bytes = FileBytes(size, cap);
  const int fd = open(path, O_RDWR | O_CLOEXEC | O_NOFOLLOW);
  if (fd < 0) return Fail(err, errlen, std::string("open(") + path + "): " + strerror(errno));
  struct stat st;
  if (fstat(fd, &st) != 0 || st.st_uid != geteuid() || (st.st_mode & 077) != 0) {
    close(fd);
    return Fail(err, errlen, std::string(path) + " is not a private file of this user");
  }
  if (create) {
    // posix_fallocate, not ftruncate: a full /dev/shm then fails here, not with SIGBUS mid-step.
    const int rc = posix_fallocate(fd, 0, static_cast<off_t>(bytes));
    if (rc != 0) {
      close(fd);
      return Fail(err, errlen, "could not reserve " + std::to_string(bytes) + " bytes in " + path + ": " +
                                   strerror(rc));
    }
  } else if (static_cast<size_t>(st.st_size) != bytes) {
    close(fd);
    return Fail(err, errlen, std::string(path) + " has " + std::to_string(st.st_size) + " bytes, not " +
                                 std::to_string(bytes));
  }
  void* base = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  close(fd);
  if (base == MAP_FAILED) return Fail(err, errlen, std::string("mmap: ") + strerror(errno));
  auto* hdr = static_cast<Header*>(base);
  if (create) {
    hdr->size = size;
    hdr->cap = cap;
    __atomic_store_n(&hdr->magic, kMagic, __ATOMIC_RELEASE);
  } else if (__atomic_load_n(&hdr->magic, __ATOMIC_ACQUIRE) != kMagic || hdr->size != size || hdr->cap != cap) {
    munmap(base, bytes);
    return Fail(err, errlen, std::string(path) + " was not set up for " + std::to_string(size) + " ranks");
  }
  __atomic_store_n(&hdr->ranks[rank].pid, static_cast<int64_t>(getpid()), __ATOMIC_RELEASE);
  *g_comm = std::make_shared<Comm>(base, bytes, rank, size, cap);
  return 0;
}

// How many ranks have written their pid and exist for this process (kill(pid, 0)): the opening handshake's
// check that the ranks share one pid namespace, so that a gone peer can be told. -1 where none is open.
int hvrep_shm_peers_seen(void) {
  using namespace hvrep::shm;
  std::shared_ptr<Comm> c;
  {
    std::lock_guard<std::mutex> lock(g_mu);
    c = *g_comm;
  }
  return c ? c->PeersSeen() : -1;
}

// Stops the progress thread (failing ops still pending) and unmaps the file. 0, or -1 where none was open.
int hvrep_shm_close(void) {
  using namespace hvrep::shm;
  std::shared_ptr<Comm> c;
  {
    std::lock_guard<std::mutex> lock(g_mu);
    c.swap(*g_comm);
  }
  if (!c) return -1;
  c->Stop();
  return 0;  // the last owner (this one, or an op's ComputeAsync in flight) unmaps the file
}

// This process's counters since its transport opened, in the order ops, chunks, bytes, latency_ns (each op's
// submission to its end, summed), reduce_ns (the progress thread's time on it, waits for the peers included),
// wait_ns (time waiting for another rank: the announcement, the peers' inputs, their sums), sleeps (waits that
// slept on the futex). Writes min(n, 7) values; returns how many, or -1 where none is open.
int hvrep_shm_stats(int64_t* out, int n) {
  using namespace hvrep::shm;
  std::shared_ptr<Comm> c;
  {
    std::lock_guard<std::mutex> lock(g_mu);
    c = *g_comm;
  }
  if (!c || out == nullptr || n < 0) return -1;
  c->Stats(out, n);
  return std::min(n, static_cast<int>(kNumStats));
}

int hvrep_shm_is_open(void) {
  using namespace hvrep::shm;
  std::lock_guard<std::mutex> lock(g_mu);
  return *g_comm != nullptr;
}

}  // extern "C"
