// What the CUDA library needs from the machine, asked before any kernel runs
// (hvrep/kernels.py): the statically linked runtime refuses to work with an
// older driver, and every op would then fail with "CUDA driver version is
// insufficient" in the middle of a training step instead of falling back.

#include <cuda_runtime.h>

#include "hvrep_kernels.h"

extern "C" int hvrep_cuda_versions(int* driver, int* runtime) {
  if (driver == nullptr || runtime == nullptr) return HVREP_EINVAL;
  *driver = 0;
  *runtime = 0;
  // Neither call needs a device; cudaDriverGetVersion gives 0 without a driver.
  cudaError_t err = cudaDriverGetVersion(driver);
  if (err != cudaSuccess) return static_cast<int>(err);
  err = cudaRuntimeGetVersion(runtime);
  return err == cudaSuccess ? HVREP_OK : static_cast<int>(err);
}
