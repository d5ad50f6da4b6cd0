// Standalone check and benchmark of the CUDA kernels against the CPU reference
// (kernels/src/cpu.cc), with no TensorFlow.
//
//   harness [--shapes FILE] [--out FILE] [--peak-gbps X] [--repeats N] [--warmup N]
//
// Correctness: LARS (f32: 5 steps, then 1 nesterov step; f64: 1 step) on the
// shapes file's tensors and on a list of awkward sizes and misaligned
// pointers; pack/unpack over dtype pairs, exact to the bit (NaN, Inf, +/-0
// and f16 subnormals included; see SameElement for NaN), with guard bytes
// after the outputs and sources misaligned by an element; unpack one piece per
// call at aligned starts inside the buffer, as HvrepUnpack does with align > 1
// (see Packed); the empty list, an n = 0 tensor and argument errors. Without a
// device, the CPU side of the per-piece unpack and the argument checks still
// run. Timing: fused LARS, a per-tensor LARS of 5 small kernels per tensor,
// pack and unpack; median and p10/p90 of per-call CUDA event times, GB/s and
// the fraction of peak memory bandwidth.
//
// Exit codes: 0 every check passed; 1 a check or a CUDA call failed;
// 2 bad command line or unreadable shapes file; 3 no CUDA device (no driver,
// or no GPU: the CPU reference still runs, and the argument checks that need
// no device). A driver too old for the runtime is a failure (1), not 3.

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <regex>
#include <sstream>
#include <string>
#include <vector>

#include "hvrep_kernels.h"

namespace {

constexpr int kExitOk = 0, kExitFail = 1, kExitUsage = 2, kExitNoDevice = 3;

struct Options {
  std::string shapes = "kernels/harness/resnet50_shapes.txt";
  std::string out = "harness.json";
  double peak_gbps = 0.0;  // 0: from the device attributes
  int repeats = 100;       // timed calls per measurement (the spread needs >= 50)
  int warmup = 10;
};

const char* kUsage =
    "usage: harness [--shapes FILE] [--out FILE] [--peak-gbps X] [--repeats N>=50] [--warmup N]\n";

bool ParseArgs(int argc, char** argv, Options* o) {
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--help" || a == "-h") {
      std::fputs(kUsage, stdout);
      std::exit(kExitOk);
    }
    if (i + 1 >= argc) {
      std::fprintf(stderr, "%s needs a value\n%s", a.c_str(), kUsage);
      return false;
    }
    const std::string v = argv[++i];
    char* end = nullptr;
    if (a == "--shapes") {
      o->shapes = v;
    } else if (a == "--out") {
      o->out = v;
    } else if (a == "--peak-gbps") {
      o->peak_gbps = std::strtod(v.c_str(), &end);
      if (*end != '\0' || !(o->peak_gbps > 0)) {
        std::fprintf(stderr, "--peak-gbps must be a positive number of GB/s, got '%s'\n", v.c_str());
        return false;
      }
    } else if (a == "--repeats" || a == "--warmup") {
      const long x = std::strtol(v.c_str(), &end, 10);
      const long lo = a == "--repeats" ? 50 : 0;
      if (*end != '\0' || x < lo || x > 100000) {
        std::fprintf(stderr, "%s must be an integer in [%ld, 100000], got '%s'\n", a.c_str(), lo, v.c_str());
        return false;
      }
      (a == "--repeats" ? o->repeats : o->warmup) = static_cast<int>(x);
    } else {
      std::fprintf(stderr, "unknown argument '%s'\n%s", a.c_str(), kUsage);
      return false;
    }
  }
  return true;
}

// ---------------------------------------------------------------------------
// Shapes.

struct Shape {
  std::string path;
  int64_t n;
  uint32_t flags;
};

// hvrep.optimizers.DEFAULT_EXCLUDE: no weight decay and no layer adaptation.
const std::regex kExclude("batch_normalization|batch_norm|batchnorm|(^|[/_])bn|bias$");

bool ReadShapes(const std::string& file, std::vector<Shape>* shapes) {
  std::ifstream in(file);
  if (!in) {
    std::fprintf(stderr, "cannot read the shapes file '%s' (pass --shapes FILE)\n", file.c_str());
    return false;
  }
  std::string line;
  int lineno = 0;
  while (std::getline(in, line)) {
    ++lineno;
    if (line.empty() || line[0] == '#') continue;
    std::istringstream ls(line);
    Shape s{"", 1, 0};
    ls >> s.path;
    if (s.path.empty()) continue;
    long long d;
    while (ls >> d) {
      if (d < 0) break;
      s.n *= d;
    }
    if (!ls.eof() || d < 0) {
      std::fprintf(stderr, "%s:%d: expected 'path dim dim ...' with non-negative dims\n", file.c_str(), lineno);
      return false;
    }
    s.flags = std::regex_search(s.path, kExclude) ? 0u : (HVREP_LARS_DECAY | HVREP_LARS_ADAPT);
    shapes->push_back(s);
  }
  if (shapes->empty()) {
    std::fprintf(stderr, "the shapes file '%s' lists no tensors\n", file.c_str());
    return false;
  }
  return true;
}

// ---------------------------------------------------------------------------
// Small utilities.

// splitmix64: the same numbers on every platform (std:: distributions are not).
class Rng {
 public:
  explicit Rng(uint64_t seed) : s_(seed) {}
  uint64_t Next() {
    uint64_t z = (s_ += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
  }
  double Uniform(double lo, double hi) { return lo + (hi - lo) * ((Next() >> 11) * 0x1.0p-53); }

 private:
  uint64_t s_;
};

[[noreturn]] void Die(const char* what, const char* why) {
  std::fprintf(stderr, "FAILED: %s: %s\n", what, why);
  std::exit(kExitFail);
}

void CudaCheck(cudaError_t err, const char* what) {
  if (err != cudaSuccess) Die(what, cudaGetErrorString(err));
}

void HvCheck(int rc, const char* what) {
  if (rc != HVREP_OK) Die(what, hvrep_cuda_strerror(rc));
}

class DeviceBuffer {
 public:
  explicit DeviceBuffer(size_t bytes) : bytes_(bytes) {
    if (bytes > 0) CudaCheck(cudaMalloc(&p_, bytes), "cudaMalloc");
  }
  ~DeviceBuffer() { cudaFree(p_); }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  template <typename T = void>
  T* get() const { return static_cast<T*>(p_); }
  size_t bytes() const { return bytes_; }
  void Upload(const void* host, size_t bytes) {
    if (bytes > 0) CudaCheck(cudaMemcpy(p_, host, bytes, cudaMemcpyHostToDevice), "cudaMemcpy H2D");
  }
  void Download(void* host, size_t bytes) const {
    if (bytes > 0) CudaCheck(cudaMemcpy(host, p_, bytes, cudaMemcpyDeviceToHost), "cudaMemcpy D2H");
  }

