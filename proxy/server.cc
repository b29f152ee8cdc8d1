#include "proxy/server.h"

#include "common/burn_stack.h"

#include <sys/stat.h>

#include <cerrno>
#include <cstring>

#include <algorithm>
#include <filesystem>
#include <thread>

#include "proxy/control_plane.h"
#include "proxy/cpus.h"
#include "proxy/etcd_store.h"
#include "proxy/exchange.h"
#include "proxy/upstream.h"
#include "proxy/worker.h"
#include "tls/contexts.h"

namespace egress::proxy {

Worker::Worker(Shared& s) : metrics(s.metrics.add_shard()), shared(s) {
    const auto& rt = runtime();
    const auto& cfg = *rt->config;
    resolver = std::make_unique<Resolver>(ioc, cfg.resolver_servers, cfg.resolver_overrides,
                                          cfg.limits.dns_timeout);
    pool = std::make_unique<UpstreamPool>(cfg.limits.max_upstream_idle_per_host);
    if (cfg.limits.upstream_tls_sessions > 0) {
        tls_sessions = std::make_unique<tls::ClientSessionCache>(cfg.limits.upstream_tls_sessions);
    }
}

UnidentifiedGuard::UnidentifiedGuard(Worker& w, tcp::socket& s) : w_(&w), socket_(&s) {
    const size_t limit = w.runtime()->config->limits.max_unidentified_connections;
    const size_t share = std::max<size_t>(1, (limit + w.shared.worker_count - 1) /
                                                 w.shared.worker_count);
    while (w.unidentified_count >= share && w.unidentified_oldest != nullptr) {
        UnidentifiedGuard* oldest = w.unidentified_oldest;
        oldest->identified();
        // Its read ends with the close; the connection then ends as a client that left.
        error_code ignored;
        oldest->socket_->shutdown(tcp::socket::shutdown_both, ignored);
        if (w.unidentified_evicted++ % 1000 == 0) {
            spdlog::warn("limits.max_unidentified_connections ({}) reached: closing the oldest "
                         "connection that has not sent a request head ({} so far)",
                         limit, w.unidentified_evicted);
        }
    }
    prev_ = w.unidentified_newest;
    if (prev_ != nullptr) {
        prev_->next_ = this;
    } else {
        w.unidentified_oldest = this;
    }
    w.unidentified_newest = this;
    ++w.unidentified_count;
    linked_ = true;
}

void UnidentifiedGuard::identified() {
    if (!linked_) {
        return;
    }
    (prev_ != nullptr ? prev_->next_ : w_->unidentified_oldest) = next_;
    (next_ != nullptr ? next_->prev_ : w_->unidentified_newest) = prev_;
    prev_ = next_ = nullptr;
    linked_ = false;
    --w_->unidentified_count;
}

Worker::~Worker() {
    flush_audit();  // the io_context may have stopped before a posted flush ran
    pool.reset();
    resolver.reset();
}

void Worker::audit(const AuditRecord& rec) {
    if (shared.drain_cut.load(std::memory_order_relaxed) && rec.decision == "allow") {
        // Its connection was shut down at the drain deadline (Server::run): say so, whatever
        // error path (client_aborted, a tunnel's end) the request or tunnel ended through.
        AuditRecord cut = rec;
        cut.reason = "drain_timeout";
        append_audit_json(audit_pending, cut);
    } else {
        append_audit_json(audit_pending, rec);
    }
    audit_pending.push_back('\n');
    if (audit_pending.size() >= kAuditFlushBytes) {
        flush_audit();  // a long busy stretch: do not let the buffer grow
    }
}

void Worker::run() {
    // ioc.run(), with a hook where the loop runs out of ready work (nginx and HAProxy flush
    // their logs at the end of a loop iteration the same way). A loop that never runs dry
    // still flushes every kIdleEvery handlers.
    while (!ioc.stopped()) {
        size_t n = 0;
        while (ioc.poll_one() > 0) {
            if (++n == kIdleEvery) {
                flush_audit();
                n = 0;
            }
        }
        flush_audit();
        if (ioc.stopped()) {
            break;
        }
        ioc.run_one();  // blocks until something is ready
    }
}

void Worker::flush_audit() {
    if (!audit_pending.empty()) {
        shared.audit->append(audit_pending);
        audit_pending.clear();
    }
}

size_t ConnectionRegistry::close_all() {
    std::vector<std::string> runs;
    {
        std::lock_guard lock(mu_);
        for (const auto& [run, conns] : by_run_) {
            runs.push_back(run);
        }
    }
    size_t n = 0;
    for (const auto& run : runs) {
        n += close_run(run);
    }
    return n;
}

namespace {

/// After the drain deadline shut the connections down: how long their coroutines get to end
/// through their error paths and write their audit records before the loops stop.
constexpr auto kDrainCutGrace = std::chrono::seconds(1);
/// At the end of the drain: how long HTTP/2 client connections get to write their GOAWAY and
/// close before the loops stop (an idle one does at once; Impl::wait_h2_closed).
constexpr auto kH2GoawayWait = std::chrono::milliseconds(500);

tcp::endpoint endpoint_of(const ListenAddress& a) {
    return {net::ip::make_address(a.host), a.port};
}

/// After an accept failed for want of descriptors or memory (EMFILE, ENFILE, ENOBUFS,
/// ENOMEM): how long that listener waits before it accepts again. The connection stays in the
/// listen queue, so an accept at once fails at once: the loop spun a core and wrote a warning
/// per turn (1.6 M lines in 4 s). nginx waits 500 ms (its accept_mutex_delay) the same way.
constexpr auto kAcceptPause = std::chrono::milliseconds(100);
/// At most one accept line per listener this often; the failures in between are counted and
/// said with the next line.
constexpr auto kAcceptLogEvery = std::chrono::seconds(1);

bool out_of_resources(const error_code& ec) {
    if (ec.category() != boost::system::system_category()) {
        return false;
    }
    switch (ec.value()) {
    case EMFILE:
    case ENFILE:
    case ENOBUFS:
    case ENOMEM:
        return true;
    default:
        return false;
    }
}

/// One listener's accept failures (every accept loop has one: proxy, transparent, admin).
/// At most two lines per kAcceptLogEvery: a failure, and the recovery after it.
class AcceptFailures {
public:
    explicit AcceptFailures(const char* listener) : listener_(listener) {}

