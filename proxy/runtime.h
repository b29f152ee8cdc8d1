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

/// A pin of a run whose secret could not be loaded (a secret file not mounted yet, a store
/// secret deleted or not found in the run's scope): it injects nothing, and its host is
/// refused as secret_unavailable rather than host_not_allowed (destination_refusal_reason).
struct UnavailablePin {
    policy::HostPattern host;
    std::string pin_id;
    std::string secret_name;  // the store secret's name, or the secret file's name
    std::string secret_file;  // the path of a secret_file pin; empty for a store secret
    /// Under decide_destination's port rule (its own port, else policy.allowed_ports): the
    /// destinations the pin would cover if its secret were there.
    bool matches(const policy::HostPort& dest, const policy::GlobalPolicy& global) const {
        return policy::pattern_allows(host, dest, global);
    }
};

struct Run {
    policy::RunPolicy policy;
    std::optional<std::chrono::seconds> static_ttl;  // static runs: the ttl they were built with
    std::chrono::seconds ca_validity{0};  // static runs: what their CA was made with
    bool dynamic = false;        // created through the admin API (state store)
    int64_t created_at = 0;      // dynamic runs: when (unix seconds); static ones: 0
    credstore::SecretPtr token;  // static runs with token_file
    std::string token_sha256;    // dynamic runs: hex SHA-256 of the proxy token
    bool anonymous = false;      // the sole static run without token_file
    std::shared_ptr<tls::RunCa> ca;
    std::shared_ptr<tls::LeafCache> leaves;  // keeps `ca` alive (see make_leaf_cache)
    /// Pins whose secret could not be loaded (e.g. a secret file not mounted yet): their
    /// hosts are refused with "secret_unavailable" instead of "host_not_allowed".
    std::vector<UnavailablePin> unavailable_pins;
    std::vector<policy::Cidr> sources;  // transparent mode: client addresses bound to the run

    /// Static runs: pins on a store secret (`secret: NAME`), found by `scope` in the state
    /// store. As build_runtime() makes them they are not in policy.pins and their hosts are
    /// the last store_pins.size() entries of unavailable_pins (refused, secret_unavailable);
    /// the control plane serves a copy with the secrets resolved (with_store_secrets).
    struct StorePin {
        policy::Pin pin;        // everything but the secret and its injection
        size_t after = 0;       // how many of policy.pins come before it, in config order
        std::string yaml_path;  // "runs[0].pins[2]", for warnings
    };
    std::vector<StorePin> store_pins;
    credstore::Scope scope;
};

/// The served form of a static run with store pins: a new Run sharing `statics`' CA, leaf
/// cache, token and sources, whose pins are its file pins with the store pins merged in config
/// order, each given `values[i]` (store_pins[i]'s secret, or null: that pin's host is then
/// refused as secret_unavailable). `injections` prepares the new pins. (Connections are
/// counted by run id, ConnectionRegistry: the copy shares the static run's count.)
std::shared_ptr<Run> with_store_secrets(const Run& statics,
                                        const std::vector<credstore::SecretPtr>& values,
                                        policy::InjectionCache& injections);

/// The first of `run`'s unavailable pins that matches `dest` (UnavailablePin::matches: host,
/// and port under `global`'s rule), or null.
const UnavailablePin* find_unavailable_pin(const Run& run, const policy::GlobalPolicy& global,
                                           const policy::HostPort& dest);

/// The reason a destination refusal of `dest` is given with, by the proxy listeners (the
/// X-Egress-Reason and the audit record) and by run explain alike: decide_destination's
/// `reason`, except for host_not_allowed, which is what the refusal would be with the run's
/// unavailable pins' secrets there: secret_unavailable when one of them matches `dest` (the
/// grant exists; its secret does not, yet), port_not_allowed when one names the host but
/// not this port. Returns `reason` itself or a static string.
std::string_view destination_refusal_reason(const Run& run, const policy::GlobalPolicy& global,
                                            const policy::HostPort& dest,
                                            std::string_view reason);

struct Runtime {
    std::shared_ptr<const Config> config;
    policy::AddressPolicy addresses;
    std::map<std::string, std::shared_ptr<Run>> runs;
    std::shared_ptr<Run> anonymous;  // set when the only static run has no token
    /// Dynamic runs that ended (revoked, expired, or recently swept). A client presenting
    /// such a run's own token gets 403 with the reason instead of 407, so it learns why;
    /// nobody else learns the run existed. On the transparent listener a source whose longest
    /// match is an ended run's range is refused the same way, not given to a broader run.
    struct Ended {
        std::string token_sha256;
        std::string reason;  // run_revoked, run_expired
        std::vector<policy::Cidr> sources;
        int64_t created_at = 0;  // when the run was made: a run made after it takes its sources
    };
    std::map<std::string, Ended> ended;

