#pragma once
// glibc's allocator keeps up to 7 freed blocks per size class in a per-thread cache (tcache);
// beyond that a free and the next malloc of that size go through the arena's bins
// (_int_free, _int_malloc), several times dearer. An HTTP/2 connection with 50 streams in
// flight allocates and frees each stream's blocks in bursts of 50, so most of them missed the
// cache: with tcache_count=256 a proxied h2 stream costs 5-7% fewer instructions and an h1
// request at 16 connections 3% fewer (bench/RESULTS.md); peak RSS moves by 0.1-0.2 MiB.
//
// The count is a start-up tunable only (GLIBC_TUNABLES, read before main; mallopt has no
// such parameter), so egressd re-executes itself once, first thing, with the tunable added
// to its environment. An operator's own glibc.malloc.tcache_count wins and means no re-exec.
#include <optional>
#include <string>

namespace egress::proxy {

inline constexpr int kTcacheCount = 256;

/// The GLIBC_TUNABLES value egressd wants, given the inherited one (nullptr when unset): the
/// inherited tunables with glibc.malloc.tcache_count=kTcacheCount appended. nullopt when the
/// inherited value already sets glibc.malloc.tcache_count (nothing to do).
std::optional<std::string> tuned_glibc_tunables(const char* inherited);

/// Re-executes the running binary (its path from /proc/self/exe, so the process keeps its
/// name and pid) with argv and the tuned GLIBC_TUNABLES, unless tuned_glibc_tunables says
/// there is nothing to do or this is not glibc. Returns only when it did not re-execute (the
/// process then runs with glibc's defaults). Call before any thread starts.
void reexec_with_malloc_tuning(char** argv);

}  // namespace egress::proxy