    /// After a failed accept: logs it (at most one line per kAcceptLogEvery, with the count of
    /// failures not logged before it) and, when it failed for want of descriptors or memory,
    /// waits kAcceptPause (a timer: the loop's thread keeps serving the connections it has).
    awaitable<void> failed(const error_code& ec) {
        const bool exhausted = out_of_resources(ec);
        failing_ = true;
        const auto now = std::chrono::steady_clock::now();
        if (now >= next_line_) {
            // (Strings built here, not with fmt::format: the fmt headers' buffer type seen
            // from this file and from libfmt trips UBSan's vptr check.)
            spdlog::warn("accept on {}: {}{}{}", listener_, ec.message(),
                         exhausted ? " (trying again every " +
                                         std::to_string(kAcceptPause.count()) +
                                         " ms while it lasts)"
                                   : std::string(),
                         unlogged_note());
            unlogged_ = 0;
            next_line_ = now + kAcceptLogEvery;
            said_ = true;
        } else {
            ++unlogged_;
        }
        if (exhausted) {
            net::steady_timer t(co_await net::this_coro::executor, kAcceptPause);
            co_await t.async_wait(use_nothrow);
        }
    }

    /// After an accept that succeeded: the first after failures says that accepts work again
    /// (with the failures no line said), if a line said they failed; failures whose line was
    /// held back are said with the next failure line.
    void succeeded() {
        if (!failing_) {
            return;
        }
        failing_ = false;
        if (said_) {
            spdlog::info("accept on {}: accepting again{}", listener_, unlogged_note());
            unlogged_ = 0;
            said_ = false;
        }
    }

private:
    std::string unlogged_note() const {
        return unlogged_ == 0
                   ? std::string()
                   : "; " + std::to_string(unlogged_) + " more failures were not logged";
    }