 private:
  void* p_ = nullptr;
  size_t bytes_;
};

struct Check {
  std::string name;
  bool pass;
  double max_rel_err;  // LARS: see CompareArrays; pack/unpack: 0 or 1 (exact or not)
  int64_t mismatches;  // elements that differ in any bit
  int64_t elements;
};

struct Timing {
  std::string name;
  double median_us, p10_us, p90_us;
  double bytes;           // that must move (the bound)
  double bytes_one_pass;  // LARS: the 5-array bound; 0 otherwise
};

// ---------------------------------------------------------------------------
// LARS data: one allocation per array, each tensor at a 64-byte aligned
// offset as TensorFlow allocates, or at a deliberately misaligned one.

template <typename T>
struct LarsData {
  std::vector<int64_t> n, off;
  std::vector<uint32_t> flags;
  std::vector<T> w, v, g;  // host: the CPU reference's state
};

template <typename T>
LarsData<T> MakeLars(const std::vector<int64_t>& n, const std::vector<uint32_t>& flags, bool misalign, uint64_t seed) {
  LarsData<T> d;
  d.n = n;
  d.flags = flags;
  constexpr int64_t kAlign = 64 / sizeof(T);
  int64_t total = 0;
  for (size_t i = 0; i < n.size(); ++i) {
    total = (total + kAlign - 1) / kAlign * kAlign + (misalign ? static_cast<int64_t>(i % 3) : 0);
    d.off.push_back(total);
    total += n[i];
  }
  d.w.assign(total, T(0));
  d.v.assign(total, T(0));
  d.g.assign(total, T(0));
  Rng rng(seed);
  for (size_t i = 0; i < n.size(); ++i) {
    // Some all-zero weights and some zero gradients: the ratio = 1 branches.
    const bool zero_w = i % 17 == 5, zero_g = i % 23 == 7;
    for (int64_t j = d.off[i]; j < d.off[i] + n[i]; ++j) {
      d.w[j] = zero_w ? T(0) : static_cast<T>(rng.Uniform(-0.1, 0.1));
      d.v[j] = static_cast<T>(rng.Uniform(-1e-3, 1e-3));
      d.g[j] = zero_g ? T(0) : static_cast<T>(rng.Uniform(-1e-2, 1e-2));
    }
  }
  return d;
}

template <typename T>
std::vector<hvrep_lars_tensor> LarsList(const LarsData<T>& d, T* w, T* v, const T* g) {
  std::vector<hvrep_lars_tensor> list;
  for (size_t i = 0; i < d.n.size(); ++i) {
    const bool empty = d.n[i] == 0;  // an empty tensor may come with null pointers
    list.push_back(hvrep_lars_tensor{empty ? nullptr : w + d.off[i], empty ? nullptr : v + d.off[i],
                                     empty ? nullptr : g + d.off[i], d.n[i], d.flags[i]});
  }
  return list;
}

// max(a, b) that returns NaN if either is NaN: std::max(a, NaN) returns a.
double NanMax(double a, double b) { return std::isnan(a) || std::isnan(b) ? std::nan("") : std::max(a, b); }

struct Comparison {
  double max_rel = 0;       // NaN once any element compared as NaN; it then stays NaN
  int64_t mismatches = 0;   // elements that differ in any bit
  int64_t nonfinite = 0;    // NaN/Inf on one side only, or different infinities
};

// Max over elements of |gpu - cpu| / max(|cpu|, floor), floor = 1e-3 x the
// tensor's RMS (over its finite values): a difference of one ulp in v would
// otherwise be a huge relative error on the few weights that w - v cancels to
// almost zero. Both NaN, or the same infinity, is agreement (no NaN payload
// is compared: see cuda_common.cuh); a NaN or Inf on one side only is counted
// in `nonfinite` and makes max_rel NaN.
template <typename T>
Comparison CompareArrays(const LarsData<T>& d, const std::vector<T>& cpu, const std::vector<T>& gpu) {
  Comparison r;
  for (size_t i = 0; i < d.n.size(); ++i) {
    double ss = 0;
    int64_t finite = 0;
    for (int64_t j = d.off[i]; j < d.off[i] + d.n[i]; ++j) {
      if (!std::isfinite(double(cpu[j]))) continue;
      ss += double(cpu[j]) * double(cpu[j]);
      ++finite;
    }
    const double rms = finite ? std::sqrt(ss / finite) : 0.0;
    const double floor = std::max(1e-3 * rms, 1e-300);
    for (int64_t j = d.off[i]; j < d.off[i] + d.n[i]; ++j) {
      if (std::memcmp(&cpu[j], &gpu[j], sizeof(T)) != 0) ++r.mismatches;
      const double c = double(cpu[j]), g = double(gpu[j]);
      double rel;
      if (std::isfinite(c) && std::isfinite(g)) {
        rel = std::fabs(g - c) / std::max(std::fabs(c), floor);
      } else if ((std::isnan(c) && std::isnan(g)) || c == g) {
        rel = 0;  // NaN where NaN, or the same infinity
      } else {
        ++r.nonfinite;
        rel = std::nan("");
      }
      r.max_rel = NanMax(r.max_rel, rel);
    }
  }
  return r;
}

template <typename T>
constexpr int DtypeOf() { return sizeof(T) == 4 ? HVREP_F32 : HVREP_F64; }

hvrep_lars_hparams Hparams(int nesterov) {
  return hvrep_lars_hparams{0.9, 1e-4, 1e-3, 1e-9, nesterov};
}

// Relative error (see CompareArrays) allowed after the first step and after
// later ones. After one step the GPU differs from the CPU only where the norms,
// summed in another order, round differently. In f32 the sums are taken in
// double, so the ratio differs by a few f32 ulps at most (6e-8 each). In f64
// they are taken in the data's own precision: the CPU adds each 32K-element
// unit in sequence, the GPU in a tree, and a sum of n positive terms in
// sequence is off by up to (n - 1) ulps (f64: 32768 x 1.1e-16 = 3.6e-12), by
// about sqrt(n) ulps typically (2e-14 per norm, a few norms per ratio); v's
// two terms can cancel, which raises an element's relative error further. The
// first run on a GPU (an H200, 2026-11-27) gave 9.1e-14 over ResNet-50's
// shapes and 1.3e-14 over the odd sizes, above the 1e-14 first set here from
// "a few ulps"; 1e-12 keeps the worst case of the order alone in bounds while
// a wrong kernel is still off by 1e-3 or worse. Later steps start
// from states that already differ and add a new difference each step; v
// carries them on (v = 0.9 v + ...: up to 1 / (1 - 0.9) = 10 steps' worth),
// w = w - v sums them, and a changed w changes the next ratio. The later
// bounds leave ~100x over that compounding for 5 steps; a wrong kernel is off
// by far more (a wrong ratio or a skipped term: 1e-3 or worse). A NaN or Inf
// on one side only fails every step whatever the tolerance.
struct LarsTolerance {
  double first_step, later_steps;
};
constexpr LarsTolerance kTolF32{1e-6, 1e-4}, kTolF64{1e-12, 1e-10};

// Runs `steps` LARS steps on the CPU and the GPU from the same state and
// compares w and v. Returns the checks (one per compared step).
template <typename T>
std::vector<Check> CheckLars(const std::string& name, LarsData<T>& d, const std::vector<int>& compare_after,
                             int nesterov, LarsTolerance tol, cudaStream_t stream) {
  const size_t total = d.w.size(), bytes = total * sizeof(T);
  DeviceBuffer w(bytes), v(bytes), g(bytes), lr(sizeof(T));
  w.Upload(d.w.data(), bytes);
  v.Upload(d.v.data(), bytes);
  g.Upload(d.g.data(), bytes);
  const T lr_host = T(0.5);
  lr.Upload(&lr_host, sizeof(T));
  const auto cpu_list = LarsList(d, d.w.data(), d.v.data(), d.g.data());
  const auto gpu_list = LarsList(d, w.get<T>(), v.get<T>(), g.get<T>());
  const int num = static_cast<int>(cpu_list.size());
  DeviceBuffer ws(hvrep_lars_cuda_workspace_bytes(num, gpu_list.data()));
  const hvrep_lars_hparams hp = Hparams(nesterov);
  std::vector<Check> checks;
  std::vector<T> gw(total), gv(total);
  const int steps = *std::max_element(compare_after.begin(), compare_after.end());
  for (int step = 1; step <= steps; ++step) {
    HvCheck(hvrep_lars_cpu(DtypeOf<T>(), num, cpu_list.data(), &lr_host, hp, nullptr, nullptr), "hvrep_lars_cpu");
    HvCheck(hvrep_lars_cuda(DtypeOf<T>(), num, gpu_list.data(), lr.get(), hp, ws.get(), ws.bytes(), stream),
            "hvrep_lars_cuda");
    if (std::find(compare_after.begin(), compare_after.end(), step) == compare_after.end()) continue;
    CudaCheck(cudaStreamSynchronize(stream), "LARS step");
    w.Download(gw.data(), bytes);
    v.Download(gv.data(), bytes);
    const Comparison cw = CompareArrays(d, d.w, gw), cv = CompareArrays(d, d.v, gv);
    int64_t elements = 0;
    for (int64_t n : d.n) elements += n;
    const double rel = NanMax(cw.max_rel, cv.max_rel);
    const int64_t nonfinite = cw.nonfinite + cv.nonfinite;
    // `rel <= ...` is false for a NaN: a NaN anywhere fails.
    const bool pass = nonfinite == 0 && rel <= (step == 1 ? tol.first_step : tol.later_steps);
    if (nonfinite) {
      std::fprintf(stderr, "%s, step %d: %lld elements NaN or Inf on one side only\n", name.c_str(), step,
                   static_cast<long long>(nonfinite));
    }
    checks.push_back(Check{name + ", step " + std::to_string(step), pass, rel, cw.mismatches + cv.mismatches,
                           2 * elements});
  }
  return checks;
}

// ---------------------------------------------------------------------------
// Pack / unpack data: tensors of any dtypes, each at a 64-byte aligned offset.

size_t Size(int dtype) { return hvrep_dtype_size(dtype); }

void PutValue(unsigned char* p, int dtype, int64_t j, double x) {
  switch (dtype) {
    case HVREP_F16: { const __half h = __float2half_rn(static_cast<float>(x)); std::memcpy(p + 2 * j, &h, 2); break; }
    case HVREP_BF16: {
      const __nv_bfloat16 b = __float2bfloat16_rn(static_cast<float>(x));
      std::memcpy(p + 2 * j, &b, 2);
      break;
    }
    case HVREP_F32: { const float f = static_cast<float>(x); std::memcpy(p + 4 * j, &f, 4); break; }
    default: std::memcpy(p + 8 * j, &x, 8); break;
  }
}

// A NaN with a non-canonical payload (signalling, low bits set), of either
// sign: the f16/bf16 outputs must still be the canonical patterns.
void PutPayloadNan(unsigned char* p, int dtype, int64_t j, bool negative) {
  switch (dtype) {
    case HVREP_F16: { const uint16_t b = negative ? 0xfd01 : 0x7c01; std::memcpy(p + 2 * j, &b, 2); break; }
    case HVREP_BF16: { const uint16_t b = negative ? 0xff81 : 0x7f81; std::memcpy(p + 2 * j, &b, 2); break; }
    case HVREP_F32: { const uint32_t b = negative ? 0xff812345u : 0x7f800001u; std::memcpy(p + 4 * j, &b, 4); break; }
    default: {
      const uint64_t b = negative ? 0xfff0000000012345ull : 0x7ff0000000000001ull;
      std::memcpy(p + 8 * j, &b, 8);
      break;
    }
  }
}

// Values at the edges of the conversions: NaN and Inf of both signs, +/-0;
// for f16 the smallest subnormal 2^-24, the halfway cases 2^-25 (rounds to 0)
// and 3 x 2^-25 (to 2^-23), the largest subnormal, the smallest normal, the
// largest finite 65504 and 65520 (rounds to Inf); for bf16/f32 an f32
// subnormal and a value past f16's range. Then the two payload NaNs.
const double kSpecials[] = {std::nan(""), -std::nan(""), INFINITY,    -INFINITY, 0.0,     -0.0,
                            0x1p-24,      -0x1p-24,      0x1p-25,     0x1.8p-24, 0x1.ff8p-15,
                            0x1p-14,      65504.0,       65520.0,     -1e30,     1e-40};
constexpr int64_t kNumSpecials = sizeof(kSpecials) / sizeof(kSpecials[0]) + 2;

void FillRandom(unsigned char* p, int dtype, int64_t n, Rng& rng) {
  for (int64_t j = 0; j < n; ++j) {
    // Full-mantissa values in [-4, 4], every 7th down in the f16 subnormals.
    double x = rng.Uniform(-4.0, 4.0);
    if (j % 7 == 3) x *= 1e-5;
    PutValue(p, dtype, j, x);
  }
  // The specials at the start of each tensor (the scalar head of a misaligned
  // one) and then every 997th element (the vector body and the tails).
  for (int64_t j = 0, k = 0; j < n; j = j < kNumSpecials - 1 ? j + 1 : j + 997, ++k) {
    const int64_t s = k % kNumSpecials;
    if (s >= kNumSpecials - 2) {
      PutPayloadNan(p, dtype, j, s == kNumSpecials - 1);
    } else {
      PutValue(p, dtype, j, kSpecials[s]);
    }
  }
}

// Bytes after the pack buffer and after the last unpack tensor, filled with
// the 0xAB pattern and checked after the call. cudaMalloc rounds allocations
// up, so a write past the end faults only far past it and would otherwise go
// unseen; 64 KiB covers a tail handled as whole vectors (<= 32 B over) and a
// chunk offset off by a few elements.
constexpr size_t kGuardBytes = 1 << 16;

struct TensorSet {
  std::vector<int64_t> n;
  std::vector<int> dtype;
  std::vector<size_t> byte_off;
  size_t bytes = 0;                 // to the end of the last tensor; the guard follows
  std::vector<unsigned char> host;  // bytes + kGuardBytes
};

// Each tensor at a 64-byte aligned offset, or, with `misalign`, one element
// past it (so never 8- or 16-byte aligned for a vector of 4).
TensorSet MakeSet(const std::vector<int64_t>& n, const std::vector<int>& dtype, bool fill, Rng& rng,
                  bool misalign = false) {
  TensorSet s;
  s.n = n;
  s.dtype = dtype;
  for (size_t i = 0; i < n.size(); ++i) {
    s.bytes = (s.bytes + 63) / 64 * 64 + (misalign ? Size(dtype[i]) : 0);
    s.byte_off.push_back(s.bytes);
    s.bytes += n[i] * Size(dtype[i]);
  }
  s.host.assign(s.bytes + kGuardBytes, 0xAB);  // a pattern: an element nobody wrote shows up
  if (fill) {
    for (size_t i = 0; i < n.size(); ++i) FillRandom(s.host.data() + s.byte_off[i], dtype[i], n[i], rng);
  }
  return s;
}

std::vector<hvrep_tensor_ref> Refs(const TensorSet& s, unsigned char* base) {
  std::vector<hvrep_tensor_ref> refs;
  for (size_t i = 0; i < s.n.size(); ++i) {
    refs.push_back(hvrep_tensor_ref{s.n[i] ? base + s.byte_off[i] : nullptr, s.n[i], s.dtype[i]});
  }
  return refs;
}

int64_t Total(const std::vector<int64_t>& n) {
  int64_t t = 0;
  for (int64_t x : n) t += x;
  return t;
}

// Whether two results agree. f32/f64: NaN where NaN (the GPU's arithmetic NaN
// is 0x7fffffff, x86's keeps the operand's payload; see cuda_common.cuh), else
// the same bits. f16/bf16: the same bits, NaN included (the canonical 0x7e00 /
// 0x7fc0 payload is the contract), except a NaN's sign: a NaN that came out of
// the scale multiply has x86's sign on the CPU and + on the GPU, and IEEE 754
// leaves it unspecified.
bool SameElement(const unsigned char* a, const unsigned char* b, int dtype) {
  switch (dtype) {
    case HVREP_F16:
    case HVREP_BF16: {
      uint16_t x, y;
      std::memcpy(&x, a, 2);
      std::memcpy(&y, b, 2);
      const uint16_t inf = dtype == HVREP_F16 ? 0x7c00 : 0x7f80;
      const bool nan_x = (x & 0x7fff) > inf, nan_y = (y & 0x7fff) > inf;
      return nan_x && nan_y ? (x & 0x7fff) == (y & 0x7fff) : x == y;
    }
    case HVREP_F32: {
      float x, y;
      std::memcpy(&x, a, 4);
      std::memcpy(&y, b, 4);
      return (std::isnan(x) && std::isnan(y)) || std::memcmp(a, b, 4) == 0;
    }
    default: {
      double x, y;
      std::memcpy(&x, a, 8);
      std::memcpy(&y, b, 8);
      return (std::isnan(x) && std::isnan(y)) || std::memcmp(a, b, 8) == 0;
    }
  }
}

int64_t CountMismatches(const unsigned char* a, const unsigned char* b, int64_t n, int dtype) {
  const size_t esize = Size(dtype);
  int64_t m = 0;
  for (int64_t j = 0; j < n; ++j) m += !SameElement(a + j * esize, b + j * esize, dtype);
  return m;
}

int64_t CountByteMismatches(const unsigned char* a, const unsigned char* b, size_t n) {
  int64_t m = 0;
  for (size_t j = 0; j < n; ++j) m += a[j] != b[j];
  return m;
}

void ReportGuard(const std::string& name, int64_t overwritten) {
  if (overwritten) {
    std::fprintf(stderr, "%s: %lld bytes of the guard after the last element were overwritten\n", name.c_str(),
                 static_cast<long long>(overwritten));
  }
}

Check CheckPack(const std::string& name, const std::vector<int64_t>& n, const std::vector<int>& src_dtypes,
                int dst_dtype, double scale, cudaStream_t stream, Rng& rng, bool misaligned_src = false) {
  TensorSet src = MakeSet(n, src_dtypes, true, rng, misaligned_src);
  const int64_t total = Total(n);
  const size_t dst_bytes = total * Size(dst_dtype), all_bytes = dst_bytes + kGuardBytes;
  DeviceBuffer d_src(src.bytes), d_dst(all_bytes), d_scale(sizeof(double));
  d_src.Upload(src.host.data(), src.bytes);
  d_scale.Upload(&scale, sizeof(double));
  CudaCheck(cudaMemset(d_dst.get(), 0xAB, all_bytes), "cudaMemset");
  std::vector<unsigned char> cpu(all_bytes, 0xAB), gpu(all_bytes);
  const auto cpu_refs = Refs(src, src.host.data());
  const auto gpu_refs = Refs(src, d_src.get<unsigned char>());
  const int num = static_cast<int>(n.size());
  HvCheck(hvrep_pack_cpu(num, cpu_refs.data(), cpu.data(), dst_dtype, &scale, nullptr, nullptr), "hvrep_pack_cpu");
  DeviceBuffer ws(hvrep_pack_cuda_workspace_bytes(num));
  HvCheck(hvrep_pack_cuda(num, gpu_refs.data(), d_dst.get(), dst_dtype, d_scale.get<double>(), ws.get(), ws.bytes(),
                          stream),
          "hvrep_pack_cuda");
  CudaCheck(cudaStreamSynchronize(stream), "pack");
  d_dst.Download(gpu.data(), all_bytes);
  const int64_t guard = CountByteMismatches(cpu.data() + dst_bytes, gpu.data() + dst_bytes, kGuardBytes);
  ReportGuard(name, guard);
  const int64_t mis = CountMismatches(cpu.data(), gpu.data(), total, dst_dtype) + guard;
  return Check{name, mis == 0, mis ? 1.0 : 0.0, mis, total};
}

// The buffer an unpack reads, and where each piece of it starts (elements).
// align 0: the pieces back to back, filled as one tensor, unpacked by one call
// for the whole list. align >= 1: HvrepUnpack's layout with that `align`
// attribute (kernels/tf/hvrep_ops.h, UnpackOp): piece i > 0 starts at the next
// multiple of align after piece i-1 ends, zeros between, and the op calls the
// kernel once per piece with its source at base + start * element size (with
// align > 1, or with share). With align 1 or 3 and odd sizes most of those
// sources are not 16-byte aligned, which the unpack of a whole list from the
// buffer's start never shows the kernel. Each piece is filled on its own, so
// the specials sit at its start (the scalar head of a misaligned source).
struct Packed {
  TensorSet buf;               // one rank-1 tensor, the guard after it
  std::vector<int64_t> start;  // each piece's first element in buf
  int64_t align;
};

Packed MakePacked(const std::vector<int64_t>& n, int dtype, int64_t align, Rng& rng) {
  Packed p;
  p.align = align;
  int64_t at = 0;
  for (size_t i = 0; i < n.size(); ++i) {
    if (i > 0 && align > 0) at = (at + align - 1) / align * align;
    p.start.push_back(at);
    at += n[i];
  }
  p.buf = MakeSet({at}, {dtype}, align == 0, rng);
  if (align > 0) {
    std::fill(p.buf.host.begin(), p.buf.host.begin() + p.buf.bytes, 0);
    for (size_t i = 0; i < n.size(); ++i) FillRandom(p.buf.host.data() + p.start[i] * Size(dtype), dtype, n[i], rng);
  }
  return p;
}

// Unpacks `p`, at `base` (host or device memory), into `dsts` as the op
// does for p.align; unpack(src, num, dsts) is one hvrep_unpack_cpu/_cuda call.
template <typename F>
int UnpackPacked(const Packed& p, const unsigned char* base, const std::vector<hvrep_tensor_ref>& dsts, F unpack) {
  if (p.align == 0) return unpack(base, static_cast<int>(dsts.size()), dsts.data());
  const size_t esize = Size(p.buf.dtype[0]);
  for (size_t i = 0; i < dsts.size(); ++i) {
    if (const int rc = unpack(base + p.start[i] * esize, 1, &dsts[i]); rc != HVREP_OK) return rc;
  }
  return HVREP_OK;
}

// Elements that differ between two unpacks into the same layout (see
// SameElement), plus the bytes that differ in the padding between tensors and
// in the guard: unpack must not write outside its tensors.
int64_t CompareUnpacked(const std::string& name, const TensorSet& a, const TensorSet& b) {
  const unsigned char *c = a.host.data(), *g = b.host.data();
  int64_t mis = 0;
  size_t end = 0;
  for (size_t i = 0; i < a.n.size(); ++i) {
    const size_t off = a.byte_off[i];
    mis += CountByteMismatches(c + end, g + end, off - end);
    mis += CountMismatches(c + off, g + off, a.n[i], a.dtype[i]);
    end = off + a.n[i] * Size(a.dtype[i]);
  }
  mis += CountByteMismatches(c + end, g + end, a.bytes - end);
  const int64_t guard = CountByteMismatches(c + a.bytes, g + a.bytes, kGuardBytes);
  ReportGuard(name, guard);
  return mis + guard;
}

// align 0: one call for the list; align >= 1: one call per piece, on the CPU
// and the GPU alike (see Packed).
Check CheckUnpack(const std::string& name, const std::vector<int64_t>& n, int src_dtype,
                  const std::vector<int>& dst_dtypes, double scale, cudaStream_t stream, Rng& rng, int64_t align = 0) {
  const Packed p = MakePacked(n, src_dtype, align, rng);
  TensorSet cpu = MakeSet(n, dst_dtypes, false, rng), gpu = MakeSet(n, dst_dtypes, false, rng);
  DeviceBuffer d_src(p.buf.bytes), d_dst(gpu.host.size()), d_scale(sizeof(double));
  d_src.Upload(p.buf.host.data(), p.buf.bytes);
  d_dst.Upload(gpu.host.data(), gpu.host.size());  // the same 0xAB pattern as the CPU side, guard included
  d_scale.Upload(&scale, sizeof(double));
  const auto cpu_refs = Refs(cpu, cpu.host.data());
  const auto gpu_refs = Refs(gpu, d_dst.get<unsigned char>());
  // One workspace for all the calls of a per-piece unpack: they run in
  // stream order, as TensorFlow's allocator hands each call's temp back.
  DeviceBuffer ws(hvrep_pack_cuda_workspace_bytes(static_cast<int>(n.size())));
  auto on_cpu = [&](const void* src, int num, const hvrep_tensor_ref* dsts) {
    return hvrep_unpack_cpu(src, src_dtype, num, dsts, &scale, nullptr, nullptr);
  };
  auto on_gpu = [&](const void* src, int num, const hvrep_tensor_ref* dsts) {
    return hvrep_unpack_cuda(src, src_dtype, num, dsts, d_scale.get<double>(), ws.get(), ws.bytes(), stream);
  };
  HvCheck(UnpackPacked(p, p.buf.host.data(), cpu_refs, on_cpu), "hvrep_unpack_cpu");
  HvCheck(UnpackPacked(p, d_src.get<unsigned char>(), gpu_refs, on_gpu), "hvrep_unpack_cuda");
  CudaCheck(cudaStreamSynchronize(stream), "unpack");
  d_dst.Download(gpu.host.data(), gpu.host.size());
  const int64_t mis = CompareUnpacked(name, cpu, gpu);
  return Check{name, mis == 0, mis ? 1.0 : 0.0, mis, Total(n)};
}

// The CPU side of the per-piece unpack, which needs no device: one call per
// piece at its aligned start gives the bits of one call for the same pieces
// back to back (where a piece starts changes nothing in the reference the GPU
// is compared with).
Check CheckUnpackPiecesCpu(const std::string& name, const std::vector<int64_t>& n, int src_dtype,
                           const std::vector<int>& dst_dtypes, double scale, int64_t align, Rng& rng) {
  const Packed apart = MakePacked(n, src_dtype, align, rng);
  Packed together{MakeSet({Total(n)}, {src_dtype}, false, rng), {}, 0};
  const size_t esize = Size(src_dtype);
  int64_t at = 0;
  for (size_t i = 0; i < n.size(); ++i) {
    together.start.push_back(at);
    std::memcpy(together.buf.host.data() + at * esize, apart.buf.host.data() + apart.start[i] * esize, n[i] * esize);
    at += n[i];
  }
  TensorSet per_piece = MakeSet(n, dst_dtypes, false, rng), one_call = MakeSet(n, dst_dtypes, false, rng);
  auto on_cpu = [&](const void* src, int num, const hvrep_tensor_ref* dsts) {
    return hvrep_unpack_cpu(src, src_dtype, num, dsts, &scale, nullptr, nullptr);
  };
  HvCheck(UnpackPacked(apart, apart.buf.host.data(), Refs(per_piece, per_piece.host.data()), on_cpu),
          "hvrep_unpack_cpu per piece");
  HvCheck(UnpackPacked(together, together.buf.host.data(), Refs(one_call, one_call.host.data()), on_cpu),
          "hvrep_unpack_cpu");
  const int64_t mis = CompareUnpacked(name, one_call, per_piece);
  return Check{name, mis == 0, mis ? 1.0 : 0.0, mis, Total(n)};
}

// Unpack one piece per call at aligned starts (see Packed) from every buffer
// dtype into every destination dtype, with align 1, 3 and 64 bytes
// (hvrep.kernels.align_for), scales 1 and 1/3: the GPU against the CPU where
// there is a device (`gpu`), and the CPU side alone in any case. The pieces:
// each size once per destination dtype, sizes outermost, so with align 1 and 3
// the 16387-element pieces start at every residue mod 4 (a vector of 4) and
// the short ones at several; 16387 crosses a chunk boundary (kChunk = 16384)
// and leaves a 3-element tail; an empty piece (a zero-size variable) still
// gets its call. About 70K elements per check.
std::vector<Check> CheckUnpackPerPiece(bool gpu, cudaStream_t stream, Rng& rng) {
  std::vector<int64_t> n;
  std::vector<int> dtypes;
  for (const int64_t size : {1, 3, 5, 17, 1000, 16387}) {
    for (int d = HVREP_F16; d <= HVREP_F64; ++d) {
      n.push_back(size);
      dtypes.push_back(d);
    }
    if (size == 5) {
      n.push_back(0);
      dtypes.push_back(HVREP_F32);
    }
  }
  const char* const names[] = {"f16", "bf16", "f32", "f64"};
  std::vector<Check> checks;
  for (int b = HVREP_F16; b <= HVREP_F64; ++b) {
    for (const int64_t align : {int64_t{1}, int64_t{3}, static_cast<int64_t>(64 / Size(b))}) {
      const std::string what = std::string(names[b]) + "->mixed, align " + std::to_string(align);
      checks.push_back(CheckUnpackPiecesCpu("CPU unpack per piece = one call, " + what, n, b, dtypes, 1.0 / 3, align,
                                            rng));
      if (!gpu) continue;
      checks.push_back(CheckUnpack("unpack per piece " + what + ", scale 1", n, b, dtypes, 1.0, stream, rng, align));
      checks.push_back(CheckUnpack("unpack per piece " + what + ", scale 1/3", n, b, dtypes, 1.0 / 3, stream, rng,
                                   align));
    }
  }
  return checks;
}

// Return codes that need no device: each call fails its checks before it
// touches CUDA, and must give the CPU reference's code.
std::vector<Check> CheckArguments() {
  std::vector<Check> checks;
  auto expect = [&](const std::string& name, int got, int want) {
    checks.push_back(Check{name + " -> " + std::to_string(want), got == want, got == want ? 0.0 : 1.0,
                           got == want ? 0 : 1, 1});
  };
  float x = 0;
  const float lr = 0.1f;
  const double scale = 1.0;
  const hvrep_lars_hparams hp = Hparams(0);
  hvrep_lars_tensor null_w{nullptr, &x, &x, 1, 0};
  expect("lars: no tensors", hvrep_lars_cuda(HVREP_F32, 0, nullptr, nullptr, hp, nullptr, 0, nullptr),
         hvrep_lars_cpu(HVREP_F32, 0, nullptr, nullptr, hp, nullptr, nullptr));
  expect("lars: negative count", hvrep_lars_cuda(HVREP_F32, -1, nullptr, &lr, hp, nullptr, 0, nullptr), HVREP_EINVAL);
  expect("lars: null w with n > 0", hvrep_lars_cuda(HVREP_F32, 1, &null_w, &lr, hp, nullptr, 0, nullptr),
         hvrep_lars_cpu(HVREP_F32, 1, &null_w, &lr, hp, nullptr, nullptr));
  hvrep_lars_tensor one{&x, &x, &x, 1, 0};
  expect("lars: f16 dtype", hvrep_lars_cuda(HVREP_F16, 1, &one, &lr, hp, nullptr, 0, nullptr),
         hvrep_lars_cpu(HVREP_F16, 1, &one, &lr, hp, nullptr, nullptr));
  expect("lars: workspace too small", hvrep_lars_cuda(HVREP_F32, 1, &one, &lr, hp, nullptr, 0, nullptr),
         HVREP_EWORKSPACE);
  hvrep_tensor_ref r{&x, 1, HVREP_F32}, bad{&x, 1, 7}, nul{nullptr, 1, HVREP_F32}, empty{nullptr, 0, HVREP_F32};
  expect("pack: no tensors", hvrep_pack_cuda(0, nullptr, nullptr, HVREP_F16, &scale, nullptr, 0, nullptr), HVREP_OK);
  expect("pack: only an empty tensor", hvrep_pack_cuda(1, &empty, nullptr, HVREP_F16, &scale, nullptr, 0, nullptr),
         hvrep_pack_cpu(1, &empty, nullptr, HVREP_F16, &scale, nullptr, nullptr));
  expect("pack: unknown source dtype", hvrep_pack_cuda(1, &bad, &x, HVREP_F32, &scale, nullptr, 0, nullptr),
         hvrep_pack_cpu(1, &bad, &x, HVREP_F32, &scale, nullptr, nullptr));
  expect("pack: unknown buffer dtype", hvrep_pack_cuda(1, &r, &x, 9, &scale, nullptr, 0, nullptr),
         hvrep_pack_cpu(1, &r, &x, 9, &scale, nullptr, nullptr));
  expect("pack: null source", hvrep_pack_cuda(1, &nul, &x, HVREP_F32, &scale, nullptr, 0, nullptr),
         hvrep_pack_cpu(1, &nul, &x, HVREP_F32, &scale, nullptr, nullptr));
  expect("pack: null scale", hvrep_pack_cuda(1, &r, &x, HVREP_F32, nullptr, nullptr, 0, nullptr),
         hvrep_pack_cpu(1, &r, &x, HVREP_F32, nullptr, nullptr, nullptr));
  expect("pack: workspace too small", hvrep_pack_cuda(1, &r, &x, HVREP_F32, &scale, nullptr, 0, nullptr),
         HVREP_EWORKSPACE);
  expect("unpack: null buffer", hvrep_unpack_cuda(nullptr, HVREP_F32, 1, &r, &scale, nullptr, 0, nullptr),
         hvrep_unpack_cpu(nullptr, HVREP_F32, 1, &r, &scale, nullptr, nullptr));
  expect("unpack: negative count", hvrep_unpack_cuda(&x, HVREP_F32, -2, &r, &scale, nullptr, 0, nullptr),
         HVREP_EINVAL);
  return checks;
}

// ---------------------------------------------------------------------------
// Timing.

// Per-call GPU times from events recorded between back-to-back calls, all
// enqueued before one synchronisation: the GPU never waits for the host
// unless a call itself is slower to enqueue than to run (the per-tensor
// baseline: its launch cost is what it is there to show).
template <typename F>
Timing Time(const std::string& name, F call, cudaStream_t stream, int warmup, int repeats, double bytes,
            double bytes_one_pass) {
  for (int i = 0; i < warmup; ++i) call();
  CudaCheck(cudaStreamSynchronize(stream), (name + " warm-up").c_str());
  std::vector<cudaEvent_t> ev(repeats + 1);
  for (auto& e : ev) CudaCheck(cudaEventCreate(&e), "cudaEventCreate");
  CudaCheck(cudaEventRecord(ev[0], stream), "cudaEventRecord");
  for (int i = 0; i < repeats; ++i) {
    call();
    CudaCheck(cudaEventRecord(ev[i + 1], stream), "cudaEventRecord");
  }
  CudaCheck(cudaStreamSynchronize(stream), name.c_str());
  std::vector<double> us(repeats);
  for (int i = 0; i < repeats; ++i) {
    float ms = 0;
    CudaCheck(cudaEventElapsedTime(&ms, ev[i], ev[i + 1]), "cudaEventElapsedTime");
    us[i] = 1e3 * ms;
  }
  for (auto& e : ev) cudaEventDestroy(e);
  std::sort(us.begin(), us.end());
  auto pct = [&](double p) { return us[static_cast<size_t>(p * (repeats - 1) + 0.5)]; };
  return Timing{name, pct(0.5), pct(0.1), pct(0.9), bytes, bytes_one_pass};
}

// The per-tensor baseline: what a framework without the fused op launches for
// each tensor (two norms, the ratio, the momentum update, the weight update).
// Float atomics: not deterministic, and not checked; only timed.
__global__ void NaiveSumSquares(const float* x, int64_t n, double* out) {
  double s = 0;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    s += double(x[i]) * double(x[i]);
  }
  for (int off = 16; off > 0; off >>= 1) s += __shfl_down_sync(0xffffffffu, s, off);
  if ((threadIdx.x & 31) == 0) atomicAdd(out, s);
}