    /// The transparent listener's identity of a client address: a run, or the reason the
    /// run its address is bound to ended (run null), or neither.
    struct SourceMatch {
        std::shared_ptr<Run> run;
        std::string_view ended;  // a reason in `ended` (valid while this Runtime lives)
    };

    std::shared_ptr<Run> find(const std::string& id) const;
    /// The same without a copy: the map's own pointer (valid while this Runtime lives), or null.
    const std::shared_ptr<Run>* lookup(const std::string& id) const;
    /// Transparent mode: the run whose `sources` hold `client` (longest prefix wins; two runs
    /// tied on the longest prefix: none, the binding is ambiguous), else the anonymous run
    /// if it has no sources of its own. An ended run's sources take part: when one of them
    /// is the longest match, the answer is its end reason, unless a run created after the
    /// ended one holds the address (any range): the longest of those.
    SourceMatch find_by_source(const policy::IpAddress& client) const;
};

struct BuildWarnings {
    std::vector<std::string> lines;
};

/// Reads token and secret files, creates each run's CA, and returns the snapshot; it writes
/// no file (write_ca_files does, once the snapshot is accepted). Errors name the YAML path of
/// the bad key. Secret files that do not exist yet produce a warning and an unavailable pin.
/// With `previous` (a reload), static runs whose id and ttl are unchanged keep their CA and
/// leaf cache, so sandboxes that trust the old CA keep working.
Result<std::shared_ptr<Runtime>> build_runtime(std::shared_ptr<const Config> config,
                                               BuildWarnings& warnings,
                                               const Runtime* previous = nullptr);

/// Why `path` cannot take a CA file (a folder, a FIFO …: it must be absent, a regular file or
/// a symlink, which the rename replaces), or "". write_ca_files and start_file_errors (so
/// --check and a reload too) refuse such a target.
std::string unfit_ca_target(const std::string& path);

/// Writes each static run's CA certificate to its ca_cert_out, and its CA bundle (the roots
/// egressd trusts upstream, then the run CA) to its ca_bundle_out: call it only for a runtime
/// that will serve (a start, or a reload that is applied). With `previous`, a run that keeps
/// its CA and ca_cert_out is skipped; a bundle is written when its content changed. All files
/// are written beside their place first and renamed only if every one succeeded, so on an
/// error (naming runs[i].ca_cert_out or .ca_bundle_out) no file changed. `warnings` gets a
/// line when the system has no trust store to start a bundle from.
Result<bool> write_ca_files(const Runtime& next, const Runtime* previous = nullptr,
                            BuildWarnings* warnings = nullptr);

/// How close a static run's CA is to its not_after (a run with ttl: null outlives it only if
/// the process runs longer than limits.static_ca_validity): Soon once a tenth of `validity`
/// (at most kCaNotice) is left, so the warning comes while there is time to restart.
enum class CaExpiry { Fine, Soon, Expired };
inline constexpr std::chrono::hours kCaNotice{24 * 7};
CaExpiry ca_expiry(std::chrono::system_clock::time_point not_after,
                   std::chrono::seconds validity, std::chrono::system_clock::time_point now);

/// A leaf cache that owns a reference to its CA, sized and rate-limited by `limits`.
std::shared_ptr<tls::LeafCache> make_leaf_cache(std::shared_ptr<tls::RunCa> ca,
                                                const Limits& limits);

/// True if `token` is the run's proxy token (constant time).
bool token_matches(const Run& run, std::string_view token);

/// Whether a client `before` admitted is admitted by `after` on the same terms: the same
/// proxy token (or none) and the same source ranges. A reload that changes them (a leaked
/// token rotated) closes the run's open connections.
bool same_admission(const Run& before, const Run& after);

/// Hex SHA-256.
std::string sha256_hex(std::string_view bytes);

/// The load warning for an aws-sigv4 pin whose secret is no valid credentials document
/// (`where`: the config key or the run and pin; `host`: the pin's host), "" for any other pin.
/// Names the problem, never a value.
std::string aws_pin_warning(const policy::Pin& pin, const std::string& where,
                            const std::string& host);

/// Decodes "Basic b64(user:pass)". Returns false if absent or malformed.
bool parse_proxy_basic(std::string_view header_value, std::string& user, std::string& pass);

}  // namespace egress::proxy
