// Stand-in for highwayhash/highwayhash.h: xla::HighwayHashPrinter holds a
// HighwayHashCatT member, so the type must be complete. Its members are
// declared, never defined: constructing one from code built here fails at
// load time instead of hashing wrongly. See ../../../README.md.
#ifndef HVREP_COMPAT_HIGHWAYHASH_HIGHWAYHASH_H_
#define HVREP_COMPAT_HIGHWAYHASH_HIGHWAYHASH_H_
#include <cstddef>
#include <cstdint>
#include "highwayhash/arch_specific.h"
#include "highwayhash/hh_types.h"

namespace highwayhash {
template <TargetBits Target>
class HighwayHashCatT {
 public:
  explicit HighwayHashCatT(const HHKey& key);
  void Reset(const HHKey& key);
  void Append(const char* bytes, size_t num_bytes);
  void Finalize(HHResult64* result);
  void Finalize(HHResult128* result);

 private:
  // Same footprint as the real class: 4x4 lanes of state, a 32-byte buffer.
  alignas(32) uint64_t state_[16];
  alignas(32) char buffer_[32];
  size_t buffer_usage_;
};
}  // namespace highwayhash

#endif  // HVREP_COMPAT_HIGHWAYHASH_HIGHWAYHASH_H_
