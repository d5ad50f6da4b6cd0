// Shared pieces of the CUDA kernels (lars.cu, pack.cu): the chunking constants,
// the workspace layout helpers, the chunk -> tensor search, exactly rounded
// arithmetic and the dtype conversions. Internal; not part of the C interface.
#ifndef HVREP_KERNELS_SRC_CUDA_COMMON_CUH_
#define HVREP_KERNELS_SRC_CUDA_COMMON_CUH_

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <cstring>
#include <utility>
#include <vector>

#include "hvrep_kernels.h"

namespace hvrep_cuda {

// Every list is cut into chunks of kChunk elements (the last chunk of a tensor
// is shorter), one thread block per chunk. Why 16384:
//  - ResNet-50's 25.6M parameters make ~1,560 full chunks plus one short chunk
//    for each of the ~110 small tensors: ~1,700 blocks. An H100 holds 132 SMs x
//    (4-8) blocks of 256 threads, so the grid is about two waves, and a block
//    is ~1/13 of an SM's share of the work: the SMs finish within one block of
//    each other. 64K-element chunks would leave ~3 blocks per SM and a 25-30%
//    tail; 4K chunks would spend a larger share of each block on its fixed
//    start-up (finding its tensor, combining the partial sums: ~1-2 us of
//    dependent L2 loads, hidden only while other blocks on the SM stream).
//  - 16384 elements / 256 threads = 64 elements per thread = 16 float4 per
//    array, i.e. 4 trips of the 4-way unrolled loops below: enough loads in
//    flight per thread (4 x 16 B per array) to cover HBM latency at full
//    occupancy and at one block per SM during the tail.
//  - A multiple of every vector width (4 elements), so each chunk of a tensor
//    has the alignment of the tensor's first element.
//  - The LARS workspace holds one double2 of partial sums per chunk: 16 B per
//    64 KiB of f32 weights, negligible.
constexpr int kChunk = 1 << 14;
constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int kUnroll = 4;  // vectors loaded per array before any is used

// The workspace handed in by the caller is aligned up to this internally (the
// *_workspace_bytes functions add the slack), so callers may pass any pointer.
constexpr size_t kWorkspaceAlign = 256;

inline size_t AlignUp(size_t x, size_t a) { return (x + a - 1) / a * a; }

inline bool ValidDtype(int dtype) { return dtype >= HVREP_F16 && dtype <= HVREP_F64; }

inline int64_t NumChunks(int64_t n) { return (n + kChunk - 1) / kChunk; }

// Copies the host-built metadata `host` into the (aligned) workspace.
// What the CUDA docs promise ("API synchronization behavior",
// https://docs.nvidia.com/cuda/cuda-runtime-api/api-sync-behavior.html): an
// async copy from pageable memory "might be synchronous with respect to host",
// and if it must be staged, "the driver may synchronize with the stream and
// stage the copy into pinned memory". Either way the pageable bytes have been
// read when the call returns, so `host` (a std::vector of ours, so pageable
// whatever memory the caller's arrays live in) may be freed when we return.
// The cost that leaves: the driver may wait for the stream's earlier work
// before staging, i.e. a possible host-side stream synchronisation per
// hvrep_*_cuda call, which would stall a caller that enqueues ahead. The way
// out, passing the tables as kernel parameters (up to ~32 KB on CUDA 12.1+)
// instead of through the workspace, caps the list length and so changes what
// the C interface promises; it is a follow-up, not done here.
inline int StageMetadata(const std::vector<unsigned char>& host, void* device, cudaStream_t stream) {
  if (host.empty()) return HVREP_OK;
  const cudaError_t err = cudaMemcpyAsync(device, host.data(), host.size(), cudaMemcpyHostToDevice, stream);
  return err == cudaSuccess ? HVREP_OK : static_cast<int>(err);
}

inline void* AlignWorkspace(void* workspace) {
  const uintptr_t p = reinterpret_cast<uintptr_t>(workspace);
  return reinterpret_cast<void*>(AlignUp(p, kWorkspaceAlign));
}

// Enqueues kernel<<<blocks, kThreads, 0, stream>>>(args...). cudaLaunchKernelEx
// returns this launch's own error (an invalid configuration, no kernel image
// for the device), where cudaGetLastError after <<<>>> could also return, and
// clear, an error some unrelated earlier call of the caller's left behind.
template <typename... Params, typename... Args>
inline int Launch(void (*kernel)(Params...), int blocks, cudaStream_t stream, Args&&... args) {
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(static_cast<unsigned>(blocks));
  cfg.blockDim = dim3(kThreads);
  cfg.dynamicSmemBytes = 0;
  cfg.stream = stream;
  const cudaError_t err = cudaLaunchKernelEx(&cfg, kernel, std::forward<Args>(args)...);
  return err == cudaSuccess ? HVREP_OK : static_cast<int>(err);
}

template <typename T>
inline void PutAt(std::vector<unsigned char>& buf, size_t offset, const T& value) {
  std::memcpy(buf.data() + offset, &value, sizeof(T));
}

// Index of the tensor that owns chunk `c`: the last t in [0, num) with
// first[t] <= c. `first` is strictly increasing (empty tensors are left out of
// the tables) and first[0] == 0. Called by all 32 lanes of a warp: a 32-way
// search needs 2 dependent loads for up to 1,024 tensors (a binary search over
// ResNet-50's 161 would need 8), and the table stays O(num_tensors), which the
// pack workspace must be (its size is a function of num_tensors alone).
__device__ __forceinline__ int FindTensor(const int32_t* __restrict__ first, int num, int32_t c) {
  const int lane = threadIdx.x & 31;
  int lo = 0, hi = num;  // invariant: first[lo] <= c < first[hi] (first[num] = infinity)
  while (hi - lo > 1) {
    const int step = (hi - lo + 31) >> 5;
    const int idx = lo + lane * step;
    const bool ok = idx < hi && __ldg(first + idx) <= c;
    // Lane 0 probes lo, always ok; first[] is increasing, so the ok lanes are a prefix.
    const unsigned mask = __ballot_sync(0xffffffffu, ok);
    lo += (31 - __clz(mask)) * step;
    hi = min(hi, lo + step);
  }
  return lo;
}

// Exactly rounded arithmetic. The CPU reference is compiled with
// -ffp-contract=off (as TensorFlow's element-wise ops round after every
// operation); nvcc would otherwise fuse a*b+c into an FMA and differ from it in
// the last bit. The _rn intrinsics are never contracted.
__device__ __forceinline__ float Add(float a, float b) { return __fadd_rn(a, b); }
__device__ __forceinline__ double Add(double a, double b) { return __dadd_rn(a, b); }
__device__ __forceinline__ float Sub(float a, float b) { return __fsub_rn(a, b); }
__device__ __forceinline__ double Sub(double a, double b) { return __dsub_rn(a, b); }
__device__ __forceinline__ float Mul(float a, float b) { return __fmul_rn(a, b); }
__device__ __forceinline__ double Mul(double a, double b) { return __dmul_rn(a, b); }
__device__ __forceinline__ float Div(float a, float b) { return __fdiv_rn(a, b); }
__device__ __forceinline__ double Div(double a, double b) { return __ddiv_rn(a, b); }

// Conversions between the storage types, rounding to nearest even, matching
// kernels/src/cpu.cc (which follows TensorFlow/Eigen):
//  - f16/bf16 -> float is exact, so every conversion into f16/bf16 from f16,
//    bf16 or f32 rounds once, through float;
//  - f64 -> f16 and f64 -> bf16 go through float (two roundings), because
//    Eigen's half(double) and bfloat16(double) are half(float(d)) and
//    bfloat16(float(d)). __double2half would round once and differ from
//    TensorFlow in the rare double-rounding cases, so it is not used.
template <typename T> struct Conv;
template <> struct Conv<float> {
  __device__ static float ToFloat(float x) { return x; }
  __device__ static float FromFloat(float x) { return x; }
  __device__ static float FromDouble(double x) { return __double2float_rn(x); }
};
template <> struct Conv<double> {
  __device__ static float ToFloat(double x) { return __double2float_rn(x); }
  __device__ static double FromFloat(float x) { return x; }
  __device__ static double FromDouble(double x) { return x; }
};
// NaN: TensorFlow's casts (Eigen; cpu.cc's FloatToHalf / FloatToBf16) give
// the canonical quiet NaN with the input's sign, 0x7e00|sign for f16 and
// 0x7fc0|sign for bf16, where __float2half_rn / __float2bfloat16_rn give 0x7fff.
// A select on isnan costs one compare per element and matches cpu.cc bit for
// bit. The sign is taken from the value converted (for a double, before it is
// narrowed: the GPU's f64 -> f32 conversion may drop a NaN's sign). The f32/f64
// arithmetic itself is not made to match: the GPU returns 0x7fffffff for every
// NaN result where x86 keeps an operand's payload and sign (IEEE 754 leaves
// both unspecified), so f32/f64 results match as "NaN where NaN", and the
// sign of an f16/bf16 NaN that came out of a multiply may differ.
__device__ __forceinline__ unsigned short NanSign(float x) {
  return static_cast<unsigned short>((__float_as_uint(x) >> 16) & 0x8000u);
}
__device__ __forceinline__ unsigned short NanSign(double x) {
  return static_cast<unsigned short>((static_cast<unsigned long long>(__double_as_longlong(x)) >> 48) & 0x8000u);
}
template <typename F>
__device__ __forceinline__ __half ToHalf(F x, float narrowed) {
  const __half r = __float2half_rn(narrowed);
  return isnan(x) ? __ushort_as_half(static_cast<unsigned short>(0x7e00u | NanSign(x))) : r;
}
template <typename F>
__device__ __forceinline__ __nv_bfloat16 ToBf16(F x, float narrowed) {
  const __nv_bfloat16 r = __float2bfloat16_rn(narrowed);
  return isnan(x) ? __ushort_as_bfloat16(static_cast<unsigned short>(0x7fc0u | NanSign(x))) : r;
}

template <> struct Conv<__half> {
  __device__ static float ToFloat(__half x) { return __half2float(x); }
  __device__ static __half FromFloat(float x) { return ToHalf(x, x); }
  __device__ static __half FromDouble(double x) { return ToHalf(x, __double2float_rn(x)); }
};
template <> struct Conv<__nv_bfloat16> {
  __device__ static float ToFloat(__nv_bfloat16 x) { return __bfloat162float(x); }
  __device__ static __nv_bfloat16 FromFloat(float x) { return ToBf16(x, x); }
  __device__ static __nv_bfloat16 FromDouble(double x) { return ToBf16(x, __double2float_rn(x)); }
};

// cast<To>(x): a double source converts directly (see above for f16/bf16);
// everything else goes through float, which is exact for f16/bf16/f32 sources.
template <typename To, typename From>
__device__ __forceinline__ To Cast(From x) {
  return Conv<To>::FromFloat(Conv<From>::ToFloat(x));
}
template <> __device__ __forceinline__ float Cast<float, double>(double x) { return __double2float_rn(x); }
template <> __device__ __forceinline__ double Cast<double, double>(double x) { return x; }
template <> __device__ __forceinline__ double Cast<double, float>(float x) { return x; }
template <> __device__ __forceinline__ double Cast<double, __half>(__half x) { return __half2float(x); }
template <> __device__ __forceinline__ double Cast<double, __nv_bfloat16>(__nv_bfloat16 x) { return __bfloat162float(x); }
template <> __device__ __forceinline__ __half Cast<__half, double>(double x) { return Conv<__half>::FromDouble(x); }
template <> __device__ __forceinline__ __nv_bfloat16 Cast<__nv_bfloat16, double>(double x) {
  return Conv<__nv_bfloat16>::FromDouble(x);
}

// a * b in the storage type T. For f16/bf16 the float product of two 11-bit
// (8-bit) significands is exact, so rounding it once to T is the exactly
// rounded T product, as Eigen computes it.
template <typename T>
__device__ __forceinline__ T MulIn(T a, T b) {
  return Conv<T>::FromFloat(__fmul_rn(Conv<T>::ToFloat(a), Conv<T>::ToFloat(b)));
}
template <> __device__ __forceinline__ float MulIn<float>(float a, float b) { return __fmul_rn(a, b); }
template <> __device__ __forceinline__ double MulIn<double>(double a, double b) { return __dmul_rn(a, b); }

// N consecutive elements moved with one (or, for 32 bytes, two) vector
// instructions; only used where the address is a multiple of sizeof(Vec).
template <typename T, int N>
struct alignas(sizeof(T) * N) Vec {
  T e[N];
};

// Global-memory loads and stores of a T (a scalar or a Vec) of 2 to 32 bytes.
// The kernels take their pointers from the metadata table, so the compiler
// sees generic pointers and would emit generic LD/ST (an address-space check
// per access, and no read-only path); these intrinsics force global ones.
//  - LoadRO: __ldg, the read-only (non-coherent) path, for data the kernel
//    never writes (gradients, pack/unpack sources).
//  - LoadRW / Store: __ldcg / __stcg (cache in L2, not L1), for the LARS
//    weights and momentum that a thread reads and then overwrites, which the
//    non-coherent path must not be used for.
#define HVREP_DEFINE_MEMOP(NAME, INTRIN)                                                           \
  template <typename T>                                                                            \
  __device__ __forceinline__ T NAME(const T* p) {                                                  \
    static_assert(sizeof(T) == 2 || sizeof(T) == 4 || sizeof(T) == 8 || sizeof(T) == 16 ||         \
                      sizeof(T) == 32, "unsupported access size");                                 \
    T r;                                                                                           \
    if constexpr (sizeof(T) == 2) {                                                                \
      const unsigned short x = INTRIN(reinterpret_cast<const unsigned short*>(p));                 \
      memcpy(&r, &x, 2);                                                                           \
    } else if constexpr (sizeof(T) == 4) {                                                         \
      const unsigned int x = INTRIN(reinterpret_cast<const unsigned int*>(p));                     \
      memcpy(&r, &x, 4);                                                                           \
    } else if constexpr (sizeof(T) == 8) {                                                         \
      const uint2 x = INTRIN(reinterpret_cast<const uint2*>(p));                                   \
      memcpy(&r, &x, 8);                                                                           \
    } else {                                                                                       \
      uint4 x[sizeof(T) / 16];                                                                     \
      for (int k = 0; k < static_cast<int>(sizeof(T) / 16); ++k) {                                 \
        x[k] = INTRIN(reinterpret_cast<const uint4*>(p) + k);                                      \
      }                                                                                            \
      memcpy(&r, x, sizeof(T));                                                                    \
    }                                                                                              \
    return r;                                                                                      \
  }
HVREP_DEFINE_MEMOP(LoadRO, __ldg)
HVREP_DEFINE_MEMOP(LoadRW, __ldcg)
#undef HVREP_DEFINE_MEMOP

template <typename T>
__device__ __forceinline__ void Store(T* p, const T& v) {
  if constexpr (sizeof(T) == 2) {
    unsigned short x;
    memcpy(&x, &v, 2);
    __stcg(reinterpret_cast<unsigned short*>(p), x);
  } else if constexpr (sizeof(T) == 4) {
    unsigned int x;
    memcpy(&x, &v, 4);
    __stcg(reinterpret_cast<unsigned int*>(p), x);
  } else if constexpr (sizeof(T) == 8) {
    uint2 x;
    memcpy(&x, &v, 8);
    __stcg(reinterpret_cast<uint2*>(p), x);
  } else {
    static_assert(sizeof(T) % 16 == 0 && sizeof(T) <= 32, "unsupported access size");
    uint4 x[sizeof(T) / 16];
    memcpy(x, &v, sizeof(T));
    for (int k = 0; k < static_cast<int>(sizeof(T) / 16); ++k) __stcg(reinterpret_cast<uint4*>(p) + k, x[k]);
  }
}

// Sum over the block of two doubles, in a fixed tree (so the same bits every
// run); the result is valid in thread 0. Contains a __syncthreads: every
// thread of the block must call it.
__device__ __forceinline__ void BlockSum2(double& a, double& b) {
  __shared__ double sa[kWarps], sb[kWarps];
  for (int off = 16; off > 0; off >>= 1) {
    a += __shfl_down_sync(0xffffffffu, a, off);
    b += __shfl_down_sync(0xffffffffu, b, off);
  }
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  if (lane == 0) {
    sa[warp] = a;
    sb[warp] = b;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    a = sa[0];
    b = sb[0];
    for (int k = 1; k < kWarps; ++k) {
      a += sa[k];
      b += sb[k];
    }
  }
}

}  // namespace hvrep_cuda

#endif  // HVREP_KERNELS_SRC_CUDA_COMMON_CUH_
