// CPU implementation of kernels/include/hvrep_kernels.h, free of TensorFlow.
//
// It is the CPU kernel of the TF ops (kernels/tf/ wraps it with TensorFlow's
// thread pool) and the reference the CUDA harness checks the GPU against.
// Compiled with -ffp-contract=off: TensorFlow's own element-wise ops round
// after every multiply and add, and so does this file, so the fused op and
// the per-variable Keras path agree to the last bit wherever the order of
// operations is the same (everything except the norms, see below).

#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "hvrep_kernels.h"

namespace {

// ---------------------------------------------------------------------------
// Half and bfloat16, as TensorFlow (Eigen) converts them: round to nearest
// even, via float for a double (Eigen's half(double) is half(float(double))).

struct f16 { uint16_t bits; };
struct bf16 { uint16_t bits; };

inline uint32_t FloatBits(float f) { uint32_t u; std::memcpy(&u, &f, 4); return u; }
inline float BitsFloat(uint32_t u) { float f; std::memcpy(&f, &u, 4); return f; }

// Eigen's float_to_half_rtne (Fabian Giesen's algorithm), written without
// branches: every case is computed and the right one selected, so the compiler
// vectorises a loop of conversions. Eigen's own is branchy and scalar; the
// hardware's (F16C) conversion is vectorised but keeps NaN payloads, where
// TensorFlow's cast (Eigen) returns the canonical quiet NaN: results must match
// TensorFlow's bit for bit.
inline uint16_t FloatToHalf(float ff) {
  const uint32_t f32infty = 255u << 23, f16max = (127u + 16u) << 23;
  const uint32_t denorm_magic_bits = ((127u - 15u) + (23u - 10u) + 1u) << 23;
  const uint32_t all = FloatBits(ff);
  const uint32_t sign = all & 0x80000000u;
  const uint32_t f = all ^ sign;
  const uint32_t overflow = f > f32infty ? 0x7e00u : 0x7c00u;  // NaN : Inf (or too large)
  // Subnormal or zero result: the FPU's add rounds the mantissa into place.
  const uint32_t subnormal = FloatBits(BitsFloat(f) + BitsFloat(denorm_magic_bits)) - denorm_magic_bits;
  // Normal: rebias the exponent and round to nearest even.
  const uint32_t normal = (f + ((15u - 127u) << 23) + 0xfffu + ((f >> 13) & 1u)) >> 13;
  const uint32_t o = f >= f16max ? overflow : (f < (113u << 23) ? subnormal : normal);
  return static_cast<uint16_t>((o & 0xffffu) | (sign >> 16));
}

inline float HalfToFloat(uint16_t h) {
  const uint32_t shifted_exp = 0x7c00u << 13;
  uint32_t o = (h & 0x7fffu) << 13;
  const uint32_t exp = shifted_exp & o;
  o += (127u - 15u) << 23;
  if (exp == shifted_exp) {
    o += (128u - 16u) << 23;  // Inf / NaN
  } else if (exp == 0) {
    o += 1u << 23;  // zero / subnormal: renormalise
    o = FloatBits(BitsFloat(o) - BitsFloat(113u << 23));
  }
  return BitsFloat(o | ((h & 0x8000u) << 16));
}

// Eigen's float_to_bfloat16_rtne.
inline uint16_t FloatToBf16(float ff) {
  if (std::isnan(ff)) return std::signbit(ff) ? 0xffc0 : 0x7fc0;
  const uint32_t input = FloatBits(ff);
  const uint32_t lsb = (input >> 16) & 1u;
  return static_cast<uint16_t>((input + 0x7fffu + lsb) >> 16);
}
inline float Bf16ToFloat(uint16_t b) { return BitsFloat(static_cast<uint32_t>(b) << 16); }

// Arithmetic type of each storage type: half and bfloat16 multiply in float
// and round once, as Eigen does.
template <typename T> struct Arith { using type = T; };
template <> struct Arith<f16> { using type = float; };
template <> struct Arith<bf16> { using type = float; };

template <typename T> inline typename Arith<T>::type Load(const T& x) { return x; }
inline float Load(const f16& x) { return HalfToFloat(x.bits); }
inline float Load(const bf16& x) { return Bf16ToFloat(x.bits); }

// Stores an arithmetic value (float or double) into storage type T. From a
// double, half and bfloat16 round through float, exactly as Eigen's
// half(double) does. The float overloads keep the float paths free of double
// conversions, so they vectorise.
template <typename T> inline T StoreFrom(float x) { return static_cast<T>(x); }
template <> inline f16 StoreFrom<f16>(float x) { return f16{FloatToHalf(x)}; }
template <> inline bf16 StoreFrom<bf16>(float x) { return bf16{FloatToBf16(x)}; }
template <typename T> inline T StoreFrom(double x) { return static_cast<T>(x); }
template <> inline f16 StoreFrom<f16>(double x) { return f16{FloatToHalf(static_cast<float>(x))}; }
template <> inline bf16 StoreFrom<bf16>(double x) { return bf16{FloatToBf16(static_cast<float>(x))}; }

// Rounds an arithmetic-type value to the storage type T and back: the
// result of an f16/bf16 multiply; a no-op for f32/f64.
template <typename T> inline typename Arith<T>::type Round(typename Arith<T>::type x) { return x; }
template <> inline float Round<f16>(float x) { return Load(StoreFrom<f16>(x)); }
template <> inline float Round<bf16>(float x) { return Load(StoreFrom<bf16>(x)); }

// ---------------------------------------------------------------------------
// Work sharing.

void RunSerial(void* /*pool*/, int64_t num_units, hvrep_range_fn fn, void* arg) {
  if (num_units > 0) fn(arg, 0, num_units);
}

template <typename F>
void ParallelFor(hvrep_parallel_for pf, void* pool, int64_t num_units, F&& body) {
  if (num_units <= 0) return;
  auto trampoline = [](void* arg, int64_t begin, int64_t end) { (*static_cast<F*>(arg))(begin, end); };
  (pf ? pf : RunSerial)(pool, num_units, trampoline, &body);
}

// ---------------------------------------------------------------------------
// LARS.
//
// Work is cut into units of at most kChunk elements. The step needs each
// tensor's norms before it can update any of its elements, so a tensor is
// read twice. Two choices keep the second read in cache:
//  - a tensor of at most kChunk elements (most of ResNet-50's 161: batch norm
//    vectors, biases, 1x1 convolutions up to 256x256) is one unit that
//    computes its norms and updates it at once, while it sits in L1/L2;
//  - larger tensors are split into kChunk-element chunks; their partial sums
//    are computed by one parallel pass, then a second pass updates them.
//    Tensors are taken in groups of about kGroupBytes of weights + gradients,
//    each group finishing both passes before the next starts, so the second
//    pass re-reads from the shared L3 (32 MiB on the EPYC this was tuned on)
//    rather than from memory: 5 arrays' worth of memory traffic instead of 7.
// Partial sums are per chunk and combined in chunk order, so the result does
// not depend on the number of threads or on how units are scheduled.
constexpr int64_t kChunk = 1 << 15;           // elements; 128 KiB per f32 array
constexpr int64_t kGroupBytes = 12ll << 20;  // weights + gradients of one group

// Sum of squares in double with 8 independent accumulators (a fixed order, so
// deterministic, and wide enough for the compiler to vectorise).
template <typename T>
double SumSquares(const T* x, int64_t n) {
  double acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    for (int k = 0; k < 8; ++k) {
      const double v = static_cast<double>(x[i + k]);
      acc[k] += v * v;
    }
  }
  for (; i < n; ++i) {
    const double v = static_cast<double>(x[i]);
    acc[i & 7] += v * v;
  }
  return ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
}