    const char* listener_;
    std::chrono::steady_clock::time_point next_line_{};
    uint64_t unlogged_ = 0;  // failures since the last line that no line said
    bool failing_ = false;   // the last accept failed
    bool said_ = false;      // a failure line was written since the last "accepting again"
};

/// listen.admin: unix:PATH: what is at PATH may be removed before the bind only when it is a
/// socket (one an earlier run left): with `unix:var/master.key` the master key was removed and
/// every stored secret lost. Empty when the path is free or holds a socket; else the error.
std::string admin_socket_path_error(const std::string& path) {
    struct stat st {};
    if (::lstat(path.c_str(), &st) != 0) {
        if (errno == ENOENT) {
            return {};
        }
        return "listen.admin: " + path + ": " + std::strerror(errno);
    }
    if (S_ISSOCK(st.st_mode)) {
        return {};
    }
    const char* what = S_ISREG(st.st_mode)   ? "a regular file"
                       : S_ISDIR(st.st_mode) ? "a folder"
                       : S_ISLNK(st.st_mode) ? "a symbolic link"
                                             : "not a socket";
    return "listen.admin: " + path + " exists and is " + what +
           ", not a socket; egressd removes only a socket an earlier run left there: name "
           "another path";
}

void log_spawn_error(std::exception_ptr e) {
    if (!e) {
        return;
    }
    try {
        std::rethrow_exception(e);
    } catch (const std::exception& ex) {
        spdlog::error("connection task failed: {}", ex.what());
    }
}

/// The keys fixed when the process starts (listeners, the store and its keys, the per-worker
/// resolver and pools, the audit mode...): a reload applies every other key. Each one whose
/// value in `next` (a config file just read) differs from `in_effect` (what the process
/// started with) is named in the result, joined by ", ", and set back to its value in
/// `in_effect`, so that what is built from the reloaded config (the control plane's key
/// rotation and sweep, new runs' leaf caches, ca_bundle_out's roots) uses the values in effect,
/// never ones that only a restart applies: a `keys rotate` after a reload that changed
/// keys.master_key_file wrote the new KEK to the file's new path and rewrapped the state under
/// it, and a restart with the original config then unsealed nothing.
std::string keep_restart_keys(Config& next, const Config& in_effect) {
    std::string out;
    auto keep_if = [&](bool differs, auto& value, const auto& effect, const char* key) {
        if (differs) {
            out += (out.empty() ? "" : ", ") + std::string(key);
            value = effect;
        }
    };
    auto keep = [&](auto& value, const auto& effect, const char* key) {
        keep_if(!(value == effect), value, effect, key);
    };
    auto listen_text = [](const std::optional<ListenAddress>& a) {
        return a ? a->to_string() : std::string();
    };
    keep_if(next.proxy.to_string() != in_effect.proxy.to_string(), next.proxy, in_effect.proxy,
            "listen.proxy");
    keep_if(listen_text(next.transparent) != listen_text(in_effect.transparent),
            next.transparent, in_effect.transparent, "listen.transparent");
    keep_if(next.admin.to_string() != in_effect.admin.to_string(), next.admin, in_effect.admin,
            "listen.admin");
    keep(next.upstream_ca_file, in_effect.upstream_ca_file, "upstream.ca_file");
    keep(next.state_backend, in_effect.state_backend, "state.backend");
    keep(next.state_path, in_effect.state_path, "state.path");
    keep(next.etcd, in_effect.etcd, "state.etcd");
    keep(next.master_key_file, in_effect.master_key_file, "keys.master_key_file");
    keep(next.kms_command, in_effect.kms_command, "keys.kms_command");
    keep(next.resolver_servers, in_effect.resolver_servers, "resolver.servers");
    keep(next.resolver_overrides, in_effect.resolver_overrides, "resolver.overrides");
    keep(next.audit.durable, in_effect.audit.durable, "audit.durable");
    keep(next.log_format, in_effect.log_format, "log.format");
    Limits& nl = next.limits;
    const Limits& el = in_effect.limits;
    keep(nl.dns_timeout, el.dns_timeout, "limits.dns_timeout");
    keep(nl.max_upstream_idle_per_host, el.max_upstream_idle_per_host,
         "limits.max_upstream_idle_per_host");
    keep(nl.upstream_tls_sessions, el.upstream_tls_sessions, "limits.upstream_tls_sessions");
    keep(nl.worker_threads, el.worker_threads, "limits.worker_threads");
    // Runs that keep their CA keep their leaf cache (sandboxes keep trusting their leaves).
    keep(nl.leaf_cache_size, el.leaf_cache_size, "limits.leaf_cache_size");
    keep(nl.leaf_mints_per_minute, el.leaf_mints_per_minute, "limits.leaf_mints_per_minute");
    return out;
}

}  // namespace

std::string start_file_errors(const Config& config) {
    std::string errors;
    auto add = [&](const std::string& e) { errors += (errors.empty() ? "" : "\n") + e; };
    if (auto ctx = tls::make_client_context(config.upstream_ca_file, {"http/1.1"}); !ctx) {
        add("upstream.ca_file: " + ctx.error());
    }
    if (config.state_backend == "etcd") {
        if (auto etcd = etcd_tls_context(config.etcd); !etcd) {
            add(etcd.error());
        }
    }
    if (config.admin.is_unix()) {
        if (auto why = admin_socket_path_error(config.admin.unix_path); !why.empty()) {
            add(why);
        }
    }
    for (const auto& rc : config.runs) {
        for (const auto& [key, path] : {std::pair<const char*, const std::string*>{
                                            "ca_cert_out", &rc.ca_cert_out},
                                        {"ca_bundle_out", &rc.ca_bundle_out}}) {
            if (path->empty()) {
                continue;
            }
            if (auto why = unfit_ca_target(*path); !why.empty()) {
                add(rc.yaml_path + "." + key + ": " + why);
            }
        }
    }
    return errors;
}

struct Server::Impl {
    Shared shared;
    std::string config_path;
    /// The config the process started with: its keep_restart_keys() values stay in effect
    /// across reloads (every later runtime's config carries them).
    std::shared_ptr<const Config> started;
    std::unique_ptr<ControlPlane> control;
    // The admin listener (HTTP, probes, /metrics) runs on admin_ioc; everything that may block
    // on the store (API calls, the sweep, SIGHUP reloads) on control_ioc, so neither the data
    // path nor the probes wait for an etcd that stalls (up to state.etcd.timeout per call):
    // a kubelet whose liveness probe timed out would restart a healthy sidecar.
    net::io_context admin_ioc{1};
    net::io_context control_ioc{1};
    std::vector<std::unique_ptr<Worker>> workers;
    std::unique_ptr<tcp::acceptor> proxy_acceptor;
    std::unique_ptr<tcp::acceptor> transparent_acceptor;
    std::unique_ptr<tcp::acceptor> admin_acceptor;
    std::unique_ptr<net::local::stream_protocol::acceptor> admin_unix_acceptor;
    size_t next_worker = 0;

    ~Impl() {
        // With state.backend etcd the store's own thread calls publish_runtime(), which
        // uses the workers: it is stopped before any member is destroyed.
        if (control) {
            control->stop_store();
        }
    }

    /// Serializes publish_runtime(): it runs on the control thread (API writes, reload, sweep)
    /// and, with state.backend etcd, on the store's watch thread. Building and publishing
    /// under one lock keeps an older build from being published after a newer one.
    std::mutex publish_mu;

