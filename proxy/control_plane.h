#pragma once
// The control plane: admin API routes over the state store, and the data path's view of
// dynamic runs. No Asio here: routes are plain functions of (method, target, body), so they
// are unit-testable without sockets; proxy/admin.cc carries them over HTTP.
#include <atomic>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>

#include "common/result.h"
#include "credstore/envelope.h"
#include "credstore/state_store.h"
#include "proxy/config.h"
#include "proxy/runtime.h"

namespace egress::proxy {

/// KEKs by id: the primary wraps new data keys; older ones still unwrap during rotation.
class KeyRing {
public:
    void add(std::unique_ptr<credstore::KeyProvider> p, bool primary);
    credstore::KeyProvider& primary() { return *primary_; }
    credstore::KeyProvider* find(const std::string& key_id);
    void set_primary(const std::string& key_id);
    /// Drops every key but `key_id` (made primary): a finished rotation's old KEK, whose
    /// page is wiped and unmapped (FileKeyProvider), so nothing in memory unwraps with it.
    void retire_all_but(const std::string& key_id);

private:
    std::map<std::string, std::unique_ptr<credstore::KeyProvider>> providers_;
    credstore::KeyProvider* primary_ = nullptr;
};

struct ApiResponse {
    int status = 200;
    std::string body;  // JSON
    std::string allow;  // 405: the route's methods, for the Allow header (RFC 9110 15.5.6)
    /// The body holds a credential (a new run's proxy token): built without a copy left
    /// behind, and zeroed by the admin listener once written.
    bool secret = false;
};

class ControlPlane {
public:
    /// Opens (creating on first start) the admin token, the KEK and the state store named by
    /// the config. `statics` is the runtime built from the config's static runs.
    static Result<std::unique_ptr<ControlPlane>> open(std::shared_ptr<const Runtime> statics);

    /// Constant-time check of "Bearer <token>" against admin.token_file.
    bool authorized(std::string_view authorization_header) const;
    /// The admin token from now on (a reload re-read admin.token_file): the old one stops
    /// working at once, and its bytes are wiped when the last check using it ends.
    void set_admin_token(credstore::SecretPtr token);

    /// Routes one /v1 request. Never returns a secret value or a proxy token (except the
    /// new run's proxy_url, once, in POST /v1/runs).
    ApiResponse handle(std::string_view method, std::string_view target, std::string_view body);

    /// The data path's runtime for the current state: static runs plus every live dynamic
    /// run (pins resolved by scope and unsealed). Unchanged runs keep their Run objects.
    /// Static runs' store pins (`secret: NAME`) are resolved here by the run's scope; one
    /// that cannot be (no such secret yet) is off, with a line in `warnings` when it changed.
    Result<std::shared_ptr<const Runtime>> build_runtime(BuildWarnings* warnings = nullptr);

    /// Replaces the static part (a config reload). Its config is also the one the control
    /// plane reads from then on: the reload left its restart-only keys (keys.*, state.*...)
    /// at the values the process started with (Server::reload, keep_restart_keys), which the
    /// KEK and the store opened at start use.
    void set_statics(std::shared_ptr<const Runtime> statics);

    /// Deletes expired runs from the store, in transactions of at most state.etcd.max_txn_ops
    /// runs on etcd. Returns how many were swept, or why a write failed (those before it
    /// stay swept; the rest are tried again at the next sweep).
    Result<size_t> sweep_expired();

    /// Where the proxy listens, for proxy_url ("127.0.0.1:3128").
    void set_proxy_authority(std::string authority) { proxy_authority_ = std::move(authority); }

    /// Subscribes to store changes (after apply): used to rebuild and publish the runtime.
    void on_change(std::function<void()> cb);
    /// No on_change callback runs after this returns (the etcd store's watch thread is
    /// joined); store writes fail afterwards. Called first at shutdown.
    void stop_store();
    /// The revision of the state the last build_runtime() read.
    uint64_t built_revision() const { return built_revision_.load(); }