template <typename T>
struct LarsTensor {
  T* w;
  T* v;
  const T* g;
  int64_t n;
  T wd;            // weight decay of this tensor (0 when not decayed)
  bool adapt;
  double ssq_w, ssq_g;  // filled by the norm pass
  T scale;              // lr * ratio, filled before the update pass
};

template <typename T>
T LarsScale(const LarsTensor<T>& t, T lr, const hvrep_lars_hparams& hp) {
  if (!t.adapt) return lr;
  const T w_norm = static_cast<T>(std::sqrt(t.ssq_w));
  const T g_norm = static_cast<T>(std::sqrt(t.ssq_g));
  if (!(w_norm > T(0) && g_norm > T(0))) return lr;
  const T denom = g_norm + t.wd * w_norm + static_cast<T>(hp.epsilon);
  const T ratio = static_cast<T>(hp.eta) * w_norm / denom;
  return lr * ratio;
}

template <typename T>
void LarsUpdate(const LarsTensor<T>& t, int64_t begin, int64_t end, T momentum, bool nesterov) {
  T* __restrict w = t.w;
  T* __restrict v = t.v;
  const T* __restrict g = t.g;
  const T wd = t.wd, scale = t.scale;
  if (nesterov) {
    for (int64_t i = begin; i < end; ++i) {
      const T gt = wd != T(0) ? g[i] + wd * w[i] : g[i];
      const T scaled = scale * gt;
      const T nv = momentum * v[i] + scaled;
      v[i] = nv;
      w[i] = w[i] - (momentum * nv + scaled);
    }
  } else {
    for (int64_t i = begin; i < end; ++i) {
      const T gt = wd != T(0) ? g[i] + wd * w[i] : g[i];
      const T nv = momentum * v[i] + scale * gt;
      v[i] = nv;
      w[i] = w[i] - nv;
    }
  }
}