__global__ void NaiveScale(const double* ssq, const float* lr, float* scale, float wd, float eta, float eps,
                           int adapt) {
  const float wn = float(sqrt(ssq[0])), gn = float(sqrt(ssq[1]));
  *scale = adapt && wn > 0 && gn > 0 ? *lr * (eta * wn / (gn + wd * wn + eps)) : *lr;
}

__global__ void NaiveMomentum(float* v, const float* g, const float* w, const float* scale, float wd, float m,
                              int64_t n) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    v[i] = m * v[i] + *scale * (g[i] + wd * w[i]);
  }
}

__global__ void NaiveWeights(float* w, const float* v, int64_t n) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    w[i] -= v[i];
  }
}

void NaiveLars(const std::vector<hvrep_lars_tensor>& list, const float* lr, double* ssq, float* scales,
               const hvrep_lars_hparams& hp, cudaStream_t stream) {
  cudaMemsetAsync(ssq, 0, sizeof(double) * 2 * list.size(), stream);
  for (size_t i = 0; i < list.size(); ++i) {
    const hvrep_lars_tensor& t = list[i];
    if (t.n == 0) continue;
    const int blocks = static_cast<int>(std::min<int64_t>((t.n + 255) / 256, 1024));
    const bool adapt = t.flags & HVREP_LARS_ADAPT;
    const float wd = (t.flags & HVREP_LARS_DECAY) ? float(hp.weight_decay) : 0.f;
    float* w = static_cast<float*>(t.w);
    const float* g = static_cast<const float*>(t.g);
    if (adapt) {
      NaiveSumSquares<<<blocks, 256, 0, stream>>>(w, t.n, ssq + 2 * i);
      NaiveSumSquares<<<blocks, 256, 0, stream>>>(g, t.n, ssq + 2 * i + 1);
    }
    NaiveScale<<<1, 1, 0, stream>>>(ssq + 2 * i, lr, scales + i, wd, float(hp.eta), float(hp.epsilon), adapt);
    NaiveMomentum<<<blocks, 256, 0, stream>>>(static_cast<float*>(t.v), g, w, scales + i, wd, float(hp.momentum),
                                              t.n);
    NaiveWeights<<<blocks, 256, 0, stream>>>(w, static_cast<const float*>(t.v), t.n);
  }
  CudaCheck(cudaGetLastError(), "per-tensor LARS launch");
}

