#pragma once
// Records for the credstore tests: what the stores keep, with placeholder blobs (the stores
// never look inside them).
#include <cstdint>
#include <string>

#include "credstore/state_store.h"

namespace egress::credstore::test_records {

inline SealedSecret fake_secret(const std::string& name, const Scope& s, uint64_t version = 1) {
    SealedSecret out;
    out.name = name;
    out.scope = s;
    out.version = version;
    out.created_at = "2026-01-02T03:04:05Z";
    out.kek_id = "file:0123abcd";
    out.wrapped_dek = "d3JhcHBlZA==";
    out.nonce = "bm9uY2Vub25jZTEy";
    out.ciphertext = "Y2lwaGVy" + std::to_string(version);
    return out;
}

}  // namespace egress::credstore::test_records
