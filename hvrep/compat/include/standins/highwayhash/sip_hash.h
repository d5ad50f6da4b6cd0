// Stand-in for highwayhash/sip_hash.h (tensorflow/core/platform/strong_hash.h).
// Declarations only; see ../../../README.md.
#ifndef HVREP_COMPAT_HIGHWAYHASH_SIP_HASH_H_
#define HVREP_COMPAT_HIGHWAYHASH_SIP_HASH_H_
#include <cstdint>

namespace highwayhash {
class SipHashState {
 public:
  using Key = uint64_t[2];
  explicit SipHashState(const Key& key);
};
}  // namespace highwayhash

#endif  // HVREP_COMPAT_HIGHWAYHASH_SIP_HASH_H_