    /// Rebuilds the data path's runtime after a control-plane change and closes the open
    /// connections of runs that are gone (revoked, expired, deleted).
    void publish_runtime() {
        std::lock_guard lock(publish_mu);
        BuildWarnings warnings;
        auto next = control->build_runtime(&warnings);
        // It unsealed secrets and CA keys (the control thread, or a replica's watch thread):
        // their bytes are left in the dead frames of its callees.
        egress::burn_stack();
        for (const auto& w : warnings.lines) {
            spdlog::warn("{}", w);
        }
        if (!next) {
            spdlog::error("runtime rebuild failed: {}", next.error());
            return;
        }
        auto prev = shared.publish(*next);
        for (auto& w : workers) {  // an idle worker lets go of the runs this one replaced now
            net::post(w->ioc, [w = w.get()] { w->runtime(); });
        }
        for (const auto& [id, run] : prev->runs) {
            auto now = (*next)->runs.find(id);
            if (now == (*next)->runs.end()) {
                // Waited for (at most 1 s): the revoke's answer means they are cut.
                size_t n = shared.connections.close_run(id, std::chrono::seconds(1),
                                                        run_end_reason(*run));
                spdlog::info("run {} revoked or expired: closing {} connections", id, n);
            } else if (!same_admission(*run, *now->second)) {
                // A connection admitted with the old token (or from a source no longer the
                // run's) must not go on under the new terms: its client authenticates again.
                size_t n = shared.connections.close_run(id, std::chrono::seconds(1),
                                                        "run_changed");
                spdlog::info("run {}: its token or sources changed: closing {} connections", id,
                             n);
            }
        }
        shared.metrics.runs_active.store(static_cast<int64_t>((*next)->runs.size()));
        shared.metrics.state_revision.store(control->built_revision());
    }

    /// The "host:port" a new run's proxy_url names (listen.advertise, else the listener's).
    std::string advertised_proxy(const Config& cfg) const {
        auto pep = proxy_acceptor->local_endpoint();
        return proxy_authority(cfg.advertise, pep.address().to_string(), pep.port());
    }

    /// SIGHUP: re-read the config; apply it atomically or refuse it and keep the old one.
    /// Also reopens the audit file (log rotation, or a new audit.path).
    void reload() {
        // Log rotation first, whether or not the reload applies: after a refused one (a config
        // in the middle of an edit, a secret file briefly missing) records went on to the
        // moved file, and were lost when logrotate removed it.
        const std::string audit_path = shared.runtime.load()->config->audit.path;
        if (auto a = shared.audit->reopen(audit_path); !a) {
            spdlog::error("reload: {}; audit records keep going to the file opened before",
                          a.error());
        }
        auto cfg = load_config_file(config_path);
        if (!cfg) {
            spdlog::error("reload refused, keeping the running configuration: {}", cfg.error());
            return;
        }
        // The admin token is re-read with the rest (an operator rotating a leaked token):
        // unreadable, the whole reload is refused and the old token keeps working.
        auto admin_token =
            credstore::load_owner_only_secret_file("admin.token_file", cfg->admin_token_file);
        if (!admin_token) {
            spdlog::error("reload refused, keeping the running configuration: {}",
                          admin_token.error());
            return;
        }
        if (auto files = start_file_errors(*cfg); !files.empty()) {
            spdlog::error("reload refused, keeping the running configuration: {}", files);
            return;
        }
        auto current = shared.runtime.load();
        // Compared with what the process started with, not with the last reload's config
        // (which holds those same values): named at every reload until the file is back to
        // them or egressd restarts.
        const std::string needs_restart = keep_restart_keys(*cfg, *started);
        // The file was checked as written; with the restart-only keys back at the values in
        // effect (keys.master_key_file …), a path it writes may now name one of those files.
        if (auto clashes = written_file_clashes(*cfg); !clashes.empty()) {
            std::string text;
            for (const auto& c : clashes) {
                text += (text.empty() ? "" : "; ") + c;
            }
            spdlog::error("reload refused, keeping the running configuration: {}", text);
            return;
        }
        auto config = std::make_shared<const Config>(std::move(*cfg));
        BuildWarnings warnings;
        auto statics = build_runtime(config, warnings, current.get());
        for (const auto& w : warnings.lines) {
            spdlog::warn("{}", w);
        }
        if (!statics) {
            spdlog::error("reload refused, keeping the running configuration: {}",
                          statics.error());
            return;
        }
        // A new audit.path must open, or the reload is refused: applied, records kept going
        // to the old file, and every later rotation (SIGHUP) reopened the unopenable path, so
        // records went on into the moved file and were lost with it.
        // Checked here without switching (nor creating it): a refused reload leaves records
        // going to the file in effect; switched to only once nothing else can refuse it.
        const bool audit_moved = config->audit.path != audit_path;
        if (audit_moved) {
            if (auto a = AuditLog::check(config->audit.path); !a) {
                spdlog::error("reload refused, keeping the running configuration: audit.path: {}",
                              a.error());
                return;
            }
        }
        // The CA files only now: a refused reload must leave them naming the serving CAs.
        BuildWarnings file_warnings;
        if (auto w = write_ca_files(**statics, current.get(), &file_warnings); !w) {
            spdlog::error("reload refused, keeping the running configuration: {}", w.error());
            return;
        }
        for (const auto& w : file_warnings.lines) {
            spdlog::warn("{}", w);
        }
        if (audit_moved) {
            if (auto a = shared.audit->reopen(config->audit.path); !a) {
                spdlog::error("reload: {}; audit records keep going to the file opened before",
                              a.error());
            }
        }
        spdlog::set_level(spdlog::level::from_str(config->log_level));
        control->set_statics(*statics);
        control->set_admin_token(std::move(*admin_token));
        control->set_proxy_authority(advertised_proxy(*config));  // listen.advertise
        publish_runtime();
        log_static_cas(**statics);
        if (!needs_restart.empty()) {
            spdlog::warn("reload: changed, but needs a restart to take effect (the values "
                         "egressd started with stay in effect until then): {}",
                         needs_restart);
        }
        spdlog::info("reloaded {}", config_path);
    }

