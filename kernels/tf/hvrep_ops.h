// The TensorFlow side of hvrep's kernels: OpKernel classes that validate
// inputs, look up and lock resource variables, allocate outputs, and call the
// TF-free functions of kernels/include/hvrep_kernels.h.
//
// Each class is a template on a device traits type (CpuTraits in ops.cc,
// GpuTraits in gpu_kernels.cc) that supplies the calls that differ by device:
// the kernel launch, a device-to-device copy and the scratch workspace.

#ifndef HVREP_TF_OPS_H_
#define HVREP_TF_OPS_H_

#include <algorithm>
#include <memory>
#include <string>
#include <vector>

#include "hvrep_kernels.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/resource_mgr.h"
#include "tensorflow/core/framework/resource_var.h"
#include "tensorflow/core/framework/tensor.h"

namespace hvrep {

using ::tensorflow::DataType;
using ::tensorflow::OpKernel;
using ::tensorflow::OpKernelConstruction;
using ::tensorflow::OpKernelContext;
using ::tensorflow::Tensor;
using ::tensorflow::TensorShape;

inline int ToHvrepDtype(DataType dt) {
  switch (dt) {
    case ::tensorflow::DT_HALF: return HVREP_F16;
    case ::tensorflow::DT_BFLOAT16: return HVREP_BF16;
    case ::tensorflow::DT_FLOAT: return HVREP_F32;
    case ::tensorflow::DT_DOUBLE: return HVREP_F64;
    default: return -1;
  }
}

inline absl::Status KernelStatus(const char* op, int rc, const char* (*cuda_strerror)(int)) {
  if (rc == HVREP_OK) return absl::OkStatus();
  const char* msg = rc > 0 && cuda_strerror != nullptr ? cuda_strerror(rc) : hvrep_strerror(rc);
  return absl::InternalError(absl::StrCat(op, " failed: ", msg, " (code ", rc, ")"));
}

// Copy-on-write, as TensorFlow's own training ops do: a read of the variable
// earlier in the step may still hold its buffer (ReadVariableOp aliases it),
// and updating in place would change that value under its reader.
template <typename Traits>
absl::Status PrepareToUpdate(OpKernelContext* ctx, ::tensorflow::Var* var) {
  Tensor* t = var->tensor();
  if (!var->copy_on_read_mode.load() && t->RefCountIsOne()) return absl::OkStatus();
  Tensor copy;
  ::tensorflow::AllocatorAttributes attr;
  attr.set_gpu_compatible(true);
  attr.set_nic_compatible(true);
  TF_RETURN_IF_ERROR(ctx->allocate_temp(t->dtype(), t->shape(), &copy, attr));
  TF_RETURN_IF_ERROR(Traits::CopyBytes(ctx, copy.data(), t->data(), t->TotalBytes()));
  *t = copy;
  return absl::OkStatus();
}

// HvrepFusedLarsApply: inputs var: N resources, mom: N resources, grad: N x T, lr: T,
// hyper: [momentum, weight_decay, eta, epsilon] (double, host memory).
template <typename Traits, typename T>
class FusedLarsApplyOp : public OpKernel {
 public:
  explicit FusedLarsApplyOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    OP_REQUIRES_OK(ctx, ctx->GetAttr("N", &n_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("nesterov", &nesterov_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("flags", &flags_));
    OP_REQUIRES(ctx, static_cast<int>(flags_.size()) == n_,
                absl::InvalidArgumentError(absl::StrCat("HvrepFusedLarsApply: flags has ", flags_.size(),
                                                        " entries for N=", n_, " variables; give one per variable.")));
  }

  void Compute(OpKernelContext* ctx) override {
    int var_start, var_stop, mom_start, mom_stop;
    OP_REQUIRES_OK(ctx, ctx->op_kernel().InputRange("var", &var_start, &var_stop));
    OP_REQUIRES_OK(ctx, ctx->op_kernel().InputRange("mom", &mom_start, &mom_stop));
    ::tensorflow::OpInputList grads;
    OP_REQUIRES_OK(ctx, ctx->input_list("grad", &grads));
    const Tensor* lr;
    OP_REQUIRES_OK(ctx, ctx->input("lr", &lr));
    OP_REQUIRES(ctx, ::tensorflow::TensorShapeUtils::IsScalar(lr->shape()),
                absl::InvalidArgumentError(absl::StrCat("HvrepFusedLarsApply: lr must be a scalar, got shape ",
                                                        lr->shape().DebugString(), ".")));
    const Tensor* hyper;
    OP_REQUIRES_OK(ctx, ctx->input("hyper", &hyper));
    OP_REQUIRES(ctx, hyper->dims() == 1 && hyper->NumElements() == 4,
                absl::InvalidArgumentError(absl::StrCat("HvrepFusedLarsApply: hyper must be [momentum, weight_decay, "
                                                        "eta, epsilon], got shape ", hyper->shape().DebugString(), ".")));
    const auto h = hyper->flat<double>();
    OP_REQUIRES(ctx, h(0) >= 0 && h(0) < 1 && h(1) >= 0 && h(2) > 0 && h(3) >= 0,
                absl::InvalidArgumentError(absl::StrCat(
                    "HvrepFusedLarsApply: need 0 <= momentum < 1, weight_decay >= 0, eta > 0, epsilon >= 0; got momentum=",
                    h(0), " weight_decay=", h(1), " eta=", h(2), " epsilon=", h(3), ".")));
    const hvrep_lars_hparams hp{h(0), h(1), h(2), h(3), nesterov_ ? 1 : 0};

    std::vector<::tensorflow::core::RefCountPtr<::tensorflow::Var>> vars(2 * n_);
    for (int i = 0; i < 2 * n_; ++i) {
      const int input = i < n_ ? var_start + i : mom_start + (i - n_);
      const absl::Status s = ::tensorflow::LookupResource(ctx, ::tensorflow::HandleFromInput(ctx, input), &vars[i]);
      OP_REQUIRES(ctx, s.ok(),
                  absl::FailedPreconditionError(absl::StrCat(
                      "HvrepFusedLarsApply: ", i < n_ ? "variable " : "momentum slot ", i % n_,
                      " could not be read (not created or not initialized?): ", s.message())));
    }
    // Lock every variable once, in address order (the order TensorFlow's
    // training ops use), so two fused steps can never deadlock each other.
    std::vector<::tensorflow::mutex*> mutexes;
    for (auto& v : vars) mutexes.push_back(v->mu());
    std::sort(mutexes.begin(), mutexes.end());
    OP_REQUIRES(ctx, std::adjacent_find(mutexes.begin(), mutexes.end()) == mutexes.end(),
                absl::InvalidArgumentError(
                    "HvrepFusedLarsApply: a variable appears twice among the variables and momentum slots; "
                    "each must be updated once per step."));
    std::vector<std::unique_ptr<::tensorflow::mutex_lock>> locks;
    for (auto* mu : mutexes) locks.push_back(std::make_unique<::tensorflow::mutex_lock>(*mu));

    std::vector<hvrep_lars_tensor> tensors(n_);
    for (int i = 0; i < n_; ++i) {
      ::tensorflow::Var* w = vars[i].get();
      ::tensorflow::Var* v = vars[n_ + i].get();
      const Tensor& g = grads[i];
      OP_REQUIRES(ctx, w->is_initialized && v->is_initialized,
                  absl::FailedPreconditionError(absl::StrCat("HvrepFusedLarsApply: ", w->is_initialized ? "momentum slot "
                                                             : "variable ", i, " is not initialized.")));
      OP_REQUIRES(ctx, w->tensor()->dtype() == g.dtype() && v->tensor()->dtype() == g.dtype(),
                  absl::InvalidArgumentError(absl::StrCat(
                      "HvrepFusedLarsApply: variable ", i, " is ", ::tensorflow::DataTypeString(w->tensor()->dtype()),
                      ", its momentum slot ", ::tensorflow::DataTypeString(v->tensor()->dtype()), " and its gradient ",
                      ::tensorflow::DataTypeString(g.dtype()), "; all three must be the op's T.")));
      OP_REQUIRES(ctx, w->tensor()->shape() == g.shape() && v->tensor()->shape() == g.shape(),
                  absl::InvalidArgumentError(absl::StrCat(
                      "HvrepFusedLarsApply: variable ", i, " has shape ", w->tensor()->shape().DebugString(),
                      ", its momentum slot ", v->tensor()->shape().DebugString(), " and its gradient ",
                      g.shape().DebugString(), "; they must be equal.")));
      OP_REQUIRES_OK(ctx, PrepareToUpdate<Traits>(ctx, w));
      OP_REQUIRES_OK(ctx, PrepareToUpdate<Traits>(ctx, v));
      tensors[i] = hvrep_lars_tensor{w->tensor()->data(), v->tensor()->data(), g.data(),
                                     g.NumElements(), static_cast<uint32_t>(flags_[i])};
    }
    OP_REQUIRES_OK(ctx, Traits::Lars(ctx, ToHvrepDtype(::tensorflow::DataTypeToEnum<T>::v()), n_, tensors.data(),
                                     lr->data(), hp));
  }

 private:
  int n_ = 0;
  bool nesterov_ = false;
  std::vector<int32_t> flags_;
};

// HvrepPack: tensors (list, any of f16/bf16/f32/f64) + scale (f64 scalar) -> rank-1 buffer of out_type.
template <typename Traits>
class PackOp : public OpKernel {
 public:
  explicit PackOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    OP_REQUIRES_OK(ctx, ctx->GetAttr("out_type", &out_type_));
  }

