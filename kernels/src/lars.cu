// Multi-tensor LARS on CUDA: one step for a whole list of tensors in two
// kernel launches (semantics: kernels/include/hvrep_kernels.h).
//
// The list is cut into kChunk-element chunks (cuda_common.cuh says why 16384),
// one 256-thread block per chunk, and a tensor's norms are needed before any of
// its elements can be updated, so:
//   1. LarsSumSquares: each chunk of an adapted tensor writes the sums of
//      squares of its w and g, in double, to its own slot in the workspace;
//   2. LarsUpdate: each chunk's first warp combines its tensor's partial sums
//      in chunk order (a fixed order: every block of a tensor computes the same
//      bits, and so does every run), computes lr * ratio, and the block updates
//      the chunk's v and w.
// No float atomics anywhere, so a step is bit-for-bit reproducible. The
// weights and gradients are read twice (7 arrays of traffic; a one-pass kernel
// would move 5 but needs a grid-wide barrier or a re-launch per tensor).
//
// Workspace (offsets from the workspace aligned up to kWorkspaceAlign):
//   LarsMeta meta[num]      one per non-empty tensor, copied from the host
//   int32_t first[num]      first chunk of each tensor (strictly increasing)
//   double2 partials[chunks] (sum w^2, sum g^2), written by pass 1

#include <cmath>
#include <cstdint>
#include <vector>

#include "cuda_common.cuh"

namespace hvrep_cuda {
namespace {

struct LarsMeta {
  void* w;
  void* v;
  const void* g;
  int64_t n;
  int32_t first_chunk;
  int32_t num_chunks;
  uint32_t flags;
  uint32_t unused;
};

// Hyper-parameters converted once on the host to the LARS dtype, exactly as
// the CPU reference converts them (static_cast from double).
template <typename T>
struct LarsScalars {
  T momentum;
  T weight_decay;
  T eta;
  T epsilon;
  int nesterov;
};

struct LarsLayout {
  int num = 0;          // non-empty tensors
  int64_t chunks = 0;   // blocks of each launch
  size_t first_off = 0, partial_off = 0, bytes = 0;  // bytes: without the alignment slack
};

LarsLayout PlanLars(int num_tensors, const hvrep_lars_tensor* tensors) {
  LarsLayout l;
  for (int i = 0; i < num_tensors; ++i) {
    if (tensors[i].n > 0) {
      ++l.num;
      l.chunks += NumChunks(tensors[i].n);
    }
  }
  l.first_off = AlignUp(sizeof(LarsMeta) * l.num, 16);
  l.partial_off = AlignUp(l.first_off + sizeof(int32_t) * l.num, 16);
  l.bytes = l.partial_off + sizeof(double2) * static_cast<size_t>(l.chunks);
  return l;
}

template <typename T>
__device__ __forceinline__ void AddSquares(T x, double& acc) {
  const double d = static_cast<double>(x);
  acc = __fma_rn(d, d, acc);
}

// Sums of squares of w[0, len) and g[0, len) by this thread, in double: the
// CPU reference accumulates in double, and double makes the f32 norms agree
// with it to the last bit in all but ~1e-8 of cases (a float accumulator would
// differ by ~1e-7 relative, then a ulp of lr * ratio). A DFMA per element is
// free against HBM on data-centre parts (H100: 67 TFLOP/s FP64).
template <typename T>
__device__ __forceinline__ void ThreadSumSquares(const T* __restrict__ w, const T* __restrict__ g, int len,
                                                 double& sw, double& sg) {
  constexpr int kV = 16 / sizeof(T);  // float4 / double2
  using V = Vec<T, kV>;
  int done = 0;
  if ((reinterpret_cast<uintptr_t>(w) | reinterpret_cast<uintptr_t>(g)) % sizeof(V) == 0) {
    const V* __restrict__ wv = reinterpret_cast<const V*>(w);
    const V* __restrict__ gv = reinterpret_cast<const V*>(g);
    const int nv = len / kV;
    for (int i = threadIdx.x; i < nv; i += kUnroll * kThreads) {
      V a[kUnroll], b[kUnroll];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int j = i + u * kThreads;
        if (j < nv) {
          a[u] = LoadRO(wv + j);
          b[u] = LoadRO(gv + j);
        }
      }
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        if (i + u * kThreads < nv) {
#pragma unroll
          for (int k = 0; k < kV; ++k) {
            AddSquares(a[u].e[k], sw);
            AddSquares(b[u].e[k], sg);
          }
        }
      }
    }
    done = nv * kV;
  }
  // The tail of an aligned chunk (< kV elements), or all of an unaligned one.
  for (int j = done + threadIdx.x; j < len; j += kThreads) {
    AddSquares(LoadRO(w + j), sw);
    AddSquares(LoadRO(g + j), sg);
  }
}