    /// Says until when each process-lifetime run's CA is valid (at start and reload).
    static void log_static_cas(const Runtime& rt) {
        for (const auto& [id, run] : rt.runs) {
            if (!run->dynamic && !run->static_ttl && run->ca) {
                spdlog::info("run {} (ttl: null): run CA valid until {} "
                             "(limits.static_ca_validity)",
                             id, iso8601_utc(run->ca->not_after()));
            }
        }
    }

    /// Warns once when a process-lifetime run's CA nears its end, and once when it has
    /// ended (then every pinned host of the run fails with 502 leaf_mint_failed).
    void check_static_cas() {
        auto rt = shared.runtime.load();
        const auto now = std::chrono::system_clock::now();
        for (const auto& [id, run] : rt->runs) {
            if (run->dynamic || run->static_ttl || !run->ca) {
                continue;
            }
            const CaExpiry e = ca_expiry(run->ca->not_after(), run->ca_validity, now);
            CaExpiry& logged = ca_notices[run->ca.get()];
            if (e == logged) {
                continue;
            }
            logged = e;
            const std::string until = iso8601_utc(run->ca->not_after());
            if (e == CaExpiry::Soon) {
                spdlog::warn("run {}: its CA expires at {} (limits.static_ca_validity); restart "
                             "egressd, or raise the key and reload, before then",
                             id, until);
            } else if (e == CaExpiry::Expired) {
                spdlog::error("run {}: its CA expired at {}: intercepted hosts fail until a "
                              "restart, or a reload with a new limits.static_ca_validity",
                              id, until);
            }
        }
        // Forget CAs no runtime holds any more (keys are only compared, never followed).
        std::erase_if(ca_notices, [&](const auto& kv) {
            return std::none_of(rt->runs.begin(), rt->runs.end(),
                                [&](const auto& r) { return r.second->ca.get() == kv.first; });
        });
    }
    std::map<const tls::RunCa*, CaExpiry> ca_notices;  // the last state logged per CA

    /// Closes the open connections of each run whose expiry has passed (new requests already
    /// get 403 run_expired, but a blind tunnel or a keep-alive connection would go on): a
    /// static run with a ttl, and a dynamic run before the sweep has removed it from the store
    /// (publish_runtime() closes its connections again then, none left), so a store that
    /// cannot be written does not keep them open. Once per expiry: a reload that keeps a static
    /// run keeps its expires_at and closes nothing again; one that gives it a new ttl gives it
    /// a new expires_at, closed again when that passes. (A connection is registered before its
    /// run's expiry is checked, so none admitted before the expiry is missed.) Runs on the
    /// control thread (sweep_loop).
    void close_expired() {
        auto rt = shared.runtime.load();
        const auto now = policy::Clock::now();
        auto expiring = [](const Run& r) { return r.dynamic || r.static_ttl.has_value(); };
        for (const auto& [id, run] : rt->runs) {
            if (!expiring(*run) || run->policy.expires_at > now) {
                continue;
            }
            auto [it, fresh] = expiries_closed.try_emplace(id, run->policy.expires_at);
            if (!fresh) {
                if (it->second == run->policy.expires_at) {
                    continue;
                }
                it->second = run->policy.expires_at;
            }
            size_t n = shared.connections.close_run(id, std::chrono::seconds(1), "run_expired");
            spdlog::info("run {} expired: closing {} connections", id, n);
        }
        // Forget runs no longer served (swept, revoked, removed by a reload).
        std::erase_if(expiries_closed, [&](const auto& kv) {
            const auto* r = rt->lookup(kv.first);
            return r == nullptr || !expiring(**r);
        });
    }
    /// Run id → the expires_at whose passing closed its connections.
    std::map<std::string, policy::TimePoint> expiries_closed;

    /// `hup` is made by run() before any thread starts: made here, on the control thread's
    /// first turn, a SIGHUP sent as soon as /readyz answered (the admin thread may answer
    /// first) met the start's SIG_IGN and was lost.
    awaitable<void> reload_loop(net::signal_set& hup) {
        for (;;) {
            auto [ec, sig] = co_await hup.async_wait(use_nothrow);
            if (ec) {
                co_return;
            }
            // Whatever a reload throws ends that reload, not this loop: later SIGHUPs (the
            // audit file's reopen after logrotate) must still be heard.
            try {
                reload();
            } catch (const std::exception& e) {
                spdlog::error("reload refused, keeping the running configuration: {}", e.what());
            }
        }
    }