  void Compute(OpKernelContext* ctx) override {
    ::tensorflow::OpInputList ins;
    OP_REQUIRES_OK(ctx, ctx->input_list("tensors", &ins));
    const Tensor* scale;
    OP_REQUIRES_OK(ctx, ctx->input("scale", &scale));
    OP_REQUIRES(ctx, ::tensorflow::TensorShapeUtils::IsScalar(scale->shape()),
                absl::InvalidArgumentError("HvrepPack: scale must be a scalar."));
    std::vector<hvrep_tensor_ref> refs;
    int64_t total = 0;
    for (int i = 0; i < ins.size(); ++i) {
      refs.push_back(hvrep_tensor_ref{const_cast<void*>(ins[i].data()), ins[i].NumElements(),
                                      ToHvrepDtype(ins[i].dtype())});
      total += ins[i].NumElements();
    }
    Tensor* out;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({total}), &out));
    OP_REQUIRES_OK(ctx, Traits::Pack(ctx, static_cast<int>(refs.size()), refs.data(), out->data(),
                                     ToHvrepDtype(out_type_), scale->flat<double>().data()));
  }

 private:
  DataType out_type_;
};

// HvrepUnpack: a rank-1 buffer + scale -> tensors of the given dtypes and shapes.
// Piece i > 0 starts at the next multiple of `align` elements after piece i-1
// ends. With `share`, a piece in the buffer's dtype whose start is aligned as
// Eigen requires (EIGEN_MAX_ALIGN_BYTES) is returned as a slice of the buffer,
// as TensorFlow's Split does: no copy and no allocation. The other pieces are
// copied (cast, scaled) as without it.
template <typename Traits>
class UnpackOp : public OpKernel {
 public:
  explicit UnpackOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    std::vector<::tensorflow::PartialTensorShape> shapes;
    OP_REQUIRES_OK(ctx, ctx->GetAttr("Tout", &types_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("shapes", &shapes));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("align", &align_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("share", &share_));
    OP_REQUIRES(ctx, shapes.size() == types_.size(),
                absl::InvalidArgumentError(absl::StrCat("HvrepUnpack: ", shapes.size(), " shapes for ", types_.size(),
                                                        " output dtypes; give one shape per output.")));
    int64_t at = 0;
    for (size_t i = 0; i < shapes.size(); ++i) {
      TensorShape s;
      OP_REQUIRES(ctx, shapes[i].AsTensorShape(&s),
                  absl::InvalidArgumentError(absl::StrCat("HvrepUnpack: shape ", i, " is ", shapes[i].DebugString(),
                                                          "; every shape must be fully defined.")));
      if (i > 0) at = (at + align_ - 1) / align_ * align_;
      offsets_.push_back(at);
      at += s.num_elements();
      shapes_.push_back(s);
    }
    total_ = at;
  }