template <typename T>
__global__ void __launch_bounds__(kThreads)
    LarsSumSquares(const LarsMeta* __restrict__ meta, const int32_t* __restrict__ first, int num,
                   double2* __restrict__ partials) {
  const int32_t c = static_cast<int32_t>(blockIdx.x);
  const LarsMeta m = meta[FindTensor(first, num, c)];
  // Not adapted: the ratio is 1 and the norms are not needed (pass 2 does not
  // read this chunk's slot). The whole block leaves together.
  if (!(m.flags & HVREP_LARS_ADAPT)) return;
  const int64_t begin = static_cast<int64_t>(c - m.first_chunk) * kChunk;
  const int len = static_cast<int>(min(static_cast<int64_t>(kChunk), m.n - begin));
  double sw = 0.0, sg = 0.0;
  ThreadSumSquares(static_cast<const T*>(m.w) + begin, static_cast<const T*>(m.g) + begin, len, sw, sg);
  BlockSum2(sw, sg);
  if (threadIdx.x == 0) partials[c] = make_double2(sw, sg);
}

// lr * ratio, in the order and rounding of LarsScale in kernels/src/cpu.cc.
template <typename T>
__device__ T LarsScale(bool adapt, double ssq_w, double ssq_g, T lr, T wd, const LarsScalars<T>& s) {
  if (!adapt) return lr;
  const T w_norm = Conv<T>::FromDouble(__dsqrt_rn(ssq_w));
  const T g_norm = Conv<T>::FromDouble(__dsqrt_rn(ssq_g));
  if (!(w_norm > T(0) && g_norm > T(0))) return lr;
  const T denom = Add(Add(g_norm, Mul(wd, w_norm)), s.epsilon);
  const T ratio = Div(Mul(s.eta, w_norm), denom);
  return Mul(lr, ratio);
}

// One element, in the order and rounding of LarsUpdate in kernels/src/cpu.cc.
template <typename T>
__device__ __forceinline__ void UpdateElement(T& w, T& v, T g, T wd, T scale, T momentum, bool nesterov) {
  const T gt = wd != T(0) ? Add(g, Mul(wd, w)) : g;
  if (nesterov) {
    const T scaled = Mul(scale, gt);
    const T nv = Add(Mul(momentum, v), scaled);
    v = nv;
    w = Sub(w, Add(Mul(momentum, nv), scaled));
  } else {
    const T nv = Add(Mul(momentum, v), Mul(scale, gt));
    v = nv;
    w = Sub(w, nv);
  }
}

