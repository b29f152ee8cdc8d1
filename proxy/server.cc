#include "proxy/server.h"

#include <thread>

#include <filesystem>

#include "proxy/control_plane.h"
#include "proxy/cpus.h"
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

Worker::~Worker() {
    flush_audit();  // the io_context may have stopped before a posted flush ran
    pool.reset();
    resolver.reset();
}

void Worker::audit(const AuditRecord& rec) {
    append_audit_json(audit_pending, rec);
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

namespace {

tcp::endpoint endpoint_of(const ListenAddress& a) {
    return {net::ip::make_address(a.host), a.port};
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

}  // namespace

struct Server::Impl {
    Shared shared;
    std::string config_path;
    std::unique_ptr<ControlPlane> control;
    net::io_context admin_ioc{1};  // admin API: blocking store writes stay off the data path
    std::vector<std::unique_ptr<Worker>> workers;
    std::unique_ptr<tcp::acceptor> proxy_acceptor;
    std::unique_ptr<tcp::acceptor> transparent_acceptor;
    std::unique_ptr<tcp::acceptor> admin_acceptor;
    std::unique_ptr<net::local::stream_protocol::acceptor> admin_unix_acceptor;
    size_t next_worker = 0;

    /// Rebuilds the data path's runtime after a control-plane change and closes the open
    /// connections of runs that are gone (revoked, expired, deleted).
    void publish_runtime() {
        auto next = control->build_runtime();
        if (!next) {
            spdlog::error("runtime rebuild failed: {}", next.error());
            return;
        }
        auto prev = shared.publish(*next);
        for (auto& w : workers) {  // an idle worker lets go of the runs this one replaced now
            net::post(w->ioc, [w = w.get()] { w->runtime(); });
        }
        for (const auto& [id, run] : prev->runs) {
            if ((*next)->runs.count(id) == 0) {
                size_t n = shared.connections.close_run(id);
                spdlog::info("run {} revoked or expired: closing {} connections", id, n);
            }
        }
        shared.metrics.runs_active.store(static_cast<int64_t>((*next)->runs.size()));
    }

    /// SIGHUP: re-read the config; apply it atomically or refuse it and keep the old one.
    void reload() {
        auto cfg = load_config_file(config_path);
        if (!cfg) {
            spdlog::error("reload refused, keeping the running configuration: {}", cfg.error());
            return;
        }
        auto current = shared.runtime.load();
        const Config& old = *current->config;
        auto listen_text = [](const std::optional<ListenAddress>& a) {
            return a ? a->to_string() : std::string();
        };
        if (cfg->proxy.to_string() != old.proxy.to_string() ||
            listen_text(cfg->transparent) != listen_text(old.transparent) ||
            cfg->admin.to_string() != old.admin.to_string() ||
            cfg->upstream_ca_file != old.upstream_ca_file ||
            cfg->state_path != old.state_path || cfg->master_key_file != old.master_key_file ||
            cfg->resolver_overrides != old.resolver_overrides ||
            cfg->limits.max_upstream_idle_per_host != old.limits.max_upstream_idle_per_host ||
            cfg->limits.upstream_tls_sessions != old.limits.upstream_tls_sessions ||
            cfg->limits.worker_threads != old.limits.worker_threads) {
            spdlog::warn("reload: listen.*, upstream.ca_file, state.*, keys.*, "
                         "resolver.overrides, limits.max_upstream_idle_per_host, "
                         "limits.upstream_tls_sessions and limits.worker_threads changes take "
                         "effect after a restart");
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
        spdlog::set_level(spdlog::level::from_str(config->log_level));
        control->set_statics(*statics);
        publish_runtime();
        spdlog::info("reloaded {}", config_path);
    }

    awaitable<void> reload_loop() {
        net::signal_set hup(admin_ioc, SIGHUP);
        for (;;) {
            auto [ec, sig] = co_await hup.async_wait(use_nothrow);
            if (ec) {
                co_return;
            }
            reload();
        }
    }

    awaitable<void> sweep_loop() {
        net::steady_timer t(admin_ioc);
        for (;;) {
            t.expires_after(std::chrono::seconds(1));
            auto [ec] = co_await t.async_wait(use_nothrow);
            if (ec) {
                co_return;
            }
            if (size_t n = control->sweep_expired(); n > 0) {
                spdlog::info("swept {} expired runs", n);
            }
        }
    }

    awaitable<void> admin_unix_loop() {
        for (;;) {
            auto [ec, sock] = co_await admin_unix_acceptor->async_accept(use_nothrow);
            if (ec == net::error::operation_aborted || !admin_unix_acceptor->is_open()) {
                co_return;
            }
            if (!ec) {
                net::co_spawn(admin_ioc, serve_admin_client(std::move(sock), shared),
                              log_spawn_error);
            }
        }
    }

    Worker& pick_worker() {
        auto& w = *workers[next_worker];
        next_worker = (next_worker + 1) % workers.size();
        return w;
    }

    awaitable<void> admin_tcp_loop() {
        for (;;) {
            // Accepted on the acceptor's own executor (admin_ioc): no socket conversion.
            auto [ec, sock] = co_await admin_acceptor->async_accept(use_nothrow);
            if (ec == net::error::operation_aborted || !admin_acceptor->is_open()) {
                co_return;
            }
            if (!ec) {
                net::co_spawn(admin_ioc, serve_admin_client(std::move(sock), shared),
                              log_spawn_error);
            }
        }
    }

    using Serve = awaitable<void> (*)(tcp::socket, Worker&);

    awaitable<void> accept_loop(tcp::acceptor& acceptor, Serve serve) {
        for (;;) {
            Worker& w = pick_worker();
            auto [ec, sock] = co_await acceptor.async_accept(w.ioc, use_nothrow);
            if (ec == net::error::operation_aborted || !acceptor.is_open()) {
                co_return;
            }
            if (ec) {
                spdlog::warn("accept: {}", ec.message());
                continue;  // e.g. EMFILE: keep serving the connections we have
            }
            net::co_spawn(w.ioc, serve(std::move(sock), w), log_spawn_error);
        }
    }
};

Server::Server(std::shared_ptr<const Runtime> runtime, std::string config_path)
    : impl_(std::make_unique<Impl>()) {
    impl_->config_path = std::move(config_path);
    auto& s = impl_->shared;
    s.publish(runtime);
    const auto& cfg = *runtime->config;
    auto audit = AuditLog::open(cfg.audit.path, cfg.audit.durable);
    if (!audit) {
        throw std::runtime_error(audit.error());
    }
    s.audit = std::move(*audit);
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
        std::error_code fec;
        std::filesystem::remove(cfg.admin.unix_path, fec);
        impl_->admin_unix_acceptor = std::make_unique<net::local::stream_protocol::acceptor>(
            impl_->admin_ioc, net::local::stream_protocol::endpoint(cfg.admin.unix_path));
        ::chmod(cfg.admin.unix_path.c_str(), 0600);
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
    if (!control) {
        throw std::runtime_error(control.error());
    }
    impl_->control = std::move(*control);
    auto pep = impl_->proxy_acceptor->local_endpoint();
    std::string host = pep.address().is_unspecified() ? "127.0.0.1" : pep.address().to_string();
    if (pep.address().is_v6()) {
        host = "[" + host + "]";
    }
    impl_->control->set_proxy_authority(host + ":" + std::to_string(pep.port()));
    s.control = impl_->control.get();
    impl_->publish_runtime();
    impl_->control->on_change([impl = impl_.get()] { impl->publish_runtime(); });
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
    net::co_spawn(ioc0, impl_->accept_loop(*impl_->proxy_acceptor, serve_proxy_client),
                  log_spawn_error);
    if (impl_->transparent_acceptor) {
        net::co_spawn(ioc0,
                      impl_->accept_loop(*impl_->transparent_acceptor, serve_transparent_client),
                      log_spawn_error);
    }
    if (impl_->admin_acceptor) {
        net::co_spawn(impl_->admin_ioc, impl_->admin_tcp_loop(), log_spawn_error);
    } else {
        net::co_spawn(impl_->admin_ioc, impl_->admin_unix_loop(), log_spawn_error);
    }
    net::co_spawn(impl_->admin_ioc, impl_->sweep_loop(), log_spawn_error);
    net::co_spawn(impl_->admin_ioc, impl_->reload_loop(), log_spawn_error);

    net::signal_set signals(ioc0, SIGINT, SIGTERM);
    signals.async_wait([this, &s, rt](error_code ec, int sig) {
        if (ec) {
            return;
        }
        spdlog::info("signal {}: draining (up to {} ms)", sig, rt->config->limits.drain_timeout.count());
        s.draining.store(true);
        error_code ignored;
        impl_->proxy_acceptor->close(ignored);
        if (impl_->transparent_acceptor) {
            impl_->transparent_acceptor->close(ignored);
        }
        // Wait for in-flight requests and tunnels, bounded by drain_timeout.
        net::co_spawn(
            impl_->workers[0]->ioc,
            [this, rt]() -> awaitable<void> {
                auto deadline = std::chrono::steady_clock::now() + rt->config->limits.drain_timeout;
                net::steady_timer t(co_await net::this_coro::executor);
                auto inflight = [this] {
                    int64_t n = 0;
                    for (const auto& w : impl_->workers) {
                        n += w->inflight.load(std::memory_order_relaxed);
                    }
                    return n;
                };
                while (inflight() > 0 && std::chrono::steady_clock::now() < deadline) {
                    t.expires_after(std::chrono::milliseconds(20));
                    co_await t.async_wait(use_nothrow);
                }
                if (const int64_t n = inflight(); n > 0) {
                    spdlog::warn("drain timeout: closing {} in-flight requests", n);
                }
                for (auto& w : impl_->workers) {
                    w->ioc.stop();
                }
                impl_->admin_ioc.stop();
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
