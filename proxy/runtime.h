#pragma once
// The state the data path reads: runs (policy, CA, leaf cache, token) and global policy,
// built from a validated Config. A Runtime is an immutable snapshot shared by every
// connection (shared_ptr<const Runtime>); only counters inside a Run change. No Asio here.
#include <atomic>
#include <chrono>
#include <optional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "common/result.h"
#include "credstore/secret.h"
#include "policy/address.h"
#include "policy/run_policy.h"
#include "proxy/config.h"
#include "tls/leaf_cache.h"
#include "tls/run_ca.h"

namespace egress::proxy {

struct Run {
    policy::RunPolicy policy;
    std::optional<std::chrono::seconds> static_ttl;  // static runs: the ttl they were built with
    bool dynamic = false;        // created through the admin API (state store)
    credstore::SecretPtr token;  // static runs with token_file
    std::string token_sha256;    // dynamic runs: hex SHA-256 of the proxy token
    bool anonymous = false;      // the sole static run without token_file
    std::shared_ptr<tls::RunCa> ca;
    std::shared_ptr<tls::LeafCache> leaves;  // keeps `ca` alive (see make_leaf_cache)
    /// Pins whose secret could not be loaded (e.g. a secret file not mounted yet): their
    /// hosts are refused with "secret_unavailable" instead of "host_not_allowed".
    std::vector<policy::HostPattern> unavailable_pins;
    std::vector<policy::Cidr> sources;  // transparent mode: client addresses bound to the run
    std::atomic<size_t> connections{0};
};

struct Runtime {
    std::shared_ptr<const Config> config;
    policy::AddressPolicy addresses;
    std::map<std::string, std::shared_ptr<Run>> runs;
    std::shared_ptr<Run> anonymous;  // set when the only static run has no token
    /// Dynamic runs that ended (revoked, expired, or recently swept): id → (token SHA-256,
    /// reason). A client presenting such a run's own token gets 403 with the reason instead
    /// of 407, so it learns why; nobody else learns the run existed.
    std::map<std::string, std::pair<std::string, std::string>> ended;

    std::shared_ptr<Run> find(const std::string& id) const;
    /// The same without a copy: the map's own pointer (valid while this Runtime lives), or null.
    const std::shared_ptr<Run>* lookup(const std::string& id) const;
    /// Transparent mode: the run whose `sources` hold `client` (longest prefix wins; two runs
    /// tied on the longest prefix: none, the binding is ambiguous), else the anonymous run
    /// if it has no sources of its own.
    std::shared_ptr<Run> find_by_source(const policy::IpAddress& client) const;
};

struct BuildWarnings {
    std::vector<std::string> lines;
};

/// Reads token and secret files, creates each run's CA (writing its certificate to
/// ca_cert_out), and returns the snapshot. Errors name the YAML path of the bad key.
/// Secret files that do not exist yet produce a warning and an unavailable pin.
/// With `previous` (a reload), static runs whose id and ttl are unchanged keep their CA and
/// leaf cache, so sandboxes that trust the old CA keep working.
Result<std::shared_ptr<Runtime>> build_runtime(std::shared_ptr<const Config> config,
                                               BuildWarnings& warnings,
                                               const Runtime* previous = nullptr);

/// A leaf cache that owns a reference to its CA, sized and rate-limited by `limits`.
std::shared_ptr<tls::LeafCache> make_leaf_cache(std::shared_ptr<tls::RunCa> ca,
                                                const Limits& limits);

/// True if `token` is the run's proxy token (constant time).
bool token_matches(const Run& run, std::string_view token);

/// Hex SHA-256.
std::string sha256_hex(std::string_view bytes);

/// Decodes "Basic b64(user:pass)". Returns false if absent or malformed.
bool parse_proxy_basic(std::string_view header_value, std::string& user, std::string& pass);

}  // namespace egress::proxy
