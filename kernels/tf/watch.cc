// The hang watchdog's markers (hvrep/replica/activity.py): two ops around each Horovod collective in a traced
// step record "inside collective N since t" in a table that the watchdog's heartbeat thread reads through the C
// functions below (ctypes). They replace two tf.py_function calls per collective, each of which took Python's
// GIL and ran Python (about 50 us on a quiet core, on the step's critical path); these take a mutex.
//
// A table ("slot") belongs to one hvrep.replica.activity.Activity; the ops record into the slot bound as this
// process's watchdog's (hvrep_watch_bind), found when they execute, not when they were traced: a graph traced
// under one watchdog runs under the next (elastic resets make a new one). Eager collectives record into their
// Activity's own slot, so that traced and eager calls share one call counter, the number ranks compare.

#include <time.h>

#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <unordered_map>
#include <utility>

#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/common_shape_fns.h"
#include "tensorflow/core/framework/shape_inference.h"

namespace hvrep {
namespace watch {
namespace {

struct Slot {
  std::mutex mu;
  int64_t next_call = 1;
  std::map<int64_t, std::pair<int64_t, int64_t>> pending;  // call -> (label id, entered, ns)
  int64_t last_call = 0, last_label = -1, last_ns = 0;     // the last collective that completed
};

std::mutex slots_mu;
std::unordered_map<int64_t, std::shared_ptr<Slot>> slots;
int64_t next_slot = 1;
std::atomic<int64_t> bound{0};

// A traced marker's token carries its slot and call: the leave op must record into the slot the enter op did
// even if another watchdog was bound in between.
constexpr int kCallBits = 40;
constexpr int64_t kCallMask = (int64_t{1} << kCallBits) - 1;

int64_t NowNs() {
  // CLOCK_MONOTONIC: Python's time.monotonic() on Linux, so ages compare with the Python side's clock.
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return int64_t{ts.tv_sec} * 1000000000 + ts.tv_nsec;
}

std::shared_ptr<Slot> Find(int64_t id) {
  std::lock_guard<std::mutex> lock(slots_mu);
  auto it = slots.find(id);
  return it == slots.end() ? nullptr : it->second;
}

int64_t Enter(int64_t id, int64_t label) {
  std::shared_ptr<Slot> s = Find(id);
  if (!s) return 0;
  std::lock_guard<std::mutex> lock(s->mu);
  const int64_t call = s->next_call++ & kCallMask;
  s->pending[call] = {label, NowNs()};
  return call;
}

void Leave(int64_t id, int64_t call) {
  std::shared_ptr<Slot> s = Find(id);
  if (!s) return;
  std::lock_guard<std::mutex> lock(s->mu);
  auto it = s->pending.find(call);
  if (it == s->pending.end()) return;
  s->last_call = call;
  s->last_label = it->second.first;
  s->last_ns = NowNs();
  s->pending.erase(it);
}

using ::tensorflow::OpKernel;
using ::tensorflow::OpKernelConstruction;
using ::tensorflow::OpKernelContext;
using ::tensorflow::Tensor;
using ::tensorflow::TensorShape;

REGISTER_OP("HvrepWatchEnter")
    .Output("token: int64")
    .Attr("label: int")
    .SetIsStateful()
    .SetShapeFn(::tensorflow::shape_inference::ScalarShape)
    .Doc("Marks this rank inside collective `label` (hvrep.replica.activity); token 0 when no watchdog runs.");

REGISTER_OP("HvrepWatchLeave")
    .Input("token: int64")
    .Output("done: int64")
    .SetIsStateful()
    .SetShapeFn(::tensorflow::shape_inference::ScalarShape)
    .Doc("Marks the collective HvrepWatchEnter's token names as completed.");

class WatchEnterOp : public OpKernel {
 public:
  explicit WatchEnterOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    OP_REQUIRES_OK(ctx, ctx->GetAttr("label", &label_));
  }
  void Compute(OpKernelContext* ctx) override {
    Tensor* out = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({}), &out));
    const int64_t id = bound.load(std::memory_order_acquire);
    const int64_t call = id ? Enter(id, label_) : 0;
    out->scalar<int64_t>()() = call ? (id << kCallBits) | call : 0;
  }
  bool IsExpensive() override { return false; }  // run inline: a map insert, not worth a thread hop

 private:
  int64_t label_ = 0;
};

class WatchLeaveOp : public OpKernel {
 public:
  explicit WatchLeaveOp(OpKernelConstruction* ctx) : OpKernel(ctx) {}
  void Compute(OpKernelContext* ctx) override {
    const int64_t token = ctx->input(0).scalar<int64_t>()();
    if (token) Leave(token >> kCallBits, token & kCallMask);
    Tensor* out = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({}), &out));
    out->scalar<int64_t>()() = 0;
  }
  bool IsExpensive() override { return false; }
};

REGISTER_KERNEL_BUILDER(Name("HvrepWatchEnter").Device(::tensorflow::DEVICE_CPU), WatchEnterOp);
REGISTER_KERNEL_BUILDER(Name("HvrepWatchLeave").Device(::tensorflow::DEVICE_CPU), WatchLeaveOp);

}  // namespace
}  // namespace watch
}  // namespace hvrep

extern "C" {

// A new, empty table; its id (> 0).
int64_t hvrep_watch_new() {
  std::lock_guard<std::mutex> lock(hvrep::watch::slots_mu);
  const int64_t id = hvrep::watch::next_slot++;
  hvrep::watch::slots[id] = std::make_shared<hvrep::watch::Slot>();
  return id;
}

// Forgets a table (a marker still holding a token of it records nothing).
void hvrep_watch_free(int64_t id) {
  if (hvrep::watch::bound.load() == id) hvrep::watch::bound.store(0);
  std::lock_guard<std::mutex> lock(hvrep::watch::slots_mu);
  hvrep::watch::slots.erase(id);
}

// The table traced markers record into from now on; 0: none (they record nothing).
void hvrep_watch_bind(int64_t id) { hvrep::watch::bound.store(id, std::memory_order_release); }

int64_t hvrep_watch_enter(int64_t id, int64_t label) { return hvrep::watch::Enter(id, label); }

void hvrep_watch_leave(int64_t id, int64_t call) { hvrep::watch::Leave(id, call); }

// Writes the last completed call, its label id and when it completed (ns) to buf[0..2], then (call, label id,
// entered ns) for as many pending calls as fit in cap values, oldest call first. Returns how many calls are
// pending (more than were written if cap was short), or -1 for an unknown table.
int64_t hvrep_watch_snapshot(int64_t id, int64_t* buf, int64_t cap) {
  std::shared_ptr<hvrep::watch::Slot> s = hvrep::watch::Find(id);
  if (!s || cap < 3) return -1;
  std::lock_guard<std::mutex> lock(s->mu);
  buf[0] = s->last_call;
  buf[1] = s->last_label;
  buf[2] = s->last_ns;
  int64_t at = 3;
  for (const auto& [call, entry] : s->pending) {
    if (at + 3 > cap) break;
    buf[at++] = call;
    buf[at++] = entry.first;
    buf[at++] = entry.second;
  }
  return static_cast<int64_t>(s->pending.size());
}

}  // extern "C"
