// Force-included (g++ -include) into every C++ file of a Horovod GPU build.
// TensorFlow 2.18+ removed xla::StatusOr, which Horovod 0.28.1's XLA ops
// still name; alias it to absl::StatusOr, which is what it used to be.
// Guarded with __has_include because the same CXXFLAGS reach Gloo's sources,
// which are compiled without TensorFlow's include path.
#ifndef HVREP_GPU_COMPAT_H_
#define HVREP_GPU_COMPAT_H_
#if defined(__cplusplus) && __has_include("absl/status/statusor.h")
#include "absl/status/statusor.h"
namespace xla {
template <typename T>
using StatusOr = absl::StatusOr<T>;
}  // namespace xla
#endif
#endif  // HVREP_GPU_COMPAT_H_
