// Stand-in for highwayhash/state_helpers.h (tensorflow/core/platform/strong_hash.h).
// Declarations only; see ../../../README.md.
#ifndef HVREP_COMPAT_HIGHWAYHASH_STATE_HELPERS_H_
#define HVREP_COMPAT_HIGHWAYHASH_STATE_HELPERS_H_
#include <cstdint>
#include <string>

namespace highwayhash {
template <class State>
class StringHasher {
 public:
  uint64_t operator()(const typename State::Key& key, const std::string& s) const;
};
}  // namespace highwayhash

#endif  // HVREP_COMPAT_HIGHWAYHASH_STATE_HELPERS_H_
