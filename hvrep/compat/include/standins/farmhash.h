// Stand-in for Debian's libfarmhash-dev <farmhash.h>: only what TensorFlow's
// public headers (tsl/platform/fingerprint.h) name. The hash functions are
// declared, never defined: code built against this header must not call them
// (Horovod does not); a call fails loudly at load time with an undefined
// symbol instead of hashing wrongly. Used only when the real header is absent
// (see ../../README.md).
#ifndef HVREP_COMPAT_FARMHASH_H_
#define HVREP_COMPAT_FARMHASH_H_
#include <cstddef>
#include <cstdint>
#include <utility>

// farmhash.h puts its functions in NAMESPACE_FOR_HASH_FUNCTIONS, "util" by
// default, which is the name TensorFlow calls (::util::Fingerprint64).
namespace util {
typedef std::pair<uint64_t, uint64_t> uint128_t;
inline uint64_t Uint128Low64(const uint128_t x) { return x.first; }
inline uint64_t Uint128High64(const uint128_t x) { return x.second; }

uint32_t Fingerprint32(const char* s, size_t len);
uint64_t Fingerprint64(const char* s, size_t len);
uint128_t Fingerprint128(const char* s, size_t len);
}  // namespace util

#endif  // HVREP_COMPAT_FARMHASH_H_
