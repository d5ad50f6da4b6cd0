// Stand-in for Debian's libhighwayhash-dev highwayhash/arch_specific.h: the
// target constants xla/printer.h names. See ../../../README.md.
#ifndef HVREP_COMPAT_HIGHWAYHASH_ARCH_SPECIFIC_H_
#define HVREP_COMPAT_HIGHWAYHASH_ARCH_SPECIFIC_H_
#include <cstdint>

#define HH_TARGET_Portable 1
#define HH_TARGET_SSE41 4
#define HH_TARGET_AVX2 8
#ifndef HH_TARGET_PREFERRED
#define HH_TARGET_PREFERRED HH_TARGET_Portable
#endif

namespace highwayhash {
using TargetBits = uint32_t;
}  // namespace highwayhash

#endif  // HVREP_COMPAT_HIGHWAYHASH_ARCH_SPECIFIC_H_