// ---------------------------------------------------------------------------
// Output.

std::string JsonString(const std::string& s) {
  std::string o = "\"";
  for (char c : s) {
    if (c == '"' || c == '\\') o += '\\';
    if (static_cast<unsigned char>(c) < 0x20) continue;
    o += c;
  }
  return o + "\"";
}

std::string JsonNumber(double x) {
  if (!std::isfinite(x)) return "null";
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.6g", x);
  return buf;
}

struct Report {
  std::string device;  // empty: none
  double peak_gbps = 0;
  std::string peak_source;
  std::string shapes;
  int64_t num_tensors = 0, num_params = 0;
  double cpu_lars_step_ms = 0;
  std::vector<Check> checks;
  std::vector<Timing> timings;

  bool Passed() const {
    for (const Check& c : checks) {
      if (!c.pass) return false;
    }
    return true;
  }

  void Print() const {
    std::printf("\n%-58s %6s %12s %12s\n", "check", "result", "max rel err", "mismatches");
    for (const Check& c : checks) {
      std::printf("%-58s %6s %12.3g %12lld\n", c.name.c_str(), c.pass ? "pass" : "FAIL", c.max_rel_err,
                  static_cast<long long>(c.mismatches));
    }
    if (timings.empty()) return;
    std::printf("\n%-34s %10s %10s %10s %9s %8s %8s\n", "timing (us per call)", "median", "p10", "p90", "GB/s",
                "of peak", "1-pass");
    for (const Timing& t : timings) {
      const double gbps = t.bytes / (t.median_us * 1e3);
      std::printf("%-34s %10.1f %10.1f %10.1f %9.0f", t.name.c_str(), t.median_us, t.p10_us, t.p90_us, gbps);
      if (peak_gbps > 0) {
        std::printf(" %7.1f%%", 100 * gbps / peak_gbps);
        if (t.bytes_one_pass > 0) std::printf(" %7.1f%%", 100 * t.bytes_one_pass / (t.median_us * 1e3) / peak_gbps);
      }
      std::printf("\n");
    }
    if (peak_gbps > 0) {
      std::printf("GB/s: bytes that must move / median time; of peak: against %.0f GB/s (%s).\n", peak_gbps,
                  peak_source.c_str());
    } else {
      std::printf("peak bandwidth unknown (the device reports no memory clock): pass --peak-gbps X\n");
    }
    std::printf("LARS bytes: 7 arrays (pass 1 reads w, g; pass 2 reads w, g, v, writes w, v); 1-pass: the 5-array\n"
                "bound of a kernel that read each array once.\n");
  }

