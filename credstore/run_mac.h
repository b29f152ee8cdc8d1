#pragma once
// Run records are authenticated: each carries an HMAC-SHA256 over every field that decides
// where a secret may go (scope, token hash, expiry, revoked, hosts, sources, pins, CA), under
// the record MAC key of its own sealed CA key (credstore/envelope.h: derived from that key's
// DEK, so only a holder of the master key, or a KMS's unwrap, can make or check it). Whoever
// can write the state (etcd's prefix, state.json) but has no master key can no longer create
// a run, add a pin, change a token hash or move a secret to another host: a record that does
// not verify is not served. A `keys rotate` rewraps the DEK, never changes it: every MAC stays
// valid. What a MAC cannot stop (a record deleted, or replaced by an earlier authentic copy of
// itself) is in SECURITY.md. Pure: no I/O.
#include <string>

#include "credstore/secret.h"
#include "credstore/state_store.h"

namespace egress::credstore {

/// What the MAC covers: every field of the record, length-prefixed (injective), except the
/// MAC itself and the CA key's kek_id and wrapped_dek (a KEK rotation changes those; the DEK
/// they wrap is what keys the MAC).
std::string run_mac_input(const RunRecord& r);

/// The MAC of `r` under `key` (lowercase hex).
std::string run_mac(const RunRecord& r, const SecretValue& key);

/// Sets r.mac.
void sign_run(RunRecord& r, const SecretValue& key);

/// Whether r.mac is the MAC of `r` under `key` (constant time). A record without one (written
/// by an egressd from before records were authenticated) does not verify: accepting it would
/// let anyone who can write the state strip the MAC off any record to have it accepted.
bool run_mac_valid(const RunRecord& r, const SecretValue& key);

}  // namespace egress::credstore