    credstore::StateStore& store() { return *store_; }

private:
    ControlPlane() = default;
    ApiResponse create_secret(std::string_view body);
    ApiResponse rotate_secret(const std::string& name, std::string_view body);
    ApiResponse list_secrets();
    /// Seals `value` (then wipes it), stores it, answers with its metadata.
    ApiResponse store_secret(const std::string& name, const credstore::Scope& scope,
                             uint64_t version, std::string& value, int status);
    ApiResponse delete_secret(const std::string& name, std::string_view query);
    ApiResponse create_run(std::string_view body);
    ApiResponse show_run(const std::string& id);
    ApiResponse add_pin(const std::string& id, std::string_view body);
    ApiResponse revoke_run(const std::string& id);
    /// A run of the config (statics_), or null.
    std::shared_ptr<Run> static_run(const std::string& id);
    /// 409 for a change the API cannot make to a static run.
    ApiResponse static_run_refusal(const std::string& id) const;
    ApiResponse explain(const std::string& id, std::string_view query);
    ApiResponse rotate_keys();
    std::shared_ptr<const Config> current_config();
    Result<credstore::SecretPtr> unseal_cached(const credstore::SealedSecret& s);
    /// The record MAC key of run `r` (credstore/run_mac.h), if r's MAC verifies under it;
    /// else an error saying why (never key bytes). Cached per run and CA-key sealing; a miss
    /// unwraps the CA key's DEK (a KMS call with keys.kms_command). Caller holds mu_ or
    /// build_mu_ (keys_).
    Result<credstore::SecretPtr> verified_run_mac_key(const credstore::RunRecord& r,
                                                      credstore::SecretPtr* ca_key = nullptr);
    /// Replaces each static run of `rt` that has store pins by its served copy (the one of the
    /// build before when neither the static run nor its secrets changed). Holds build_mu_.
    void resolve_static_store_pins(const credstore::StateSnapshot& snap, Runtime& rt,
                                   BuildWarnings* warnings);

    std::shared_ptr<const Runtime> statics_;
    std::shared_ptr<const Config> config_;
    std::unique_ptr<credstore::StateStore> store_;
    KeyRing keys_;
    mutable std::mutex token_mu_;      // admin_token_: checked by the admin API, set by a reload
    credstore::SecretPtr admin_token_;  // locked memory, wiped (credstore::SecretValue)
    std::string proxy_authority_;
    std::mutex mu_;        // serializes mutations (admin requests)
    std::mutex build_mu_;  // guards keys_' changes and the caches below (build_runtime runs
                           // inside apply, and unseals with keys_)
    // digest of a whole sealed record (every field) → its value; only values a built run
    // uses (build_runtime evicts)
    std::map<std::string, credstore::SecretPtr> unsealed_;
    struct RunMacKey {
        std::string sealing;  // the CA key's nonce and ciphertext: what the DEK sealed
        credstore::SecretPtr key;
    };
    std::mutex mac_mu_;                                // guards run_mac_keys_
    std::map<std::string, RunMacKey> run_mac_keys_;    // run id → its record MAC key
    std::map<std::string, std::shared_ptr<Run>> built_;    // run id → last built Run
    struct StaticBuild {
        std::shared_ptr<Run> statics;  // the static run (config) it was made from
        std::string fingerprint;       // its store secrets' keys, versions, KEKs, sealings
        std::shared_ptr<Run> served;   // with those secrets
    };
    std::map<std::string, StaticBuild> static_built_;  // static run id → its served copy
    std::map<std::string, std::string> fingerprints_;      // run id → what it was built from
    /// What is remembered of a run that left the store: its token's SHA-256 and its source
    /// ranges (Runtime::ended).
    struct RunTrace {
        std::string token_sha256;
        std::vector<std::string> sources;
        int64_t expires_at = 0;
        int64_t created_at = 0;
    };
    std::map<std::string, RunTrace> swept_;                // swept run id → its trace
    std::deque<std::string> swept_order_;                  // bounds swept_ (oldest first)
    /// Run id → its trace at the last build: a run that leaves the store after its expiry,
    /// swept by another replica (state.backend etcd), is remembered as swept here too, so its
    /// token gets 403 run_expired on every replica, not 407.
    std::map<std::string, RunTrace> last_built_runs_;
    std::atomic<uint64_t> built_revision_{0};
    void remember_swept(const std::string& id, RunTrace trace);  // build_mu_ held
};

}  // namespace egress::proxy
