// Pack / unpack on CUDA: a list of tensors <-> one contiguous buffer, with a
// scale and a dtype cast, in one kernel launch for the whole list (semantics:
// kernels/include/hvrep_kernels.h).
//
// Same chunking as LARS (kChunk elements, one 256-thread block per chunk; see
// cuda_common.cuh). The workspace size may depend on num_tensors only, so it
// holds a per-tensor table, not a per-chunk one, and each block finds its
// tensor with FindTensor (a 32-way search by each warp: 2 dependent loads for
// up to 1,024 tensors).
//
// Workspace (offsets from the workspace aligned up to kWorkspaceAlign):
//   CopyMeta meta[num]   one per non-empty tensor
//   int32_t first[num]   first chunk of each tensor (strictly increasing)
//
// Each thread moves 4 consecutive elements at a time: 8 to 32 bytes per load
// or store, one or two vector instructions. The two sides are vectorised
// independently: a source tensor is aligned whenever its allocation is (TF:
// 64 bytes), but its place in the buffer is aligned only if the element
// counts before it are multiples of 4 (true for every ResNet-50 tensor, not
// for e.g. a 1001-class head), and a misaligned side falls back to 4 scalar
// accesses, still coalesced across the warp.

#include <cstdint>
#include <vector>

#include "cuda_common.cuh"