    awaitable<void> sweep_loop() {
        net::steady_timer t(control_ioc);
        // A failing store write (etcd without quorum, a full disk) blocks this thread, which
        // also serves the API's calls, up to state.etcd.timeout: after a failure the sweep
        // waits 2, 4 ... 32 s before it tries again (expired runs' connections are closed
        // meanwhile all the same, and their requests refused).
        int failures = 0;
        auto next_sweep = std::chrono::steady_clock::now();
        for (;;) {
            t.expires_after(std::chrono::seconds(1));
            auto [ec] = co_await t.async_wait(use_nothrow);
            if (ec) {
                co_return;
            }
            if (const auto now = std::chrono::steady_clock::now(); now >= next_sweep) {
                auto swept = control->sweep_expired();
                if (!swept) {
                    ++failures;
                    const auto wait = std::chrono::seconds(1 << std::min(failures, 5));
                    next_sweep = now + wait;
                    spdlog::warn("sweeping expired runs failed (next try in {} s): {}",
                                 wait.count(), swept.error());
                } else {
                    if (failures > 0) {
                        spdlog::info("sweeping expired runs works again");
                    }
                    failures = 0;
                    if (*swept > 0) {
                        spdlog::info("swept {} expired runs", *swept);
                    }
                }
            }
            close_expired();
            check_static_cas();
        }
    }

    /// The admin listener's accept loop, TCP or unix socket: connections are accepted on the
    /// acceptor's own executor (admin_ioc), so no socket conversion.
    template <class Acceptor>
    awaitable<void> admin_loop(Acceptor& acceptor) {
        AcceptFailures failures("listen.admin");
        for (;;) {
            auto [ec, sock] = co_await acceptor.async_accept(use_nothrow);
            if (ec == net::error::operation_aborted || !acceptor.is_open()) {
                co_return;
            }
            if (ec) {
                co_await failures.failed(ec);
                continue;
            }
            failures.succeeded();
            net::co_spawn(admin_ioc, serve_admin_client(std::move(sock), shared),
                          log_spawn_error);
        }
    }

    /// Requests and tunnels in flight on every worker.
    int64_t inflight() const { return total(&Worker::inflight); }

    /// Connections the drain ended still closing, on every worker.
    int64_t closing() const { return total(&Worker::closing); }

    /// One of the workers' counts, summed over them.
    int64_t total(std::atomic<int64_t> Worker::*count) const {
        int64_t n = 0;
        for (const auto& w : workers) {
            n += ((*w).*count).load(std::memory_order_relaxed);
        }
        return n;
    }

    /// Returns when nothing is in flight (with `closes`: and no close of the drain's is under
    /// way) or at `deadline`.
    awaitable<void> wait_inflight(std::chrono::steady_clock::time_point deadline,
                                  bool closes = false) {
        net::steady_timer t(co_await net::this_coro::executor);
        while ((inflight() > 0 || (closes && closing() > 0)) &&
               std::chrono::steady_clock::now() < deadline) {
            t.expires_after(std::chrono::milliseconds(20));
            co_await t.async_wait(use_nothrow);
        }
    }

    /// Returns once no worker has an HTTP/2 client connection left, or at `deadline`. SIGTERM
    /// cancelled their watchdogs: each sends its GOAWAY, and an idle one closes at once. With
    /// nothing in flight the drain ended before those posted cancels ran, and the loops
    /// stopped under the connections: no GOAWAY. (Each worker's set is read on its thread.)
    awaitable<void> wait_h2_closed(std::chrono::steady_clock::time_point deadline) {
        auto open = std::make_shared<std::atomic<size_t>>(workers.size());
        for (auto& w : workers) {
            net::co_spawn(
                w->ioc,
                [w = w.get(), open, deadline]() -> awaitable<void> {
                    net::steady_timer t(w->ioc);
                    while (!w->h2_watchdogs.empty() &&
                           std::chrono::steady_clock::now() < deadline) {
                        t.expires_after(std::chrono::milliseconds(5));
                        co_await t.async_wait(use_nothrow);
                    }
                    open->fetch_sub(1);
                },
                log_spawn_error);
        }
        net::steady_timer t(co_await net::this_coro::executor);
        while (open->load() > 0 && std::chrono::steady_clock::now() < deadline) {
            t.expires_after(std::chrono::milliseconds(5));
            co_await t.async_wait(use_nothrow);
        }
    }

    Worker& pick_worker() {
        auto& w = *workers[next_worker];
        next_worker = (next_worker + 1) % workers.size();
        return w;
    }

    using Serve = awaitable<void> (*)(tcp::socket, Worker&);