struct Chunk {
  int32_t tensor;
  int64_t begin, end;
};

template <typename T>
int LarsCpu(int num_tensors, const hvrep_lars_tensor* in, const T* lr_ptr, const hvrep_lars_hparams& hp,
            hvrep_parallel_for pf, void* pool) {
  const T lr = *lr_ptr;
  const T momentum = static_cast<T>(hp.momentum);
  const bool nesterov = hp.nesterov != 0;
  std::vector<LarsTensor<T>> ts(num_tensors);
  for (int i = 0; i < num_tensors; ++i) {
    const uint32_t flags = in[i].flags;
    ts[i] = LarsTensor<T>{static_cast<T*>(in[i].w), static_cast<T*>(in[i].v), static_cast<const T*>(in[i].g),
                          in[i].n, (flags & HVREP_LARS_DECAY) ? static_cast<T>(hp.weight_decay) : T(0),
                          (flags & HVREP_LARS_ADAPT) != 0, 0.0, 0.0, lr};
  }
  std::vector<Chunk> big;      // chunks of the group's large tensors
  std::vector<double> partial;  // 2 per big chunk: ssq_w, ssq_g
  std::vector<int32_t> small;  // the group's small tensors, one unit each
  int i = 0;
  while (i < num_tensors) {
    big.clear();
    small.clear();
    int64_t bytes = 0;
    int first_big = -1, last_big = -1;
    for (; i < num_tensors && (bytes == 0 || bytes + 2 * ts[i].n * int64_t(sizeof(T)) <= kGroupBytes); ++i) {
      const int64_t n = ts[i].n;
      if (n == 0) continue;
      bytes += 2 * n * int64_t(sizeof(T));
      if (n <= kChunk) {
        small.push_back(i);
      } else {
        if (first_big < 0) first_big = i;
        last_big = i;
        for (int64_t b = 0; b < n; b += kChunk) big.push_back(Chunk{i, b, b + kChunk < n ? b + kChunk : n});
      }
    }
    // Pass 1: partial sums of squares of the large tensors (only adapted ones need them).
    partial.assign(2 * big.size(), 0.0);
    ParallelFor(pf, pool, static_cast<int64_t>(big.size()), [&](int64_t b, int64_t e) {
      for (int64_t c = b; c < e; ++c) {
        const LarsTensor<T>& t = ts[big[c].tensor];
        if (!t.adapt) continue;
        const int64_t len = big[c].end - big[c].begin;
        partial[2 * c] = SumSquares(t.w + big[c].begin, len);
        partial[2 * c + 1] = SumSquares(t.g + big[c].begin, len);
      }
    });
    if (first_big >= 0) {
      for (int t = first_big; t <= last_big; ++t) ts[t].ssq_w = ts[t].ssq_g = 0.0;
      for (size_t c = 0; c < big.size(); ++c) {  // in chunk order: deterministic
        ts[big[c].tensor].ssq_w += partial[2 * c];
        ts[big[c].tensor].ssq_g += partial[2 * c + 1];
      }
      for (int t = first_big; t <= last_big; ++t) {
        if (ts[t].n > kChunk) ts[t].scale = LarsScale(ts[t], lr, hp);
      }
    }
    // Pass 2: every large chunk, then every small tensor (norms and update in one unit).
    const int64_t num_big = static_cast<int64_t>(big.size());
    ParallelFor(pf, pool, num_big + static_cast<int64_t>(small.size()), [&](int64_t b, int64_t e) {
      for (int64_t u = b; u < e; ++u) {
        if (u < num_big) {
          LarsUpdate(ts[big[u].tensor], big[u].begin, big[u].end, momentum, nesterov);
        } else {
          LarsTensor<T>& t = ts[small[u - num_big]];
          if (t.adapt) {
            t.ssq_w = SumSquares(t.w, t.n);
            t.ssq_g = SumSquares(t.g, t.n);
          }
          t.scale = LarsScale(t, lr, hp);
          LarsUpdate(t, 0, t.n, momentum, nesterov);
        }
      }
    });
  }
  return HVREP_OK;
}

