// hvrep's TensorFlow ops (definitions) and their CPU kernels.
// The GPU kernels live in gpu_kernels.cc, in a second library that is loaded
// only where TensorFlow sees a GPU (see hvrep/kernels.py).

#include "hvrep_ops.h"
#include "tensorflow/core/framework/common_shape_fns.h"
#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/shape_inference.h"

namespace hvrep {
namespace {

using ::tensorflow::shape_inference::DimensionHandle;
using ::tensorflow::shape_inference::InferenceContext;
using ::tensorflow::shape_inference::ShapeHandle;

REGISTER_OP("HvrepFusedLarsApply")
    .Input("var: N * resource")
    .Input("mom: N * resource")
    .Input("grad: N * T")
    .Input("lr: T")
    // [momentum, weight_decay, eta, epsilon] as doubles, in host memory: float
    // attrs would round a float64 variable's hyper-parameters through float32.
    .Input("hyper: double")
    .Attr("N: int >= 0")
    .Attr("T: {float, double}")
    .Attr("nesterov: bool = false")
    .Attr("flags: list(int)")  // per variable: 1 = weight decay, 2 = layer adaptation
    .SetIsStateful()
    .SetShapeFn([](InferenceContext* c) {
      ShapeHandle unused;
      TF_RETURN_IF_ERROR(c->WithRank(c->input(c->num_inputs() - 2), 0, &unused));
      return c->WithRank(c->input(c->num_inputs() - 1), 1, &unused);
    })
    .Doc("One LARS step for N variables and their momentum slots, updated in place (hvrep.optimizers.LARS).");

REGISTER_OP("HvrepPack")
    .Input("tensors: Tin")
    .Input("scale: double")
    .Output("packed: out_type")
    .Attr("Tin: list({half, bfloat16, float, double}) >= 0")
    .Attr("out_type: {half, bfloat16, float, double}")
    .SetShapeFn([](InferenceContext* c) {
      int64_t total = 0;
      for (int i = 0; i < c->num_inputs() - 1; ++i) {
        const ShapeHandle s = c->input(i);
        const int64_t n = c->RankKnown(s) ? c->Value(c->NumElements(s)) : InferenceContext::kUnknownDim;
        if (n == InferenceContext::kUnknownDim) {
          total = InferenceContext::kUnknownDim;
          break;
        }
        total += n;
      }
      ShapeHandle unused;
      TF_RETURN_IF_ERROR(c->WithRank(c->input(c->num_inputs() - 1), 0, &unused));
      c->set_output(0, c->Vector(total));
      return absl::OkStatus();
    })
    .Doc("Packs a list of tensors into one rank-1 buffer: cast(t * scale, out_type), concatenated.");

REGISTER_OP("HvrepUnpack")
    .Input("packed: in_type")
    .Input("scale: double")
    .Output("tensors: Tout")
    .Attr("in_type: {half, bfloat16, float, double}")
    .Attr("Tout: list({half, bfloat16, float, double}) >= 0")
    .Attr("shapes: list(shape) >= 0")
    // Each piece after the first starts at the next multiple of `align` elements
    // of the buffer (the pack put zeros between). With `share`, a piece of the
    // buffer's dtype whose start is aligned for Eigen is a slice of the buffer,
    // not a copy; the caller promises a scale of 1 (checked on the CPU).
    .Attr("align: int >= 1 = 1")
    .Attr("share: bool = false")
    .SetShapeFn([](InferenceContext* c) {
      ShapeHandle unused;
      TF_RETURN_IF_ERROR(c->WithRank(c->input(0), 1, &unused));
      TF_RETURN_IF_ERROR(c->WithRank(c->input(1), 0, &unused));
      std::vector<::tensorflow::PartialTensorShape> shapes;
      TF_RETURN_IF_ERROR(c->GetAttr("shapes", &shapes));
      if (static_cast<int>(shapes.size()) != c->num_outputs()) {
        return absl::InvalidArgumentError(absl::StrCat("HvrepUnpack: ", shapes.size(), " shapes for ",
                                                       c->num_outputs(), " outputs."));
      }
      for (int i = 0; i < c->num_outputs(); ++i) {
        ShapeHandle s;
        TF_RETURN_IF_ERROR(c->MakeShapeFromPartialTensorShape(shapes[i], &s));
        c->set_output(i, s);
      }
      return absl::OkStatus();
    })
    .Doc("Splits a rank-1 buffer into tensors: cast(piece, dtype) * scale, reshaped; pieces start at multiples of align.");

// CPU: the kernels run on TensorFlow's intra-op thread pool.
void TfParallelFor(void* pool, int64_t num_units, hvrep_range_fn fn, void* arg) {
  // A unit is at most 32K elements (cpu.cc): tens of thousands of cycles.
  auto* threads = static_cast<::tsl::thread::ThreadPool*>(pool);
  threads->ParallelFor(num_units, ::tsl::thread::ThreadPool::SchedulingParams::Adaptive(50000),
                       [fn, arg](int64_t begin, int64_t end) { fn(arg, begin, end); });
}

struct CpuTraits {
  static void* Pool(OpKernelContext* ctx) {
    return ctx->device()->tensorflow_cpu_worker_threads()->workers;
  }
  // The scale is in host memory: share=true is refused unless it is 1.
  static bool ScaleMayBeOne(const Tensor& scale) { return scale.scalar<double>()() == 1.0; }
  static absl::Status CopyBytes(OpKernelContext*, void* dst, const void* src, size_t bytes) {
    if (bytes > 0) std::memcpy(dst, src, bytes);
    return absl::OkStatus();
  }
  static absl::Status Lars(OpKernelContext* ctx, int dtype, int n, const hvrep_lars_tensor* t, const void* lr,
                           const hvrep_lars_hparams& hp) {
    return KernelStatus("HvrepFusedLarsApply", hvrep_lars_cpu(dtype, n, t, lr, hp, TfParallelFor, Pool(ctx)), nullptr);
  }
  static absl::Status Pack(OpKernelContext* ctx, int n, const hvrep_tensor_ref* srcs, void* dst, int dst_dtype,
                           const double* scale) {
    return KernelStatus("HvrepPack", hvrep_pack_cpu(n, srcs, dst, dst_dtype, scale, TfParallelFor, Pool(ctx)), nullptr);
  }
  static absl::Status Unpack(OpKernelContext* ctx, const void* src, int src_dtype, int n, const hvrep_tensor_ref* dsts,
                             const double* scale) {
    return KernelStatus("HvrepUnpack", hvrep_unpack_cpu(src, src_dtype, n, dsts, scale, TfParallelFor, Pool(ctx)),
                        nullptr);
  }
};

#define REGISTER_LARS(T)                                                                          \
  REGISTER_KERNEL_BUILDER(                                                                        \
      Name("HvrepFusedLarsApply").Device(::tensorflow::DEVICE_CPU).TypeConstraint<T>("T").HostMemory("hyper"), \
      FusedLarsApplyOp<CpuTraits, T>);
REGISTER_LARS(float)
REGISTER_LARS(double)
#undef REGISTER_LARS

REGISTER_KERNEL_BUILDER(Name("HvrepPack").Device(::tensorflow::DEVICE_CPU), PackOp<CpuTraits>);
REGISTER_KERNEL_BUILDER(Name("HvrepUnpack").Device(::tensorflow::DEVICE_CPU), UnpackOp<CpuTraits>);

}  // namespace
}  // namespace hvrep