  bool Write(const std::string& file) const {
    std::ofstream o(file);
    if (!o) return false;
    o << "{\n  \"device\": " << (device.empty() ? "null" : JsonString(device)) << ",\n";
    o << "  \"peak_gbps\": " << (peak_gbps > 0 ? JsonNumber(peak_gbps) : "null") << ",\n";
    o << "  \"peak_source\": " << JsonString(peak_source) << ",\n";
    o << "  \"shapes\": " << JsonString(shapes) << ",\n";
    o << "  \"num_tensors\": " << num_tensors << ",\n  \"num_params\": " << num_params << ",\n";
    o << "  \"cpu_lars_step_ms\": " << JsonNumber(cpu_lars_step_ms) << ",\n";
    o << "  \"passed\": " << (Passed() ? "true" : "false") << ",\n  \"checks\": [";
    for (size_t i = 0; i < checks.size(); ++i) {
      const Check& c = checks[i];
      o << (i ? "," : "") << "\n    {\"name\": " << JsonString(c.name) << ", \"pass\": " << (c.pass ? "true" : "false")
        << ", \"max_rel_err\": " << JsonNumber(c.max_rel_err) << ", \"mismatches\": " << c.mismatches
        << ", \"elements\": " << c.elements << "}";
    }
    o << "\n  ],\n  \"timings\": [";
    for (size_t i = 0; i < timings.size(); ++i) {
      const Timing& t = timings[i];
      const double gbps = t.bytes / (t.median_us * 1e3);
      o << (i ? "," : "") << "\n    {\"name\": " << JsonString(t.name) << ", \"median_us\": " << JsonNumber(t.median_us)
        << ", \"p10_us\": " << JsonNumber(t.p10_us) << ", \"p90_us\": " << JsonNumber(t.p90_us)
        << ", \"bytes\": " << JsonNumber(t.bytes) << ", \"gbps\": " << JsonNumber(gbps)
        << ", \"fraction_of_peak\": " << (peak_gbps > 0 ? JsonNumber(gbps / peak_gbps) : "null");
      if (t.bytes_one_pass > 0) {
        const double g1 = t.bytes_one_pass / (t.median_us * 1e3);
        o << ", \"bytes_one_pass\": " << JsonNumber(t.bytes_one_pass)
          << ", \"fraction_of_peak_one_pass\": " << (peak_gbps > 0 ? JsonNumber(g1 / peak_gbps) : "null");
      }
      o << "}";
    }
    o << "\n  ]\n}\n";
    return static_cast<bool>(o);
  }
};