// ---------------------------------------------------------------------------
// Pack / unpack.

// Units of at most kCopyChunk elements, so one large tensor is shared among
// threads and many small ones are not each a unit of their own.
constexpr int64_t kCopyChunk = 1 << 16;

struct Span {
  int32_t tensor;
  int64_t begin, end;  // elements of that tensor
};

std::vector<Span> Spans(int num_tensors, const hvrep_tensor_ref* refs) {
  std::vector<Span> spans;
  for (int i = 0; i < num_tensors; ++i) {
    for (int64_t b = 0; b < refs[i].n; b += kCopyChunk) {
      spans.push_back(Span{i, b, b + kCopyChunk < refs[i].n ? b + kCopyChunk : refs[i].n});
    }
  }
  return spans;
}

// The conversion loops are compiled for AVX-512, AVX2 and the x86-64-v2
// baseline, and the loader picks one for the CPU it runs on (GCC function
// multi-versioning). The half/bfloat16 conversions are compute-bound at SSE
// width: with the baseline alone, fused pack f32->f16 ran at half the speed of
// TensorFlow's cast + concat; the rest of this file is memory-bound and gains
// nothing from wider vectors.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && !defined(__CUDACC__)
#define HVREP_MULTIVERSION __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define HVREP_MULTIVERSION
#endif

// dst[j] = cast<D>(src[j] * cast<S>(scale)): the multiply in S, rounded to S.
template <typename S, typename D>
HVREP_MULTIVERSION void PackSpan(const S* src, D* dst, int64_t n, double scale) {
  using A = typename Arith<S>::type;
  const A s = Load(StoreFrom<S>(scale));
  for (int64_t j = 0; j < n; ++j) {
    dst[j] = StoreFrom<D>(Round<S>(Load(src[j]) * s));
  }
}

// dst[j] = cast<D>(src[j]) * cast<D>(scale): the multiply in D, rounded to D.
template <typename S, typename D>
HVREP_MULTIVERSION void UnpackSpan(const S* src, D* dst, int64_t n, double scale) {
  using A = typename Arith<D>::type;
  const A s = Load(StoreFrom<D>(scale));
  for (int64_t j = 0; j < n; ++j) {
    const A x = Load(StoreFrom<D>(Load(src[j])));
    dst[j] = StoreFrom<D>(x * s);  // one rounding to D
  }
}

template <template <typename, typename> class F, typename S, typename... Args>
bool DispatchDst(int dst_dtype, Args... args) {
  switch (dst_dtype) {
    case HVREP_F16: F<S, f16>::Run(args...); return true;
    case HVREP_BF16: F<S, bf16>::Run(args...); return true;
    case HVREP_F32: F<S, float>::Run(args...); return true;
    case HVREP_F64: F<S, double>::Run(args...); return true;
    default: return false;
  }
}

template <template <typename, typename> class F, typename... Args>
bool Dispatch(int src_dtype, int dst_dtype, Args... args) {
  switch (src_dtype) {
    case HVREP_F16: return DispatchDst<F, f16>(dst_dtype, args...);
    case HVREP_BF16: return DispatchDst<F, bf16>(dst_dtype, args...);
    case HVREP_F32: return DispatchDst<F, float>(dst_dtype, args...);
    case HVREP_F64: return DispatchDst<F, double>(dst_dtype, args...);
    default: return false;
  }
}

template <typename S, typename D>
struct PackFn {
  static void Run(const void* src, void* dst, int64_t n, double scale) {
    PackSpan(static_cast<const S*>(src), static_cast<D*>(dst), n, scale);
  }
};

template <typename S, typename D>
struct UnpackFn {
  static void Run(const void* src, void* dst, int64_t n, double scale) {
    UnpackSpan(static_cast<const S*>(src), static_cast<D*>(dst), n, scale);
  }
};

bool ValidDtype(int dtype) { return dtype >= HVREP_F16 && dtype <= HVREP_F64; }

int CheckRefs(int num_tensors, const hvrep_tensor_ref* refs) {
  if (num_tensors < 0 || (num_tensors > 0 && refs == nullptr)) return HVREP_EINVAL;
  for (int i = 0; i < num_tensors; ++i) {
    if (refs[i].n < 0 || !ValidDtype(refs[i].dtype) || (refs[i].n > 0 && refs[i].ptr == nullptr)) return HVREP_EINVAL;
  }
  return HVREP_OK;
}

