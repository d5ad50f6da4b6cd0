/* hvrep's fused kernels: a plain C interface, free of TensorFlow.
 *
 * The same functions serve the TensorFlow ops (kernels/tf/, thin wrappers),
 * the standalone CUDA harness (kernels/harness/) and the CPU reference the
 * harness checks the GPU against. Everything a kernel needs is passed in:
 * pointers, element counts, hyper-parameters, a thread-pool callback (CPU) or
 * a stream and a scratch workspace (CUDA). No function allocates device memory
 * or synchronises a stream.
 *
 * Return value of every int function: HVREP_OK (0), HVREP_EINVAL (< 0, a bad
 * argument; hvrep_strerror says which), or a positive cudaError_t.
 */
#ifndef HVREP_KERNELS_H_
#define HVREP_KERNELS_H_

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define HVREP_OK 0
#define HVREP_EINVAL (-1)       /* a negative count, a null pointer, an unknown dtype */
#define HVREP_EWORKSPACE (-2)   /* the CUDA workspace is smaller than *_cuda_workspace_bytes says */

/* Element types. bf16 is bfloat16 (8-bit exponent); f16 is IEEE half. */
typedef enum {
  HVREP_F16 = 0,
  HVREP_BF16 = 1,
  HVREP_F32 = 2,
  HVREP_F64 = 3,
} hvrep_dtype;

/* Bytes of one element of `dtype`; 0 for an unknown value. */
size_t hvrep_dtype_size(int dtype);

/* A message for an HVREP_* return code (a positive code: see hvrep_cuda_strerror). */
const char* hvrep_strerror(int code);

/* ---------------------------------------------------------------------------
 * Multi-tensor LARS (hvrep.optimizers.LARS, one step for a list of tensors).
 *
 * For tensor i with weights w, momentum slot v, gradient g (n elements, all of
 * the LARS dtype: f32 or f64), flags (HVREP_LARS_DECAY, HVREP_LARS_ADAPT):
 *   wd    = (flags & DECAY) ? weight_decay : 0
 *   gt    = g + wd * w                           (g when wd == 0)
 *   ratio = eta * |w| / (|g| + wd * |w| + epsilon)   if ADAPT and |w| > 0 and |g| > 0
 *         = 1                                         otherwise
 *   scale = lr * ratio                            (a scalar, computed first)
 *   v     = momentum * v + scale * gt
 *   w     = w - v                                (nesterov: w - (momentum * v + scale * gt))
 * |x| is the Euclidean norm of the whole tensor, accumulated in double on the
 * CPU. Arithmetic is in the LARS dtype.
 * ------------------------------------------------------------------------- */
#define HVREP_LARS_DECAY 1u
#define HVREP_LARS_ADAPT 2u

typedef struct {
  double momentum;      /* in [0, 1) */
  double weight_decay;  /* >= 0, applied where HVREP_LARS_DECAY is set */
  double eta;           /* > 0, trust coefficient */
  double epsilon;       /* >= 0 */
  int nesterov;         /* 0 or 1 */
} hvrep_lars_hparams;

typedef struct {
  void* w;              /* n elements, updated in place */
  void* v;              /* n elements, updated in place */
  const void* g;        /* n elements */
  int64_t n;            /* >= 0; 0 is skipped */
  uint32_t flags;       /* HVREP_LARS_DECAY | HVREP_LARS_ADAPT */
} hvrep_lars_tensor;

/* CPU work sharing. `parallel_for(pool, num_units, fn, arg)` must call
 * fn(arg, begin, end) over disjoint ranges covering [0, num_units) and return
 * when all calls have returned. Results never depend on how the units are
 * split (each unit writes its own partial sums; they are combined in order).
 * NULL runs everything on the calling thread. */
typedef void (*hvrep_range_fn)(void* arg, int64_t begin, int64_t end);
typedef void (*hvrep_parallel_for)(void* pool, int64_t num_units, hvrep_range_fn fn, void* arg);

/* One LARS step on the CPU. `lr` points to one element of `dtype`. */
int hvrep_lars_cpu(int dtype, int num_tensors, const hvrep_lars_tensor* tensors, const void* lr,
                   hvrep_lars_hparams hp, hvrep_parallel_for parallel_for, void* pool);

/* ---------------------------------------------------------------------------
 * Pack / unpack: a list of tensors <-> one contiguous rank-1 buffer.
 *
 * pack:   dst[offset_i + j] = cast<dst_dtype>( src_i[j] * cast<src_dtype_i>(scale) )
 * unpack: dst_i[j]          = cast<dst_dtype_i>( src[offset_i + j] ) * cast<dst_dtype_i>(scale)
 * offset_i is the sum of n over the tensors before i. The multiply is done in
 * the source type for pack and in the destination type for unpack (f16/bf16
 * multiply in float and round once, as TensorFlow does); casts round to nearest
 * even. `scale` is a double (host pointer on the CPU, device pointer on CUDA).
 * ------------------------------------------------------------------------- */
typedef struct {
  void* ptr;            /* const for the side that is read */
  int64_t n;            /* >= 0 */
  int dtype;            /* hvrep_dtype */
} hvrep_tensor_ref;

int hvrep_pack_cpu(int num_tensors, const hvrep_tensor_ref* srcs, void* dst, int dst_dtype,
                   const double* scale, hvrep_parallel_for parallel_for, void* pool);
int hvrep_unpack_cpu(const void* src, int src_dtype, int num_tensors, const hvrep_tensor_ref* dsts,
                     const double* scale, hvrep_parallel_for parallel_for, void* pool);

/* ---------------------------------------------------------------------------
 * CUDA. All pointers (tensors, lr, scale, workspace) are device pointers;
 * `stream` is a cudaStream_t. The host-side arrays (`tensors`, `srcs`,
 * `dsts`) may be freed when the call returns: their contents are copied into
 * `workspace` with cudaMemcpyAsync on `stream` before the kernels are
 * enqueued. The workspace must stay allocated until the stream reaches the
 * end of the call's work. Compiled only where nvcc is found.
 * ------------------------------------------------------------------------- */
/* cudaGetErrorString for a positive code; hvrep_strerror for the others. */
const char* hvrep_cuda_strerror(int code);

/* The CUDA driver and runtime versions this library sees (1000 * major + 10 * minor, e.g. 12040,
 * 13000); *driver is 0 where no driver is installed. The runtime is linked statically, so the
 * kernels run only with a driver at least as new (hvrep.kernels checks this before using them). */
int hvrep_cuda_versions(int* driver, int* runtime);

size_t hvrep_lars_cuda_workspace_bytes(int num_tensors, const hvrep_lars_tensor* tensors);
int hvrep_lars_cuda(int dtype, int num_tensors, const hvrep_lars_tensor* tensors, const void* lr,
                    hvrep_lars_hparams hp, void* workspace, size_t workspace_bytes, void* stream);

size_t hvrep_pack_cuda_workspace_bytes(int num_tensors);
int hvrep_pack_cuda(int num_tensors, const hvrep_tensor_ref* srcs, void* dst, int dst_dtype,
                    const double* scale, void* workspace, size_t workspace_bytes, void* stream);
int hvrep_unpack_cuda(const void* src, int src_dtype, int num_tensors, const hvrep_tensor_ref* dsts,
                      const double* scale, void* workspace, size_t workspace_bytes, void* stream);

#ifdef __cplusplus
}  /* extern "C" */
#endif

#endif  /* HVREP_KERNELS_H_ */