template <typename T>
__global__ void __launch_bounds__(kThreads)
    LarsUpdate(const LarsMeta* __restrict__ meta, const int32_t* __restrict__ first, int num,
               const double2* __restrict__ partials, const T* __restrict__ lr_ptr, LarsScalars<T> s) {
  const int32_t c = static_cast<int32_t>(blockIdx.x);
  const LarsMeta m = meta[FindTensor(first, num, c)];
  const bool adapt = (m.flags & HVREP_LARS_ADAPT) != 0;
  const T wd = (m.flags & HVREP_LARS_DECAY) ? s.weight_decay : T(0);

  // Warp 0 combines the tensor's partial sums: lane k takes chunks k, k+32,
  // ... in order, then a fixed shuffle tree. ResNet-50's largest tensor has
  // 144 chunks: 5 independent loads per lane.
  __shared__ T s_scale;
  if (threadIdx.x < 32) {
    double sw = 0.0, sg = 0.0;
    if (adapt) {
      for (int k = threadIdx.x; k < m.num_chunks; k += 32) {
        const double2 p = partials[m.first_chunk + k];
        sw += p.x;
        sg += p.y;
      }
      for (int off = 16; off > 0; off >>= 1) {
        sw += __shfl_down_sync(0xffffffffu, sw, off);
        sg += __shfl_down_sync(0xffffffffu, sg, off);
      }
    }
    if (threadIdx.x == 0) s_scale = LarsScale(adapt, sw, sg, *lr_ptr, wd, s);
  }
  __syncthreads();
  const T scale = s_scale;
  const T momentum = s.momentum;
  const bool nesterov = s.nesterov != 0;

  const int64_t begin = static_cast<int64_t>(c - m.first_chunk) * kChunk;
  const int len = static_cast<int>(min(static_cast<int64_t>(kChunk), m.n - begin));
  T* __restrict__ w = static_cast<T*>(m.w) + begin;
  T* __restrict__ v = static_cast<T*>(m.v) + begin;
  const T* __restrict__ g = static_cast<const T*>(m.g) + begin;

  constexpr int kV = 16 / sizeof(T);
  using V = Vec<T, kV>;
  int done = 0;
  if ((reinterpret_cast<uintptr_t>(w) | reinterpret_cast<uintptr_t>(v) | reinterpret_cast<uintptr_t>(g)) %
          sizeof(V) == 0) {
    V* __restrict__ wv = reinterpret_cast<V*>(w);
    V* __restrict__ vv = reinterpret_cast<V*>(v);
    const V* __restrict__ gv = reinterpret_cast<const V*>(g);
    const int nv = len / kV;
    for (int i = threadIdx.x; i < nv; i += kUnroll * kThreads) {
      // All loads of the trip first: the stores below could alias the next
      // loads as far as the compiler knows, so it would not hoist them itself.
      V a[kUnroll], b[kUnroll], d[kUnroll];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int j = i + u * kThreads;
        if (j < nv) {
          a[u] = LoadRW(wv + j);
          b[u] = LoadRW(vv + j);
          d[u] = LoadRO(gv + j);
        }
      }
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int j = i + u * kThreads;
        if (j < nv) {
#pragma unroll
          for (int k = 0; k < kV; ++k) UpdateElement(a[u].e[k], b[u].e[k], d[u].e[k], wd, scale, momentum, nesterov);
          Store(wv + j, a[u]);
          Store(vv + j, b[u]);
        }
      }
    }
    done = nv * kV;
  }
  for (int j = done + threadIdx.x; j < len; j += kThreads) {
    T wj = LoadRW(w + j), vj = LoadRW(v + j);
    UpdateElement(wj, vj, LoadRO(g + j), wd, scale, momentum, nesterov);
    Store(w + j, wj);
    Store(v + j, vj);
  }
}