// Element offsets of each tensor in the buffer.
std::vector<int64_t> Offsets(int num_tensors, const hvrep_tensor_ref* refs) {
  std::vector<int64_t> off(num_tensors + 1, 0);
  for (int i = 0; i < num_tensors; ++i) off[i + 1] = off[i] + refs[i].n;
  return off;
}

// pack (kPack) or unpack between the tensors `refs` and the rank-1 `buffer`
// of `buffer_dtype`; the buffer is written by pack and read by unpack.
template <bool kPack>
int CopyCpu(int num_tensors, const hvrep_tensor_ref* refs, void* buffer, int buffer_dtype, const double* scale,
            hvrep_parallel_for pf, void* pool) {
  if (int rc = CheckRefs(num_tensors, refs); rc != HVREP_OK) return rc;
  if (!ValidDtype(buffer_dtype) || scale == nullptr) return HVREP_EINVAL;
  const std::vector<int64_t> off = Offsets(num_tensors, refs);
  if (off[num_tensors] > 0 && buffer == nullptr) return HVREP_EINVAL;
  const std::vector<Span> spans = Spans(num_tensors, refs);
  const size_t bsize = hvrep_dtype_size(buffer_dtype);
  const double s = *scale;
  ParallelFor(pf, pool, static_cast<int64_t>(spans.size()), [&](int64_t b, int64_t e) {
    for (int64_t u = b; u < e; ++u) {
      const Span& sp = spans[u];
      const hvrep_tensor_ref& r = refs[sp.tensor];
      char* tensor = static_cast<char*>(r.ptr) + sp.begin * hvrep_dtype_size(r.dtype);
      char* buf = static_cast<char*>(buffer) + (off[sp.tensor] + sp.begin) * bsize;
      if (kPack) {
        Dispatch<PackFn>(r.dtype, buffer_dtype, static_cast<const void*>(tensor), static_cast<void*>(buf),
                         sp.end - sp.begin, s);
      } else {
        Dispatch<UnpackFn>(buffer_dtype, r.dtype, static_cast<const void*>(buf), static_cast<void*>(tensor),
                           sp.end - sp.begin, s);
      }
    }
  });
  return HVREP_OK;
}

}  // namespace

extern "C" {

size_t hvrep_dtype_size(int dtype) {
  switch (dtype) {
    case HVREP_F16:
    case HVREP_BF16: return 2;
    case HVREP_F32: return 4;
    case HVREP_F64: return 8;
    default: return 0;
  }
}

const char* hvrep_strerror(int code) {
  switch (code) {
    case HVREP_OK: return "ok";
    case HVREP_EINVAL: return "invalid argument: a negative count, a null pointer or an unknown dtype";
    case HVREP_EWORKSPACE: return "the CUDA workspace is smaller than the *_cuda_workspace_bytes function asks for";
    default: return code > 0 ? "CUDA error (see hvrep_cuda_strerror)" : "unknown hvrep error code";
  }
}

int hvrep_lars_cpu(int dtype, int num_tensors, const hvrep_lars_tensor* tensors, const void* lr,
                   hvrep_lars_hparams hp, hvrep_parallel_for parallel_for, void* pool) {
  if (num_tensors < 0 || (num_tensors > 0 && (tensors == nullptr || lr == nullptr))) return HVREP_EINVAL;
  for (int i = 0; i < num_tensors; ++i) {
    const hvrep_lars_tensor& t = tensors[i];
    if (t.n < 0 || (t.n > 0 && (t.w == nullptr || t.v == nullptr || t.g == nullptr))) return HVREP_EINVAL;
  }
  if (num_tensors == 0) return HVREP_OK;
  switch (dtype) {
    case HVREP_F32: return LarsCpu(num_tensors, tensors, static_cast<const float*>(lr), hp, parallel_for, pool);
    case HVREP_F64: return LarsCpu(num_tensors, tensors, static_cast<const double*>(lr), hp, parallel_for, pool);
    default: return HVREP_EINVAL;
  }
}

int hvrep_pack_cpu(int num_tensors, const hvrep_tensor_ref* srcs, void* dst, int dst_dtype, const double* scale,
                   hvrep_parallel_for parallel_for, void* pool) {
  return CopyCpu</*kPack=*/true>(num_tensors, srcs, dst, dst_dtype, scale, parallel_for, pool);
}

int hvrep_unpack_cpu(const void* src, int src_dtype, int num_tensors, const hvrep_tensor_ref* dsts,
                     const double* scale, hvrep_parallel_for parallel_for, void* pool) {
  return CopyCpu</*kPack=*/false>(num_tensors, dsts, const_cast<void*>(src), src_dtype, scale, parallel_for, pool);
}

}  // extern "C"
