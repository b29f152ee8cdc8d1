#pragma once
// Control-plane state: sealed secrets, runs and their pins. Readers take immutable snapshots
// (common/published.h); updates are applied atomically and durably.
// Backends: FileStateStore (embedded default, state.path) and the etcd backend
// (credstore/etcd_store.h, a fleet of replicas sharing one state).
#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "common/published.h"
#include "common/result.h"
#include "credstore/envelope.h"
#include "credstore/scope.h"

namespace egress::credstore {

struct InjectRecord {
    std::string type;  // "bearer" | "basic" | "header" | "aws-sigv4"
    std::string username;
    std::string name;
    std::string value_template = "{secret}";
    std::string access_key_id;  // aws-sigv4 (not secret; the secret is the pin's secret)
    std::string region;
    std::string service;
};

struct PinRecord {
    std::string id;     // "pin_<hex>"
    std::string host;   // host pattern text, optionally with ":port"
    std::string secret; // secret name (resolved by scope at use time)
    InjectRecord inject;
    std::vector<std::string> path_prefixes;
    std::vector<std::string> methods;
    /// Static extra headers (name, value) set with the credential; at most 20.
    std::vector<std::pair<std::string, std::string>> extra_headers;
    int64_t expires_at = 0;  // unix seconds; never later than the run's
};

struct RunRecord {
    std::string id;          // "run_<hex>"
    Scope scope;
    std::string token_sha256;  // hex SHA-256 of the proxy token; the token itself is not kept
    int64_t created_at = 0;
    int64_t expires_at = 0;  // unix seconds
    bool revoked = false;
    std::vector<std::string> allow_hosts;
    std::vector<std::string> source_cidrs;
    std::vector<PinRecord> pins;
    std::string ca_cert_pem;   // public
    SealedSecret ca_key;       // the CA private key (PEM), sealed like a secret, name "ca:<run id>"
    /// HMAC-SHA256 (hex) of every other field, under ca_key's record MAC key
    /// (credstore/run_mac.h): a record that does not verify is not served. Empty in a record
    /// an egressd from before MACs wrote (not served either).
    std::string mac;
};

struct StateSnapshot {
    uint64_t revision = 0;
    /// Keyed by secret_key(name, scope).
    std::map<std::string, SealedSecret> secrets;
    std::map<std::string, RunRecord> runs;
};

std::string secret_key(const std::string& name, const Scope& scope);

/// A secret's name: 1..128 characters of [A-Za-z0-9_.-] (the admin API and the config's
/// `secret:` pins share the rule).
bool valid_secret_name(std::string_view name);
inline constexpr const char* kSecretNameRule = "1..128 characters of [A-Za-z0-9_.-]";

/// One atomic change. Exactly one of the members is meaningful, chosen by `kind`.
struct Mutation {
    enum class Kind { PutSecret, DeleteSecret, PutRun, DeleteRun, ReplaceSecrets };
    Kind kind = Kind::PutSecret;
    SealedSecret secret;                 // PutSecret
    std::string name;                    // DeleteSecret: every scope of this name unless scope set
    std::optional<Scope> scope;          // DeleteSecret
    RunRecord run;                       // PutRun (insert or replace)
    std::string run_id;                  // DeleteRun
    std::vector<SealedSecret> secrets;   // ReplaceSecrets (KEK rotation: all at once)
    /// Read-modify-write guards, checked against the state the change is applied to (with
    /// several replicas, etcd's, not the snapshot the caller read): a mismatch is a
    /// "conflict: ..." error and nothing is applied.
    /// PutSecret: the version the stored secret must have now (0: it must not exist).
    std::optional<uint64_t> expect_version;
    /// PutRun: the record the change was made from; the stored run must still equal it.
    std::optional<RunRecord> expect_run;
};

class StateStore {
public:
    virtual ~StateStore() = default;
    /// The current snapshot. Lock-free; never null.
    virtual std::shared_ptr<const StateSnapshot> snapshot() const = 0;
    /// Applies the mutations atomically (all or nothing) and durably: when this returns ok,
    /// the new state survives a crash. Returns the new revision.
    virtual Result<uint64_t> apply(const std::vector<Mutation>& mutations) = 0;
    /// Called (on the applying thread) after each successful apply with the new snapshot.
    virtual void on_change(std::function<void(std::shared_ptr<const StateSnapshot>)> cb) = 0;
    /// Stops calling listeners (a backend with a thread of its own joins it); apply() fails
    /// afterwards. For shutdown: listeners use what their owner is about to destroy.
    virtual void stop() {}
    /// How long ago this replica last knew its snapshot held all of a shared store's state (the
    /// etcd backend: a read or check of etcd that showed it); nullopt for a store that cannot
    /// fall behind (the file backend).
    virtual std::optional<std::chrono::steady_clock::duration> sync_age() const {
        return std::nullopt;
    }
};

/// Applies mutations to a copy of `base` (pure; shared by every backend). Errors:
/// DeleteSecret/DeleteRun of something absent → "not_found: ...".
Result<StateSnapshot> apply_mutations(const StateSnapshot& base,
                                      const std::vector<Mutation>& mutations);

/// JSON (de)serialization of a snapshot (boost::json), shared by every backend.
std::string snapshot_to_json(const StateSnapshot& s);
Result<StateSnapshot> snapshot_from_json(const std::string& text);

/// One record on its own (the etcd backend keeps one key per secret and per run).
std::string secret_record_to_json(const SealedSecret& s);
std::string run_record_to_json(const RunRecord& r);
Result<SealedSecret> secret_record_from_json(std::string_view text);
Result<RunRecord> run_record_from_json(std::string_view text);

/// File backend: the whole state in `<dir>/state.json`, rewritten on every apply with
/// write-temp, fsync, rename, fsync-dir, so a kill -9 at any moment leaves either the old or
/// the new state. Writes are serialized by a mutex; a read takes the current snapshot (a
/// shared_ptr copy under a short lock of its own) and never waits for a write.
class FileStateStore final : public StateStore {
public:
    static Result<std::unique_ptr<FileStateStore>> open(const std::string& dir);
    std::shared_ptr<const StateSnapshot> snapshot() const override;
    Result<uint64_t> apply(const std::vector<Mutation>& mutations) override;
    void on_change(std::function<void(std::shared_ptr<const StateSnapshot>)> cb) override;

private:
    std::string dir_;
    std::mutex write_mu_;
    Published<const StateSnapshot> current_;
    std::vector<std::function<void(std::shared_ptr<const StateSnapshot>)>> listeners_;
};

/// Scope resolution: among the sealed secrets named `name`, the most specific whose scope
/// contains `run_scope`, or nullptr. `chain`, if given, receives every candidate of that name
/// in decreasing specificity with whether it matched (for explain).
struct ScopeCandidate {
    Scope scope;
    uint64_t version = 0;
    bool matches = false;
};
const SealedSecret* resolve_secret(const StateSnapshot& s, const std::string& name,
                                   const Scope& run_scope,
                                   std::vector<ScopeCandidate>* chain = nullptr);

}  // namespace egress::credstore
