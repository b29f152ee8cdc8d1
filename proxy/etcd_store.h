#pragma once
// The etcd state backend (state.backend: etcd): a fleet of replicas shares secrets, runs and
// run CAs through one etcd cluster. Talks to etcd's v3 JSON gateway (/v3/kv/range, /v3/kv/txn,
// /v3/lease/grant, /v3/watch) over HTTP/1.1 with Beast: no gRPC stack for four calls.
//
// - Reads never touch etcd: snapshot() is the view the watch keeps current.
// - apply() computes the next state from that view, writes the changed records in one
//   transaction guarded by their mod revisions (a concurrent write to the same record makes
//   it retry on the fresher view), then waits until the watch has brought this replica to
//   the transaction's revision, so its own writes are visible when apply() returns.
// - A run's key holds an etcd lease that ends lease_grace after the run, so the records of
//   runs nobody sweeps (every replica down) do not pile up; the replicas' own sweep deletes
//   an expired run first, and every replica sees the deletion through its watch.
// - Listeners run on the store's own thread, in revision order.
// - etcd unreachable: reads keep the last view (the data path keeps serving), writes fail
//   with an error naming etcd, and the watch reconnects and resynchronizes by itself.
// - The watch requires a leader (a member cut off from it ends the watch: "etcdserver: no
//   leader"), and about once a second a linearizable count of the prefix, asked of the
//   watched member first, checks it: a watched member that does not answer while another
//   does (it hangs: its kernel still answers TCP keepalive) moves the watch to the one that
//   did; a change under the prefix that etcd holds and the watch has not delivered for
//   state.etcd.timeout drops the watch. Either way the state is read again (one log line).
//   An idle cluster costs that one count a second and nothing more.
// - https:// endpoints: TLS 1.2+, etcd's certificate verified for the endpoint's host (name or
//   IP) against ca_file, and a client certificate for an etcd with --client-cert-auth.
#include <chrono>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "common/result.h"
#include "credstore/state_store.h"
#include "proxy/config.h"
#include "tls/openssl_ptr.h"

namespace egress::proxy {

/// The TLS client context of the https:// endpoints (null when none is https://): TLS 1.2+,
/// state.etcd.ca_file's CAs, the client certificate if one is set. Errors name the key;
/// `egressd --check` calls it too (it reads files, dials nothing).
Result<tls::SslCtxPtr> etcd_tls_context(const EtcdConfig& options);

/// Connects, loads the state under the prefix and starts the watch. Errors name what failed
/// (an endpoint that is not http://host:port, no endpoint reachable, a record that does not
/// parse is only logged). Endpoint names are looked up with resolver.servers and
/// resolver.overrides (`dns_servers`, `dns_overrides`) as upstream names are.
Result<std::unique_ptr<credstore::StateStore>> open_etcd_store(
    const EtcdConfig& options, std::vector<std::string> dns_servers = {},
    std::map<std::string, std::vector<policy::IpAddress>> dns_overrides = {});

}  // namespace egress::proxy