    /// `key`: the listener's config key, for the log.
    awaitable<void> accept_loop(tcp::acceptor& acceptor, Serve serve, const char* key) {
        AcceptFailures failures(key);
        for (;;) {
            Worker& w = pick_worker();
            auto [ec, sock] = co_await acceptor.async_accept(w.ioc, use_nothrow);
            if (ec == net::error::operation_aborted || !acceptor.is_open()) {
                co_return;
            }
            if (ec) {
                // E.g. EMFILE: keep serving the connections we have, and accept again later.
                co_await failures.failed(ec);
                continue;
            }
            failures.succeeded();
            net::co_spawn(w.ioc, serve(std::move(sock), w), log_spawn_error);
        }
    }
};

Server::Server(std::shared_ptr<const Runtime> runtime, std::string config_path)
    : impl_(std::make_unique<Impl>()) {
    impl_->config_path = std::move(config_path);
    impl_->started = runtime->config;
    auto& s = impl_->shared;
    s.publish(runtime);
    const auto& cfg = *runtime->config;
    auto audit = AuditLog::open(cfg.audit.path, cfg.audit.durable);
    if (!audit) {
        throw std::runtime_error(audit.error());
    }
    s.audit = std::move(*audit);
    s.metrics.audit_write_errors = &s.audit->write_errors();
    auto server_ctx = tls::make_server_context({"h2", "http/1.1"});
    if (!server_ctx) {
        throw std::runtime_error("server TLS context: " + server_ctx.error());
    }
    s.server_ctx = std::make_unique<ssl::context>(server_ctx->release());
    auto client_ctx = tls::make_client_context(cfg.upstream_ca_file, {"h2", "http/1.1"});
    if (!client_ctx) {
        throw std::runtime_error("upstream.ca_file: " + client_ctx.error());
    }
    s.client_ctx = std::make_unique<ssl::context>(client_ctx->release());
    s.metrics.runs_active.store(static_cast<int64_t>(runtime->runs.size()));

    const size_t configured = cfg.limits.worker_threads;
    const size_t n = configured != 0 ? configured : usable_cpus();
    s.worker_count = n;
    s.max_staleness = cfg.etcd.max_staleness;
    for (size_t i = 0; i < n; ++i) {
        impl_->workers.push_back(std::make_unique<Worker>(s));
    }
    auto& ioc0 = impl_->workers[0]->ioc;
    auto open = [&](const ListenAddress& a, const char* key) {
        auto acc = std::make_unique<tcp::acceptor>(ioc0);
        auto ep = endpoint_of(a);
        acc->open(ep.protocol());
        acc->set_option(tcp::acceptor::reuse_address(true));
        error_code ec;
        acc->bind(ep, ec);
        if (ec) {
            throw std::runtime_error(std::string(key) + ": cannot listen on " + a.to_string() +
                                     ": " + ec.message());
        }
        acc->listen(net::socket_base::max_listen_connections);
        return acc;
    };
    impl_->proxy_acceptor = open(cfg.proxy, "listen.proxy");
    s.own_listeners.push_back(impl_->proxy_acceptor->local_endpoint());
    if (cfg.transparent) {
        impl_->transparent_acceptor = open(*cfg.transparent, "listen.transparent");
        s.own_listeners.push_back(impl_->transparent_acceptor->local_endpoint());
    }
    if (cfg.admin.is_unix()) {
        if (auto why = admin_socket_path_error(cfg.admin.unix_path); !why.empty()) {
            throw std::runtime_error(why);
        }
        if (::unlink(cfg.admin.unix_path.c_str()) != 0 && errno != ENOENT) {
            throw std::runtime_error("listen.admin: cannot remove the old socket " +
                                     cfg.admin.unix_path + ": " + std::strerror(errno));
        }
        // Created 0600 (umask 077 while it is bound), not chmod'ed after: a socket that
        // listens from bind() on would take another user's connection in between. (The
        // umask is the process's: a file another thread creates meanwhile is only stricter.)
        struct Umask {
            mode_t old = ::umask(077);
            ~Umask() { ::umask(old); }
        };
        {
            Umask owner_only;
            impl_->admin_unix_acceptor = std::make_unique<net::local::stream_protocol::acceptor>(
                impl_->admin_ioc, net::local::stream_protocol::endpoint(cfg.admin.unix_path));
        }
        if (::chmod(cfg.admin.unix_path.c_str(), 0600) != 0) {
            throw std::runtime_error("listen.admin: cannot make " + cfg.admin.unix_path +
                                     " owner-only: " + std::strerror(errno));
        }
    } else {
        auto acc = std::make_unique<tcp::acceptor>(impl_->admin_ioc);
        auto ep = endpoint_of(cfg.admin);
        acc->open(ep.protocol());
        acc->set_option(tcp::acceptor::reuse_address(true));
        error_code ec;
        acc->bind(ep, ec);
        if (ec) {
            throw std::runtime_error("listen.admin: cannot listen on " + cfg.admin.to_string() +
                                     ": " + ec.message());
        }
        acc->listen(net::socket_base::max_listen_connections);
        impl_->admin_acceptor = std::move(acc);
        s.own_listeners.push_back(impl_->admin_acceptor->local_endpoint());
        if (!net::ip::make_address(cfg.admin.host).is_loopback()) {
            spdlog::warn("listen.admin {} is beyond loopback: the admin API is reachable from "
                         "the network; protect it with a firewall and keep the token secret",
                         cfg.admin.to_string());
        }
    }

    auto control = ControlPlane::open(runtime);
    // The master key, data keys and run CA keys went through the frames below this one.
    egress::burn_stack();
    if (!control) {
        throw std::runtime_error(control.error());
    }
    impl_->control = std::move(*control);
    Impl::log_static_cas(*runtime);
    impl_->control->set_proxy_authority(impl_->advertised_proxy(cfg));
    s.control = impl_->control.get();
    s.control_executor = impl_->control_ioc.get_executor();
    // Listener first: a change the etcd watch brings in between is then built either way.
    impl_->control->on_change([impl = impl_.get()] { impl->publish_runtime(); });
    impl_->publish_runtime();
}

Server::~Server() = default;

int Server::run() {
    auto& s = impl_->shared;
    auto& ioc0 = impl_->workers[0]->ioc;
    auto rt = s.runtime.load();
    spdlog::info("egressd listening: proxy {} admin {} ({} workers)",
                 impl_->proxy_acceptor->local_endpoint().port(),
                 impl_->admin_acceptor ? std::to_string(impl_->admin_acceptor->local_endpoint().port())
                                       : rt->config->admin.unix_path,
                 impl_->workers.size());
    if (impl_->transparent_acceptor) {
        spdlog::info("transparent listener on {}",
                     rt->config->transparent->host + ":" +
                         std::to_string(impl_->transparent_acceptor->local_endpoint().port()));
    }
    net::co_spawn(ioc0,
                  impl_->accept_loop(*impl_->proxy_acceptor, serve_proxy_client, "listen.proxy"),
                  log_spawn_error);
    if (impl_->transparent_acceptor) {
        net::co_spawn(ioc0,
                      impl_->accept_loop(*impl_->transparent_acceptor, serve_transparent_client,
                                         "listen.transparent"),
                      log_spawn_error);
    }
    if (impl_->admin_acceptor) {
        net::co_spawn(impl_->admin_ioc, impl_->admin_loop(*impl_->admin_acceptor), log_spawn_error);
    } else {
        net::co_spawn(impl_->admin_ioc, impl_->admin_loop(*impl_->admin_unix_acceptor), log_spawn_error);
    }
    net::co_spawn(impl_->control_ioc, impl_->sweep_loop(), log_spawn_error);
    net::signal_set hup(impl_->control_ioc, SIGHUP);  // before any thread: see reload_loop
    net::co_spawn(impl_->control_ioc, impl_->reload_loop(hup), log_spawn_error);

    net::signal_set signals(ioc0, SIGINT, SIGTERM);
    signals.async_wait([this, &s](error_code ec, int sig) {
        if (ec) {
            return;
        }
        // The current runtime: a SIGHUP may have changed drain_timeout since the start.
        const auto drain = s.runtime.load()->config->limits.drain_timeout;
        spdlog::info("signal {}: draining (up to {} ms)", sig, drain.count());
        const auto deadline = std::chrono::steady_clock::now() + drain;
        s.drain_deadline.store(deadline.time_since_epoch().count());
        s.draining.store(true);
        error_code ignored;
        impl_->proxy_acceptor->close(ignored);
        if (impl_->transparent_acceptor) {
            impl_->transparent_acceptor->close(ignored);
        }
        for (auto& w : impl_->workers) {  // HTTP/2 connections: GOAWAY now (h2_server.cc)
            net::post(w->ioc, [w = w.get()] {
                for (auto* t : w->h2_watchdogs) {
                    t->cancel();
                }
            });
        }
        // Wait for in-flight requests and tunnels, bounded by drain_timeout.
        net::co_spawn(
            impl_->workers[0]->ioc,
            [this, &s, deadline]() -> awaitable<void> {
                co_await impl_->wait_inflight(deadline);
                if (const int64_t n = impl_->inflight(); n > 0) {
                    // Shut the connections down so each request and tunnel ends through its
                    // error path and writes its audit record (reason drain_timeout); a loop
                    // stopped under them would destroy them without one.
                    spdlog::warn("drain timeout: closing {} in-flight requests and tunnels", n);
                    s.drain_cut.store(true);
                    s.connections.close_all();
                    // A request whose client is shut down does not notice while it waits on
                    // a silent upstream (its DNS answer, connect, TLS handshake or response
                    // head): those waits are cut too.
                    for (auto& w : impl_->workers) {
                        net::post(w->ioc, [w = w.get()] { w->cut_all(); });
                    }
                    co_await impl_->wait_inflight(std::chrono::steady_clock::now() +
                                                  kDrainCutGrace);
                    if (const int64_t left = impl_->inflight(); left > 0) {
                        spdlog::warn("drain: {} requests or tunnels still waiting on their "
                                     "upstream end without an audit record",
                                     left);
                    }
                }
                co_await impl_->wait_h2_closed(std::chrono::steady_clock::now() +
                                               kH2GoawayWait);
                // The connections the drain ended close lingering while their clients read
                // the rest (drain_close), within the drain's deadline. wait_h2_closed ran a
                // turn of every worker's loop: a close begun as its last request ended counts.
                co_await impl_->wait_inflight(deadline, true);
                for (auto& w : impl_->workers) {
                    w->ioc.stop();
                }
                impl_->admin_ioc.stop();
                impl_->control_ioc.stop();
            },
            log_spawn_error);
    });

    std::vector<std::thread> threads;
    std::vector<net::executor_work_guard<net::io_context::executor_type>> guards;
    for (auto& w : impl_->workers) {
        guards.emplace_back(w->ioc.get_executor());
    }
    for (size_t i = 1; i < impl_->workers.size(); ++i) {
        threads.emplace_back([w = impl_->workers[i].get()] { w->run(); });
    }
    guards.emplace_back(impl_->admin_ioc.get_executor());
    threads.emplace_back([this] { impl_->admin_ioc.run(); });
    guards.emplace_back(impl_->control_ioc.get_executor());
    threads.emplace_back([this] { impl_->control_ioc.run(); });
    impl_->workers[0]->run();
    for (auto& t : threads) {
        t.join();
    }
    for (auto& w : impl_->workers) {
        w->flush_audit();  // records of the last turn before stop()
    }
    spdlog::info("egressd stopped");
    return 0;
}

}  // namespace egress::proxy