int Finish(const Report& r, const Options& o, int code) {
  r.Print();
  if (!r.Write(o.out)) {
    std::fprintf(stderr, "cannot write '%s'\n", o.out.c_str());
    return kExitFail;
  }
  std::printf("wrote %s\n", o.out.c_str());
  return code;
}

}  // namespace

int main(int argc, char** argv) {
  Options opt;
  if (!ParseArgs(argc, argv, &opt)) return kExitUsage;
  std::vector<Shape> shapes;
  if (!ReadShapes(opt.shapes, &shapes)) return kExitUsage;

  Report report;
  report.shapes = opt.shapes;
  std::vector<int64_t> n;
  std::vector<uint32_t> flags;
  for (const Shape& s : shapes) {
    n.push_back(s.n);
    flags.push_back(s.flags);
  }
  report.num_tensors = static_cast<int64_t>(n.size());
  report.num_params = Total(n);
  std::printf("%s: %zu tensors, %lld parameters\n", opt.shapes.c_str(), n.size(),
              static_cast<long long>(report.num_params));

  // "No device" (exit 3, nothing to compare) only when there is no driver, or
  // it sees no GPU. This binary links the CUDA runtime statically, so a driver
  // older than it (CUDA 13 needs r580+) fails every call, cudaGetDeviceCount
  // included (cudaErrorInsufficientDriver): on a GPU machine that is a broken
  // setup, not a CPU-only one, and must fail rather than pass having checked
  // nothing. A driver of the same major version but an older minor one works
  // (minor version compatibility; the kernels are SASS, no PTX JIT), so the
  // versions decide nothing here: the calls' errors do.
  int driver = 0, runtime = 0, devices = 0;
  const cudaError_t drv_err = cudaDriverGetVersion(&driver);  // 0 and cudaSuccess when no driver is installed
  const cudaError_t rt_err = cudaRuntimeGetVersion(&runtime);
  const cudaError_t dev_err = cudaGetDeviceCount(&devices);
  const bool no_device = (drv_err == cudaSuccess && driver == 0) || dev_err == cudaErrorNoDevice ||
                         (dev_err == cudaSuccess && devices == 0);
  auto version = [](int v) { return std::to_string(v / 1000) + "." + std::to_string(v % 1000 / 10); };
  if (!no_device && (drv_err != cudaSuccess || rt_err != cudaSuccess || dev_err != cudaSuccess)) {
    const cudaError_t err = drv_err != cudaSuccess ? drv_err : rt_err != cudaSuccess ? rt_err : dev_err;
    const std::string why = std::string("the CUDA driver supports CUDA ") + version(driver) +
                            ", this harness links the CUDA " + version(runtime) + " runtime: " + cudaGetErrorName(err) +
                            " (" + cudaGetErrorString(err) + ")" +
                            (err == cudaErrorInsufficientDriver || driver / 1000 < runtime / 1000
                                 ? "; install a driver for CUDA " + version(runtime) + " or newer (r580+ for CUDA 13)"
                                 : "");
    std::fprintf(stderr, "FAILED: cannot use the GPU: %s\n", why.c_str());
    report.checks.push_back(Check{"CUDA driver usable: " + why, false, 0.0, 0, 0});
    report.peak_source = "CUDA unusable";
    return Finish(report, opt, kExitFail);
  }
  if (no_device) {
    // Still exercise the CPU reference (one f32 step) and the device-free checks.
    std::printf("no CUDA device: running the CPU reference and the argument checks only\n");
    LarsData<float> d = MakeLars<float>(n, flags, false, 1);
    const auto list = LarsList(d, d.w.data(), d.v.data(), d.g.data());
    const float lr = 0.5f;
    const auto t0 = std::chrono::steady_clock::now();
    const int rc = hvrep_lars_cpu(HVREP_F32, static_cast<int>(list.size()), list.data(), &lr, Hparams(0), nullptr,
                                  nullptr);
    report.cpu_lars_step_ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
    report.checks.push_back(Check{"CPU LARS step runs", rc == HVREP_OK, 0.0, 0, report.num_params});
    for (const Check& c : CheckArguments()) report.checks.push_back(c);
    Rng rng(2024);
    for (const Check& c : CheckUnpackPerPiece(false, nullptr, rng)) report.checks.push_back(c);
    report.peak_source = "no device";
    const int code = Finish(report, opt, kExitNoDevice);
    const std::string why = drv_err == cudaSuccess && driver == 0 ? "no CUDA driver installed"
                            : dev_err != cudaSuccess ? cudaGetErrorString(dev_err)
                                                     : "cudaGetDeviceCount found 0 devices";
    std::printf("no CUDA device: %s; the CPU reference ran (one LARS step, %.1f ms); nothing to compare\n",
                why.c_str(), report.cpu_lars_step_ms);
    return report.Passed() ? code : kExitFail;
  }

  int dev = 0;
  CudaCheck(cudaGetDevice(&dev), "cudaGetDevice");
  cudaDeviceProp prop;
  CudaCheck(cudaGetDeviceProperties(&prop, dev), "cudaGetDeviceProperties");
  report.device = prop.name;
  // CUDA 13 dropped cudaDeviceProp::memoryClockRate; the attribute remains.
  int clock_khz = 0, bus_bits = 0;
  cudaDeviceGetAttribute(&clock_khz, cudaDevAttrMemoryClockRate, dev);
  cudaDeviceGetAttribute(&bus_bits, cudaDevAttrGlobalMemoryBusWidth, dev);
  if (opt.peak_gbps > 0) {
    report.peak_gbps = opt.peak_gbps;
    report.peak_source = "--peak-gbps";
  } else {
    report.peak_gbps = 2.0 * clock_khz * 1e3 * bus_bits / 8 / 1e9;  // double data rate
    report.peak_source = "2 x memory clock x bus width (device attributes; H100 SXM: 3352)";
  }
  std::printf("device: %s, peak memory bandwidth %.0f GB/s (%s)\n", prop.name, report.peak_gbps,
              report.peak_source.c_str());

  // A blocking stream: the uploads (cudaMemcpy) and cudaMemset run on the
  // legacy default stream, and can still be in flight when they return (a
  // pageable H2D copy returns once staged; a memset of device memory is
  // asynchronous). Work on a blocking stream waits for the legacy stream's;
  // a cudaStreamNonBlocking one would not, and could read the buffers early.
  cudaStream_t stream;
  CudaCheck(cudaStreamCreate(&stream), "cudaStreamCreate");
  Rng rng(2024);

  // --- Correctness.
  for (const Check& c : CheckArguments()) report.checks.push_back(c);
  {
    LarsData<float> d = MakeLars<float>(n, flags, false, 1);
    for (const Check& c : CheckLars("LARS f32, ResNet-50", d, {1, 5}, 0, kTolF32, stream)) report.checks.push_back(c);
    for (const Check& c : CheckLars("LARS f32 nesterov, from there", d, {1}, 1, kTolF32, stream)) {
      report.checks.push_back(c);
    }
  }
  {
    LarsData<double> d = MakeLars<double>(n, flags, false, 2);
    for (const Check& c : CheckLars("LARS f64, ResNet-50", d, {1}, 0, kTolF64, stream)) report.checks.push_back(c);
  }
  // Awkward sizes: one element, chunk boundaries, odd tails, an empty tensor;
  // every third pointer misaligned by 1 or 2 elements.
  const std::vector<int64_t> odd = {1, 3, 0, 4, 5, 17, 16383, 16384, 16385, 40001, 2, 32768 + 7};
  std::vector<uint32_t> odd_flags;
  for (size_t i = 0; i < odd.size(); ++i) odd_flags.push_back(i % 2 ? 0u : (HVREP_LARS_DECAY | HVREP_LARS_ADAPT));
  {
    LarsData<float> d = MakeLars<float>(odd, odd_flags, true, 3);
    for (const Check& c : CheckLars("LARS f32, odd sizes, misaligned", d, {1}, 0, kTolF32, stream)) {
      report.checks.push_back(c);
    }
    LarsData<double> e = MakeLars<double>(odd, odd_flags, true, 4);
    for (const Check& c : CheckLars("LARS f64, odd sizes, misaligned", e, {1}, 1, kTolF64, stream)) {
      report.checks.push_back(c);
    }
  }
  const std::vector<int> all_f32(n.size(), HVREP_F32), all_f16(n.size(), HVREP_F16);
  std::vector<int> mixed(n.size()), odd_mixed(odd.size());
  for (size_t i = 0; i < mixed.size(); ++i) mixed[i] = static_cast<int>(i % 4);
  for (size_t i = 0; i < odd_mixed.size(); ++i) odd_mixed[i] = static_cast<int>(i % 4);
  const std::vector<int> odd_f32(odd.size(), HVREP_F32);
  auto add = [&](const Check& c) { report.checks.push_back(c); };
  add(CheckPack("pack f32->f16, scale 1/8", n, all_f32, HVREP_F16, 0.125, stream, rng));
  add(CheckPack("pack f32->bf16, scale 1/3", n, all_f32, HVREP_BF16, 1.0 / 3, stream, rng));
  add(CheckPack("pack f32->f32, scale 1/8", n, all_f32, HVREP_F32, 0.125, stream, rng));
  add(CheckPack("pack f32->f32, scale 1/3", n, all_f32, HVREP_F32, 1.0 / 3, stream, rng));
  add(CheckPack("pack f16->f32, scale 1/3", n, all_f16, HVREP_F32, 1.0 / 3, stream, rng));
  add(CheckPack("pack mixed->f16, scale 1/3", n, mixed, HVREP_F16, 1.0 / 3, stream, rng));
  add(CheckPack("pack mixed->bf16, scale 1/3", n, mixed, HVREP_BF16, 1.0 / 3, stream, rng));
  add(CheckPack("pack mixed->f64, scale 1/3", n, mixed, HVREP_F64, 1.0 / 3, stream, rng));
  add(CheckPack("pack odd sizes f32->f16, scale 1/3", odd, odd_f32, HVREP_F16, 1.0 / 3, stream, rng));
  add(CheckPack("pack odd sizes mixed->f32, scale 1/3", odd, odd_mixed, HVREP_F32, 1.0 / 3, stream, rng));
  // Every source one element past its 64-byte alignment, the buffer aligned
  // (ResNet-50's counts are multiples of 4): the scalar-load, vector-store path.
  add(CheckPack("pack f32->f16, sources misaligned, scale 1/3", n, all_f32, HVREP_F16, 1.0 / 3, stream, rng, true));
  add(CheckPack("pack mixed->f32, sources misaligned, scale 1/3", n, mixed, HVREP_F32, 1.0 / 3, stream, rng, true));
  add(CheckPack("pack empty list", {}, {}, HVREP_F16, 1.0, stream, rng));
  add(CheckUnpack("unpack f16->f32, scale 1/8", n, HVREP_F16, all_f32, 0.125, stream, rng));
  add(CheckUnpack("unpack f32->f32, scale 1/3", n, HVREP_F32, all_f32, 1.0 / 3, stream, rng));
  add(CheckUnpack("unpack bf16->mixed, scale 1/3", n, HVREP_BF16, mixed, 1.0 / 3, stream, rng));
  add(CheckUnpack("unpack f64->mixed, scale 1/3", n, HVREP_F64, mixed, 1.0 / 3, stream, rng));
  add(CheckUnpack("unpack odd sizes f32->mixed, scale 1/3", odd, HVREP_F32, odd_mixed, 1.0 / 3, stream, rng));
  add(CheckUnpack("unpack empty list", {}, HVREP_F32, {}, 1.0, stream, rng));
  for (const Check& c : CheckUnpackPerPiece(true, stream, rng)) add(c);

  // --- Timing on the shapes file's tensors (f32 weights and gradients).
  {
    LarsData<float> d = MakeLars<float>(n, flags, false, 5);
    const size_t bytes = d.w.size() * sizeof(float);
    DeviceBuffer w(bytes), v(bytes), g(bytes), lr(sizeof(float)), scales(sizeof(float) * n.size()),
        ssq(sizeof(double) * 2 * n.size());
    w.Upload(d.w.data(), bytes);
    v.Upload(d.v.data(), bytes);
    g.Upload(d.g.data(), bytes);
    const float lr_host = 1e-3f;  // small: 200 timed steps keep the weights sane
    lr.Upload(&lr_host, sizeof(float));
    const auto list = LarsList(d, w.get<float>(), v.get<float>(), g.get<float>());
    const int num = static_cast<int>(list.size());
    DeviceBuffer ws(hvrep_lars_cuda_workspace_bytes(num, list.data()));
    const hvrep_lars_hparams hp = Hparams(0);
    const double p = static_cast<double>(report.num_params) * sizeof(float);
    report.timings.push_back(Time(
        "LARS fused (2 launches)",
        [&] {
          HvCheck(hvrep_lars_cuda(HVREP_F32, num, list.data(), lr.get(), hp, ws.get(), ws.bytes(), stream),
                  "hvrep_lars_cuda");
        },
        stream, opt.warmup, opt.repeats, 7 * p, 5 * p));
    report.timings.push_back(Time(
        "LARS per tensor (5 kernels each)",
        [&] { NaiveLars(list, lr.get<float>(), ssq.get<double>(), scales.get<float>(), hp, stream); }, stream,
        opt.warmup, opt.repeats, 7 * p, 5 * p));

    // Pack / unpack of the gradients.
    const double elems = static_cast<double>(report.num_params);
    std::vector<hvrep_tensor_ref> refs32;
    for (const auto& t : list) refs32.push_back(hvrep_tensor_ref{const_cast<void*>(t.g), t.n, HVREP_F32});
    DeviceBuffer buf(report.num_params * sizeof(float)), d_scale(sizeof(double));
    const double scale = 0.125;
    d_scale.Upload(&scale, sizeof(double));
    DeviceBuffer pws(hvrep_pack_cuda_workspace_bytes(num));
    for (int dst : {HVREP_F16, HVREP_F32}) {
      const double eb = static_cast<double>(Size(dst));
      const char* dn = dst == HVREP_F16 ? "f16" : "f32";
      report.timings.push_back(Time(
          std::string("pack f32->") + dn,
          [&] {
            HvCheck(hvrep_pack_cuda(num, refs32.data(), buf.get(), dst, d_scale.get<double>(), pws.get(), pws.bytes(),
                                    stream),
                    "hvrep_pack_cuda");
          },
          stream, opt.warmup, opt.repeats, elems * (4 + eb), 0));
      // Unpack into the weights' buffer (the values do not matter here).
      std::vector<hvrep_tensor_ref> outs;
      for (const auto& t : list) outs.push_back(hvrep_tensor_ref{t.w, t.n, HVREP_F32});
      report.timings.push_back(Time(
          std::string("unpack ") + dn + "->f32",
          [&] {
            HvCheck(hvrep_unpack_cuda(buf.get(), dst, num, outs.data(), d_scale.get<double>(), pws.get(), pws.bytes(),
                                      stream),
                    "hvrep_unpack_cuda");
          },
          stream, opt.warmup, opt.repeats, elems * (4 + eb), 0));
    }
  }
  CudaCheck(cudaStreamDestroy(stream), "cudaStreamDestroy");
  const bool passed = report.Passed();
  const int code = Finish(report, opt, passed ? kExitOk : kExitFail);
  std::printf("%s\n", passed ? "PASS" : "FAIL: see the checks above");
  return code;
}