template <typename T>
int LarsCuda(int num_tensors, const hvrep_lars_tensor* tensors, const void* lr, const hvrep_lars_hparams& hp,
             void* workspace, size_t workspace_bytes, cudaStream_t stream) {
  const LarsLayout l = PlanLars(num_tensors, tensors);
  if (l.chunks == 0) return HVREP_OK;  // every tensor is empty: nothing to launch
  if (l.chunks > INT32_MAX) return HVREP_EINVAL;  // gridDim.x and the int32 chunk tables
  if (workspace_bytes < l.bytes + kWorkspaceAlign) return HVREP_EWORKSPACE;
  if (workspace == nullptr) return HVREP_EINVAL;

  std::vector<unsigned char> host(l.partial_off, 0);
  int k = 0;
  int32_t next_chunk = 0;
  for (int i = 0; i < num_tensors; ++i) {
    const hvrep_lars_tensor& t = tensors[i];
    if (t.n == 0) continue;
    const int32_t chunks = static_cast<int32_t>(NumChunks(t.n));
    PutAt(host, sizeof(LarsMeta) * k, LarsMeta{t.w, t.v, t.g, t.n, next_chunk, chunks, t.flags, 0u});
    PutAt(host, l.first_off + sizeof(int32_t) * k, next_chunk);
    next_chunk += chunks;
    ++k;
  }
  unsigned char* base = static_cast<unsigned char*>(AlignWorkspace(workspace));
  if (int rc = StageMetadata(host, base, stream); rc != HVREP_OK) return rc;

  const auto* meta = reinterpret_cast<const LarsMeta*>(base);
  const auto* first = reinterpret_cast<const int32_t*>(base + l.first_off);
  auto* partials = reinterpret_cast<double2*>(base + l.partial_off);
  const LarsScalars<T> s{static_cast<T>(hp.momentum), static_cast<T>(hp.weight_decay), static_cast<T>(hp.eta),
                         static_cast<T>(hp.epsilon), hp.nesterov != 0};
  const int blocks = static_cast<int>(l.chunks);
  if (int rc = Launch(LarsSumSquares<T>, blocks, stream, meta, first, l.num, partials); rc != HVREP_OK) return rc;
  return Launch(LarsUpdate<T>, blocks, stream, meta, first, l.num, static_cast<const double2*>(partials),
                static_cast<const T*>(lr), s);
}

}  // namespace
}  // namespace hvrep_cuda

extern "C" {

const char* hvrep_cuda_strerror(int code) {
  return code > 0 ? cudaGetErrorString(static_cast<cudaError_t>(code)) : hvrep_strerror(code);
}

size_t hvrep_lars_cuda_workspace_bytes(int num_tensors, const hvrep_lars_tensor* tensors) {
  if (num_tensors <= 0 || tensors == nullptr) return 0;
  for (int i = 0; i < num_tensors; ++i) {
    if (tensors[i].n < 0) return 0;  // hvrep_lars_cuda rejects the list anyway
  }
  const hvrep_cuda::LarsLayout l = hvrep_cuda::PlanLars(num_tensors, tensors);
  return l.chunks == 0 ? 0 : l.bytes + hvrep_cuda::kWorkspaceAlign;
}

// Argument checks in the order of hvrep_lars_cpu, so both return the same code.
int hvrep_lars_cuda(int dtype, int num_tensors, const hvrep_lars_tensor* tensors, const void* lr,
                    hvrep_lars_hparams hp, void* workspace, size_t workspace_bytes, void* stream) {
  if (num_tensors < 0 || (num_tensors > 0 && (tensors == nullptr || lr == nullptr))) return HVREP_EINVAL;
  for (int i = 0; i < num_tensors; ++i) {
    const hvrep_lars_tensor& t = tensors[i];
    if (t.n < 0 || (t.n > 0 && (t.w == nullptr || t.v == nullptr || t.g == nullptr))) return HVREP_EINVAL;
  }
  if (num_tensors == 0) return HVREP_OK;
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  switch (dtype) {
    case HVREP_F32: return hvrep_cuda::LarsCuda<float>(num_tensors, tensors, lr, hp, workspace, workspace_bytes, s);
    case HVREP_F64: return hvrep_cuda::LarsCuda<double>(num_tensors, tensors, lr, hp, workspace, workspace_bytes, s);
    default: return HVREP_EINVAL;
  }
}

}  // extern "C"