  void Compute(OpKernelContext* ctx) override {
    const Tensor& packed = ctx->input(0);
    const Tensor* scale;
    OP_REQUIRES_OK(ctx, ctx->input("scale", &scale));
    OP_REQUIRES(ctx, ::tensorflow::TensorShapeUtils::IsScalar(scale->shape()),
                absl::InvalidArgumentError("HvrepUnpack: scale must be a scalar."));
    OP_REQUIRES(ctx, packed.dims() == 1 && packed.NumElements() == total_,
                absl::InvalidArgumentError(absl::StrCat("HvrepUnpack: the buffer has shape ", packed.shape().DebugString(),
                                                        " but the ", shapes_.size(), " output shapes need [", total_,
                                                        "] elements.")));
    OP_REQUIRES(ctx, !share_ || Traits::ScaleMayBeOne(*scale),
                absl::InvalidArgumentError("HvrepUnpack: share=true needs a scale of 1 (a shared piece is not scaled)."));
    ::tensorflow::OpOutputList outs;
    OP_REQUIRES_OK(ctx, ctx->output_list("tensors", &outs));
    const int src_dtype = ToHvrepDtype(packed.dtype());
    const size_t bsize = hvrep_dtype_size(src_dtype);
    const char* base = static_cast<const char*>(packed.data());
    std::vector<hvrep_tensor_ref> refs;  // the copied pieces, contiguous in the buffer while align_ == 1
    std::vector<int64_t> starts;         // their element offsets
    for (size_t i = 0; i < shapes_.size(); ++i) {
      const int64_t n = shapes_[i].num_elements();
      if (share_ && types_[i] == packed.dtype() && n > 0) {
        const Tensor slice = packed.Slice(offsets_[i], offsets_[i] + n);
        Tensor view;
        if (slice.IsAligned() && view.CopyFrom(slice, shapes_[i])) {  // Eigen's aligned maps need the former
          outs.set(static_cast<int>(i), view);
          continue;
        }
      }
      Tensor* out;
      OP_REQUIRES_OK(ctx, outs.allocate(static_cast<int>(i), shapes_[i], &out));
      refs.push_back(hvrep_tensor_ref{out->data(), out->NumElements(), ToHvrepDtype(types_[i])});
      starts.push_back(offsets_[i]);
    }
    if (refs.empty()) return;
    if (align_ == 1 && !share_) {  // one call for the whole buffer
      OP_REQUIRES_OK(ctx, Traits::Unpack(ctx, base, src_dtype, static_cast<int>(refs.size()), refs.data(),
                                         scale->flat<double>().data()));
      return;
    }
    for (size_t k = 0; k < refs.size(); ++k) {  // pieces apart: one call each
      OP_REQUIRES_OK(ctx, Traits::Unpack(ctx, base + starts[k] * bsize, src_dtype, 1, &refs[k],
                                         scale->flat<double>().data()));
    }
  }

 private:
  std::vector<DataType> types_;
  std::vector<TensorShape> shapes_;
  std::vector<int64_t> offsets_;
  int64_t total_ = 0;
  int64_t align_ = 1;
  bool share_ = false;
};

}  // namespace hvrep

#endif  // HVREP_TF_OPS_H_
