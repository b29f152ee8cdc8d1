#pragma once
// How the control-plane state is laid out in etcd (state.backend: etcd), and the pure steps
// of the etcd backend: applying watched keys to a view of the state, and planning the one
// transaction that turns a view into the next state. No I/O (proxy/etcd_store.cc talks to etcd).
//
// Layout under the configured prefix (state.etcd.prefix, default "/egressd/"):
//   <prefix>secrets/<name>@<scope>   one sealed secret (JSON, ciphertext only)
//   <prefix>runs/<run id>            one run with its pins and its sealed CA key (JSON),
//                                    attached to an etcd lease that ends after the run
// One key per record, so replicas writing different records do not conflict, and a
// transaction compares only the mod revisions of the keys it changes.
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "common/result.h"
#include "credstore/state_store.h"

namespace egress::credstore::etcd {

std::string secret_path(const std::string& prefix, const SealedSecret& s);
std::string run_path(const std::string& prefix, const std::string& run_id);
/// The end of the key range that holds every key starting with `prefix` (etcd's range_end).
std::string prefix_range_end(const std::string& prefix);

/// The state as this replica last saw it in etcd: the snapshot (its revision is etcd's), and
/// each record key's mod revision (what a transaction compares).
struct View {
    std::shared_ptr<const StateSnapshot> snap = std::make_shared<const StateSnapshot>();
    std::map<std::string, int64_t> mod_revisions;
};

/// Applies one key of a range or watch answer to `snap` and `revs`: a put (`value` set) or a
/// delete. A key outside the layout is ignored. A value that does not parse is an error naming
/// the key; its record is dropped (fail closed: the value it had is not served on) and its
/// revision kept, so a write can replace it (the caller logs it and keeps the rest).
Result<bool> apply_kv(StateSnapshot& snap, std::map<std::string, int64_t>& revs,
                      const std::string& prefix, std::string_view key,
                      std::optional<std::string_view> value, int64_t mod_revision);

/// One transaction: puts and deletes guarded by the mod revision each key had in the view
/// (0: the key must be absent), so a concurrent change to the same record makes it fail.
struct TxnPlan {
    struct Put {
        std::string key;
        std::string value;
        std::optional<int64_t> run_expires_at;  // a new run: its key gets a lease ending after it
        /// A run rewritten with the same expiry (a pin added, a revoke, a rewrap): it keeps
        /// the lease it has (etcd's ignore_lease), rather than a new one for each write that
        /// would leave the old one granted, keyless, until it ran out.
        bool keep_lease = false;
    };
    std::vector<Put> puts;
    std::vector<std::string> deletes;
    std::map<std::string, int64_t> expect;  // key → mod revision in the view
    bool empty() const { return puts.empty() && deletes.empty(); }
    size_t ops() const { return puts.size() + deletes.size(); }
};

/// What turns the view's state into `next`: only the records whose serialized form changed.
TxnPlan plan_txn(const View& base, const StateSnapshot& next, const std::string& prefix);

}  // namespace egress::credstore::etcd