namespace hvrep_cuda {
namespace {

struct CopyMeta {
  void* ptr;           // the tensor (read for pack, written for unpack)
  int64_t n;
  int64_t offset;      // of its first element in the buffer
  int32_t first_chunk;
  int32_t dtype;
};

constexpr int kPer = 4;  // elements per thread access

struct CopyLayout {
  size_t first_off = 0, bytes = 0;  // bytes: without the alignment slack
};

CopyLayout PlanCopy(int num_tensors) {
  CopyLayout l;
  l.first_off = AlignUp(sizeof(CopyMeta) * static_cast<size_t>(num_tensors), 16);
  l.bytes = l.first_off + sizeof(int32_t) * static_cast<size_t>(num_tensors);
  return l;
}

__device__ __forceinline__ bool Aligned(const void* p, size_t bytes) { return reinterpret_cast<uintptr_t>(p) % bytes == 0; }

// dst[j] = Op(src[j]) for j in [0, len), by this block. Op maps one S to one D.
template <typename S, typename D, typename Op>
__device__ __forceinline__ void CopyChunk(const S* __restrict__ src, D* __restrict__ dst, int len, Op op) {
  using VS = Vec<S, kPer>;
  using VD = Vec<D, kPer>;
  const bool vec_src = Aligned(src, sizeof(VS)), vec_dst = Aligned(dst, sizeof(VD));
  const int nq = len / kPer;
  for (int i = threadIdx.x; i < nq; i += kUnroll * kThreads) {
    VS a[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int q = i + u * kThreads;
      if (q < nq) {
        if (vec_src) {
          a[u] = LoadRO(reinterpret_cast<const VS*>(src) + q);
        } else {
#pragma unroll
          for (int k = 0; k < kPer; ++k) a[u].e[k] = LoadRO(src + q * kPer + k);
        }
      }
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int q = i + u * kThreads;
      if (q < nq) {
        VD o;
#pragma unroll
        for (int k = 0; k < kPer; ++k) o.e[k] = op(a[u].e[k]);
        if (vec_dst) {
          Store(reinterpret_cast<VD*>(dst) + q, o);
        } else {
#pragma unroll
          for (int k = 0; k < kPer; ++k) Store(dst + q * kPer + k, o.e[k]);
        }
      }
    }
  }
  for (int j = nq * kPer + threadIdx.x; j < len; j += kThreads) Store(dst + j, op(LoadRO(src + j)));
}

// pack: cast<D>(x * cast<S>(scale)), the multiply in S.
template <typename S, typename D>
struct PackOp {
  S scale;
  __device__ D operator()(S x) const { return Cast<D>(MulIn(x, scale)); }
};

// unpack: cast<D>(x) * cast<D>(scale), the multiply in D.
template <typename S, typename D>
struct UnpackOp {
  D scale;
  __device__ D operator()(S x) const { return MulIn(Cast<D>(x), scale); }
};

template <typename S, typename D>
__device__ __forceinline__ void PackChunk(const void* src, D* dst, int64_t begin, int len, double scale) {
  CopyChunk(static_cast<const S*>(src) + begin, dst, len, PackOp<S, D>{Cast<S>(scale)});
}

template <typename S, typename D>
__device__ __forceinline__ void UnpackChunk(const S* src, void* dst, int64_t begin, int len, double scale) {
  CopyChunk(src, static_cast<D*>(dst) + begin, len, UnpackOp<S, D>{Cast<D>(scale)});
}

// A chunk lies within one tensor, so the dtype switch is uniform over the
// block: no divergence, and one launch serves a list of mixed dtypes.
template <typename D>
__global__ void __launch_bounds__(kThreads)
    PackKernel(const CopyMeta* __restrict__ meta, const int32_t* __restrict__ first, int num, D* __restrict__ dst,
               const double* __restrict__ scale_ptr) {
  const int32_t c = static_cast<int32_t>(blockIdx.x);
  const CopyMeta m = meta[FindTensor(first, num, c)];
  const int64_t begin = static_cast<int64_t>(c - m.first_chunk) * kChunk;
  const int len = static_cast<int>(min(static_cast<int64_t>(kChunk), m.n - begin));
  const double scale = __ldg(scale_ptr);
  D* out = dst + m.offset + begin;
  switch (m.dtype) {
    case HVREP_F16: PackChunk<__half>(m.ptr, out, begin, len, scale); break;
    case HVREP_BF16: PackChunk<__nv_bfloat16>(m.ptr, out, begin, len, scale); break;
    case HVREP_F32: PackChunk<float>(m.ptr, out, begin, len, scale); break;
    default: PackChunk<double>(m.ptr, out, begin, len, scale); break;  // validated on the host
  }
}

template <typename S>
__global__ void __launch_bounds__(kThreads)
    UnpackKernel(const S* __restrict__ src, const CopyMeta* __restrict__ meta, const int32_t* __restrict__ first,
                 int num, const double* __restrict__ scale_ptr) {
  const int32_t c = static_cast<int32_t>(blockIdx.x);
  const CopyMeta m = meta[FindTensor(first, num, c)];
  const int64_t begin = static_cast<int64_t>(c - m.first_chunk) * kChunk;
  const int len = static_cast<int>(min(static_cast<int64_t>(kChunk), m.n - begin));
  const double scale = __ldg(scale_ptr);
  const S* in = src + m.offset + begin;
  switch (m.dtype) {
    case HVREP_F16: UnpackChunk<S, __half>(in, m.ptr, begin, len, scale); break;
    case HVREP_BF16: UnpackChunk<S, __nv_bfloat16>(in, m.ptr, begin, len, scale); break;
    case HVREP_F32: UnpackChunk<S, float>(in, m.ptr, begin, len, scale); break;
    default: UnpackChunk<S, double>(in, m.ptr, begin, len, scale); break;
  }
}

// The argument checks of hvrep_pack_cpu / hvrep_unpack_cpu (kernels/src/cpu.cc),
// in the same order, so both return the same code.
int CheckRefs(int num_tensors, const hvrep_tensor_ref* refs, int buffer_dtype, const void* buffer,
              const double* scale) {
  if (num_tensors < 0 || (num_tensors > 0 && refs == nullptr)) return HVREP_EINVAL;
  int64_t total = 0;
  for (int i = 0; i < num_tensors; ++i) {
    if (refs[i].n < 0 || !ValidDtype(refs[i].dtype) || (refs[i].n > 0 && refs[i].ptr == nullptr)) return HVREP_EINVAL;
    total += refs[i].n;
  }
  if (!ValidDtype(buffer_dtype) || scale == nullptr) return HVREP_EINVAL;
  if (total > 0 && buffer == nullptr) return HVREP_EINVAL;
  return HVREP_OK;
}

// Builds and stages the tables; *chunks = 0 means there is nothing to launch.
int StageCopy(int num_tensors, const hvrep_tensor_ref* refs, void* workspace, size_t workspace_bytes,
              cudaStream_t stream, int* num, int64_t* chunks, const CopyMeta** meta, const int32_t** first) {
  *num = 0;
  *chunks = 0;
  for (int i = 0; i < num_tensors; ++i) *chunks += NumChunks(refs[i].n);
  if (*chunks == 0) return HVREP_OK;
  if (*chunks > INT32_MAX) return HVREP_EINVAL;  // gridDim.x and the int32 chunk table
  if (workspace_bytes < hvrep_pack_cuda_workspace_bytes(num_tensors)) return HVREP_EWORKSPACE;
  if (workspace == nullptr) return HVREP_EINVAL;

  const CopyLayout l = PlanCopy(num_tensors);
  std::vector<unsigned char> host(l.bytes, 0);
  int64_t offset = 0;
  int32_t next_chunk = 0;
  int k = 0;
  for (int i = 0; i < num_tensors; ++i) {
    const hvrep_tensor_ref& r = refs[i];
    if (r.n > 0) {
      PutAt(host, sizeof(CopyMeta) * k, CopyMeta{r.ptr, r.n, offset, next_chunk, r.dtype});
      PutAt(host, l.first_off + sizeof(int32_t) * k, next_chunk);
      next_chunk += static_cast<int32_t>(NumChunks(r.n));
      ++k;
    }
    offset += r.n;
  }
  unsigned char* base = static_cast<unsigned char*>(AlignWorkspace(workspace));
  if (int rc = StageMetadata(host, base, stream); rc != HVREP_OK) return rc;
  *num = k;
  *meta = reinterpret_cast<const CopyMeta*>(base);
  *first = reinterpret_cast<const int32_t*>(base + l.first_off);
  return HVREP_OK;
}

}  // namespace
}  // namespace hvrep_cuda

