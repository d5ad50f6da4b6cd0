// GPU kernels of hvrep's ops: thin wrappers around the CUDA launchers of
// kernels/src/*.cu. Built into a second library (libhvrep_ops_cuda.so) only
// where nvcc is found, and loaded only where TensorFlow sees a GPU; the op
// definitions come from libhvrep_ops.so, loaded first.
//
// No CUDA header is needed here: the stream is the stream executor's
// platform-specific handle (a cudaStream_t), and scratch memory is a TF temp
// tensor, which TensorFlow's GPU allocator keeps valid for work enqueued on
// this op's stream.

#include "hvrep_ops.h"
#include "xla/stream_executor/device_address.h"
#include "xla/stream_executor/stream.h"

namespace hvrep {
namespace {

struct GpuTraits {
  static absl::StatusOr<void*> Stream(OpKernelContext* ctx) {
    auto* dc = ctx->op_device_context();
    if (dc == nullptr || dc->stream() == nullptr) return absl::InternalError("hvrep: no GPU stream for this op.");
    void* s = dc->stream()->platform_specific_handle().stream;
    if (s == nullptr) return absl::InternalError("hvrep: the GPU stream has no CUDA handle.");
    return s;
  }

  // Scratch bytes as a temp tensor; `keep` owns it until the op returns.
  static absl::Status Workspace(OpKernelContext* ctx, size_t bytes, Tensor* keep, void** ptr) {
    TF_RETURN_IF_ERROR(ctx->allocate_temp(::tensorflow::DT_INT8,
                                          TensorShape({static_cast<int64_t>(bytes > 0 ? bytes : 1)}), keep));
    *ptr = keep->data();
    return absl::OkStatus();
  }

  // The scale is in device memory, not read here: the caller (hvrep.kernels.unpack)
  // sets share=true only for a scale it knows to be 1 when it builds the op.
  static bool ScaleMayBeOne(const Tensor&) { return true; }
  static absl::Status CopyBytes(OpKernelContext* ctx, void* dst, const void* src, size_t bytes) {
    if (bytes == 0) return absl::OkStatus();
    ::stream_executor::DeviceAddressBase d(dst, bytes);
    const ::stream_executor::DeviceAddressBase s(const_cast<void*>(src), bytes);
    return ctx->op_device_context()->stream()->MemcpyD2D(&d, s, bytes);
  }

  // Runs `launch(workspace, stream)` with `bytes` of scratch; `op` names it in errors.
  template <typename F>
  static absl::Status Run(OpKernelContext* ctx, const char* op, size_t bytes, F launch) {
    TF_ASSIGN_OR_RETURN(void* stream, Stream(ctx));
    Tensor keep;
    void* ws;
    TF_RETURN_IF_ERROR(Workspace(ctx, bytes, &keep, &ws));
    return KernelStatus(op, launch(ws, bytes, stream), hvrep_cuda_strerror);
  }

  static absl::Status Lars(OpKernelContext* ctx, int dtype, int n, const hvrep_lars_tensor* t, const void* lr,
                           const hvrep_lars_hparams& hp) {
    return Run(ctx, "HvrepFusedLarsApply", hvrep_lars_cuda_workspace_bytes(n, t),
               [&](void* ws, size_t bytes, void* stream) {
                 return hvrep_lars_cuda(dtype, n, t, lr, hp, ws, bytes, stream);
               });
  }

  static absl::Status Pack(OpKernelContext* ctx, int n, const hvrep_tensor_ref* srcs, void* dst, int dst_dtype,
                           const double* scale) {
    return Run(ctx, "HvrepPack", hvrep_pack_cuda_workspace_bytes(n), [&](void* ws, size_t bytes, void* stream) {
      return hvrep_pack_cuda(n, srcs, dst, dst_dtype, scale, ws, bytes, stream);
    });
  }

  static absl::Status Unpack(OpKernelContext* ctx, const void* src, int src_dtype, int n, const hvrep_tensor_ref* dsts,
                             const double* scale) {
    return Run(ctx, "HvrepUnpack", hvrep_pack_cuda_workspace_bytes(n), [&](void* ws, size_t bytes, void* stream) {
      return hvrep_unpack_cuda(src, src_dtype, n, dsts, scale, ws, bytes, stream);
    });
  }
};

#define REGISTER_LARS(T)                                                                          \
  REGISTER_KERNEL_BUILDER(                                                                        \
      Name("HvrepFusedLarsApply").Device(::tensorflow::DEVICE_GPU).TypeConstraint<T>("T").HostMemory("hyper"), \
      FusedLarsApplyOp<GpuTraits, T>);
REGISTER_LARS(float)
REGISTER_LARS(double)
#undef REGISTER_LARS

REGISTER_KERNEL_BUILDER(Name("HvrepPack").Device(::tensorflow::DEVICE_GPU), PackOp<GpuTraits>);
REGISTER_KERNEL_BUILDER(Name("HvrepUnpack").Device(::tensorflow::DEVICE_GPU), UnpackOp<GpuTraits>);

}  // namespace
}  // namespace hvrep
