// Restores stream_executor::gpu::AsGpuStreamValue(Stream*), which TensorFlow
// removed (TF 2.18+) and Horovod 0.28.1's NCCL build still calls. Without it,
// `import horovod.tensorflow` fails with
//   undefined symbol: _ZN15stream_executor3gpu16AsGpuStreamValueEPNS_6StreamE
// hvrep/compat/__init__.py loads the built library with RTLD_GLOBAL after
// TensorFlow and before Horovod. (LD_PRELOAD does not work: it is loaded
// before TensorFlow's own libraries and crashes in hashlib.)
#include "xla/stream_executor/stream.h"

struct CUstream_st;

namespace stream_executor {
namespace gpu {

CUstream_st* AsGpuStreamValue(Stream* stream) {
  return static_cast<CUstream_st*>(stream->platform_specific_handle().stream);
}

}  // namespace gpu
}  // namespace stream_executor