extern "C" {

size_t hvrep_pack_cuda_workspace_bytes(int num_tensors) {
  if (num_tensors <= 0) return 0;
  return hvrep_cuda::PlanCopy(num_tensors).bytes + hvrep_cuda::kWorkspaceAlign;
}

int hvrep_pack_cuda(int num_tensors, const hvrep_tensor_ref* srcs, void* dst, int dst_dtype, const double* scale,
                    void* workspace, size_t workspace_bytes, void* stream) {
  using namespace hvrep_cuda;
  if (int rc = CheckRefs(num_tensors, srcs, dst_dtype, dst, scale); rc != HVREP_OK) return rc;
  const cudaStream_t s = static_cast<cudaStream_t>(stream);
  int num = 0;
  int64_t chunks = 0;
  const CopyMeta* meta = nullptr;
  const int32_t* first = nullptr;
  if (int rc = StageCopy(num_tensors, srcs, workspace, workspace_bytes, s, &num, &chunks, &meta, &first);
      rc != HVREP_OK || chunks == 0) {
    return rc;
  }
  const int blocks = static_cast<int>(chunks);
  switch (dst_dtype) {
    case HVREP_F16: return Launch(PackKernel<__half>, blocks, s, meta, first, num, static_cast<__half*>(dst), scale);
    case HVREP_BF16:
      return Launch(PackKernel<__nv_bfloat16>, blocks, s, meta, first, num, static_cast<__nv_bfloat16*>(dst), scale);
    case HVREP_F32: return Launch(PackKernel<float>, blocks, s, meta, first, num, static_cast<float*>(dst), scale);
    default: return Launch(PackKernel<double>, blocks, s, meta, first, num, static_cast<double*>(dst), scale);
  }
}

int hvrep_unpack_cuda(const void* src, int src_dtype, int num_tensors, const hvrep_tensor_ref* dsts,
                      const double* scale, void* workspace, size_t workspace_bytes, void* stream) {
  using namespace hvrep_cuda;
  if (int rc = CheckRefs(num_tensors, dsts, src_dtype, src, scale); rc != HVREP_OK) return rc;
  const cudaStream_t s = static_cast<cudaStream_t>(stream);
  int num = 0;
  int64_t chunks = 0;
  const CopyMeta* meta = nullptr;
  const int32_t* first = nullptr;
  if (int rc = StageCopy(num_tensors, dsts, workspace, workspace_bytes, s, &num, &chunks, &meta, &first);
      rc != HVREP_OK || chunks == 0) {
    return rc;
  }
  const int blocks = static_cast<int>(chunks);
  switch (src_dtype) {
    case HVREP_F16:
      return Launch(UnpackKernel<__half>, blocks, s, static_cast<const __half*>(src), meta, first, num, scale);
    case HVREP_BF16:
      return Launch(UnpackKernel<__nv_bfloat16>, blocks, s, static_cast<const __nv_bfloat16*>(src), meta, first, num,
                    scale);
    case HVREP_F32:
      return Launch(UnpackKernel<float>, blocks, s, static_cast<const float*>(src), meta, first, num, scale);
    default: return Launch(UnpackKernel<double>, blocks, s, static_cast<const double*>(src), meta, first, num, scale);
  }
}

}  // extern "C"
