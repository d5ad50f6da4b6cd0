// Stand-in for highwayhash/hh_types.h (see ../../../README.md).
#ifndef HVREP_COMPAT_HIGHWAYHASH_HH_TYPES_H_
#define HVREP_COMPAT_HIGHWAYHASH_HH_TYPES_H_
#include <cstdint>

namespace highwayhash {
using HHKey = uint64_t[4];
using HHResult64 = uint64_t;
using HHResult128 = uint64_t[2];
using HHResult256 = uint64_t[4];
}  // namespace highwayhash

#endif  // HVREP_COMPAT_HIGHWAYHASH_HH_TYPES_H_
