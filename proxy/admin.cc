// Admin listener: /healthz, /readyz, /metrics, and the /v1 control-plane API (bearer token).
// Runs on its own io_context thread; the /v1 calls run on the control thread (Shared::
// control_executor), so a store write (fsync, a stalled etcd) stalls neither the proxy nor the
// probes.
#include <sys/stat.h>

#include <array>
#include <optional>

#include "common/secure_zero.h"
#include "proxy/control_plane.h"
#include "proxy/worker.h"

namespace egress::proxy {

namespace {

/// Seconds since the state store last knew it held all of the shared state (etcd), or null
/// (the file backend, or no store).
std::optional<double> state_sync_age(Shared& shared) {
    if (shared.control == nullptr) {
        return std::nullopt;
    }
    const auto age = shared.control->store().sync_age();
    if (!age) {
        return std::nullopt;
    }
    return std::chrono::duration<double>(*age).count();
}

bool host_is_loopback_name(std::string_view host_header, uint16_t port) {
    // Host pinning on loopback (DNS-rebinding defence): a loopback name or address, and when
    // a port is given it must be ours.
    std::string_view h = host_header;
    std::string_view p;
    if (!h.empty() && h.front() == '[') {
        auto end = h.find(']');
        if (end == std::string_view::npos) {
            return false;
        }
        p = h.substr(end + 1);
        h = h.substr(1, end - 1);
    } else if (auto colon = h.rfind(':'); colon != std::string_view::npos) {
        p = h.substr(colon);
        h = h.substr(0, colon);
    }
    if (!p.empty() && p != ":" + std::to_string(port)) {
        return false;
    }
    if (h == "localhost") {
        return true;
    }
    // A literal loopback address only: "127.0.0.1.attacker.example" is a name that an
    // attacker's DNS can rebind to 127.0.0.1, so a "127." prefix is not enough.
    error_code ec;
    auto addr = net::ip::make_address(std::string(h), ec);
    return !ec && addr.is_loopback();
}

// A request may carry a secret value (POST/PUT /v1/secrets): the raw bytes read, the body and
// every copy either makes while growing are zeroed when freed.
using WipingBuffer = beast::basic_flat_buffer<egress::WipingAllocator<char>>;
using WipingBody =
    http::basic_string_body<char, std::char_traits<char>, egress::WipingAllocator<char>>;

constexpr const char* kForbiddenHost =
    R"({"error":"forbidden_host","detail":"Host must be a loopback name with this port"})";
constexpr const char* kUnauthorized =
    R"({"error":"unauthorized","detail":"missing or wrong bearer token"})";

struct ReadErrorReply {
    http::status status;
    std::string body;
};

/// The answer to a request that could not be read; nothing when there is nobody to answer (the
/// peer closed, the connection failed or timed out).
std::optional<ReadErrorReply> read_error_reply(const error_code& ec, const AdminLimits& limits) {
    if (ec == http::error::body_limit) {
        return ReadErrorReply{http::status::payload_too_large,
                              R"({"error":"too_large","detail":"request body over )" +
                                  std::to_string(limits.max_body_bytes) +
                                  " bytes (admin.max_body_bytes)\"}"};
    }
    if (ec == http::error::header_limit) {
        return ReadErrorReply{http::status::request_header_fields_too_large,
                              R"({"error":"too_large","detail":"request head over )" +
                                  std::to_string(limits.max_header_bytes) +
                                  " bytes (admin.max_header_bytes)\"}"};
    }
    if (ec.category() == http::make_error_code(http::error::bad_method).category() &&
        ec != http::error::end_of_stream && ec != http::error::partial_message) {
        return ReadErrorReply{http::status::bad_request,
                              R"({"error":"bad_request","detail":"malformed HTTP request: )" +
                                  ec.message() + R"("})"};
    }
    return std::nullopt;
}

template <class Socket>
bool is_loopback_tcp(Socket&, uint16_t&) {
    return false;  // unix sockets: no Host pinning needed (filesystem permissions apply)
}

template <>
bool is_loopback_tcp<tcp::socket>(tcp::socket& s, uint16_t& port) {
    error_code ec;
    auto local = s.local_endpoint(ec);
    port = local.port();
    if (ec) {
        return false;
    }
    // A dual-stack listener (listen.admin [::]:P) sees an IPv4 connection to 127.0.0.1 as
    // ::ffff:127.0.0.1, which is_loopback() does not count: unmap it first, or such a
    // connection would skip Host pinning.
    return unmapped(local.address()).is_loopback();
}

}  // namespace

uint64_t ConnectionRegistry::add(const std::string& run, size_t limit, net::any_io_executor ex,
                                 std::weak_ptr<RegisteredConn> fd_token) {
    std::lock_guard lock(mu_);
    auto& entries = by_run_[run];
    if (entries.size() >= limit) {
        if (entries.empty()) {
            by_run_.erase(run);
        }
        return 0;
    }
    uint64_t id = next_id_++;
    uint64_t inode = 0;
    if (auto fd = fd_token.lock()) {
        struct stat st{};
        if (::fstat(fd->fd, &st) == 0) {
            inode = static_cast<uint64_t>(st.st_ino);
        }
    }
    entries[id] = Entry{std::move(ex), std::move(fd_token), inode};
    return id;
}

void ConnectionRegistry::remove(const std::string& run, uint64_t id) {
    std::lock_guard lock(mu_);
    auto it = by_run_.find(run);
    if (it != by_run_.end()) {
        it->second.erase(id);
        if (it->second.empty()) {
            by_run_.erase(it);
        }
    }
}

size_t ConnectionRegistry::close_run(const std::string& run, std::chrono::milliseconds wait,
                                     const char* why) {
    struct Pending {
        std::mutex mu;
        std::condition_variable cv;
        size_t left = 0;
    };
    auto pending = std::make_shared<Pending>();
    size_t n = 0;
    {
        std::lock_guard lock(mu_);
        auto it = by_run_.find(run);
        if (it == by_run_.end()) {
            return 0;
        }
        n = it->second.size();
        pending->left = n;
        for (auto& [id, e] : it->second) {
            net::post(e.ex, [tok = e.fd_token, inode = e.inode, pending, why] {
                auto conn = tok.lock();
                struct stat st{};
                if (conn && inode != 0 && ::fstat(conn->fd, &st) == 0 &&
                    static_cast<uint64_t>(st.st_ino) == inode) {
                    if (why != nullptr) {
                        conn->cut = why;
                    }
                    ::shutdown(conn->fd, SHUT_RDWR);
                }
                std::lock_guard done(pending->mu);
                if (--pending->left == 0) {
                    pending->cv.notify_all();
                }
            });
        }
    }
    if (wait.count() > 0) {
        std::unique_lock lock(pending->mu);
        pending->cv.wait_for(lock, wait, [&] { return pending->left == 0; });
    }
    return n;
}

/// Answers a request that could not be read (JSON {"error","detail"}), then closes. The client
/// may still be sending (a body over the limit): closing with unread bytes would reset the
/// connection, and the client might lose the answer, so what arrives for a moment is dropped.
template <class Stream>
awaitable<void> answer_and_close(Stream& stream, ReadErrorReply reply, const AdminLimits& limits) {
    http::response<http::string_body> res{reply.status, 11};
    res.set(http::field::server, "egressd");
    res.set(http::field::content_type, "application/json");
    if (reply.status == http::status::unauthorized) {
        res.set(http::field::www_authenticate, "Bearer realm=\"egressd-admin\"");
    }
    res.body() = std::move(reply.body);
    res.keep_alive(false);
    res.prepare_payload();
    stream.expires_after(limits.write_timeout);
    auto [wec, wn] = co_await http::async_write(stream, res, use_nothrow);
    if (wec) {
        co_return;
    }
    stream.expires_never();
    // A short grace, not a limit: the answer is already written; this only keeps a reset from
    // overtaking it while a client still sends (at most four bodies' worth is dropped).
    co_await linger_close(stream.socket(), std::chrono::seconds(1), 4 * limits.max_body_bytes);
}

void AdminConnections::admit(Slot& s, size_t limit) {
    while (open_.size() >= limit) {
        auto victim = std::find_if(open_.begin(), open_.end(),
                                   [](const Slot* o) { return !o->protected_; });
        if (victim == open_.end()) {
            break;  // only after a reload lowered the limit under the calls in progress
        }
        Slot* v = *victim;
        open_.erase(victim);
        v->linked_ = false;
        v->shut_(v->socket_);  // its pending read or write ends; the connection closes
        if (closed_++ % 1000 == 0) {
            spdlog::warn("admin.max_connections ({}) reached: closing the least recently active "
                         "connection not inside an API call ({} so far)",
                         limit, closed_);
        }
    }
    s.at_ = open_.insert(open_.end(), &s);
    s.linked_ = true;
}

AdminConnections::Slot::Protect AdminConnections::Slot::protect(size_t limit) {
    if (!linked_) {
        return Protect::Closed;
    }
    if (owner_.protected_ + 1 >= limit) {
        return Protect::Full;
    }
    protected_ = true;
    ++owner_.protected_;
    return Protect::Done;
}

void AdminConnections::unprotect(Slot& s) {
    if (s.protected_) {
        s.protected_ = false;
        --protected_;
    }
}

void AdminConnections::leave(Slot& s) {
    unprotect(s);
    if (s.linked_) {
        open_.erase(s.at_);
        s.linked_ = false;
    }
}

void AdminConnections::touch(Slot& s) {
    unprotect(s);
    if (s.linked_) {
        open_.splice(open_.end(), open_, s.at_);
    }
}

template <class Socket>
awaitable<void> serve_admin_client(Socket socket, Shared& shared) {
    using Stream = beast::basic_stream<typename Socket::protocol_type>;
    Stream stream(std::move(socket));
    uint16_t port = 0;
    const bool loopback = is_loopback_tcp(stream.socket(), port);
    // The admin.* bounds as configured now (a reload applies to the next request).
    const auto current_limits = [&shared] {
        AdminLimits limits;
        if (auto rt = shared.runtime.load()) {
            limits = rt->config->admin_limits;
        }
        return limits;
    };
    AdminLimits limits = current_limits();
    AdminConnections::Slot slot(shared.admin_connections, stream.socket(),
                                limits.max_connections);
    WipingBuffer buf;
    for (;;) {
        limits = current_limits();
        // Fields too: the Authorization field holds the admin token.
        http::request_parser<WipingBody, egress::WipingAllocator<char>> parser;
        parser.body_limit(limits.max_body_bytes);
        parser.header_limit(static_cast<uint32_t>(limits.max_header_bytes));
        // The whole request, and the wait for it on a keep-alive connection. The head first:
        // an API call without the token is answered before its body is read (a client that
        // cannot authenticate had every connection hold up to admin.max_body_bytes).
        stream.expires_after(limits.read_timeout);
        auto [ec, n] = co_await http::async_read_header(stream, buf, parser, use_nothrow);
        if (!ec && parser.get().target().substr(0, 4) == "/v1/" && shared.control != nullptr) {
            // A named reply: GCC 12 destroys a temporary in a co_await's operand twice.
            std::optional<ReadErrorReply> early;
            if (loopback && !host_is_loopback_name(parser.get()[http::field::host], port)) {
                early = ReadErrorReply{http::status::forbidden, kForbiddenHost};
            } else if (!shared.control->authorized(parser.get()[http::field::authorization])) {
                early = ReadErrorReply{http::status::unauthorized, kUnauthorized};
            }
            if (early) {
                buf.shrink_to_fit();
                co_await answer_and_close(stream, std::move(*early), limits);
                co_return;
            }
            // Authorized: not closed to make room until answered (unless it was already, with
            // this head read: then it is not acted on).
            const auto inside = slot.protect(limits.max_connections);
            if (inside == AdminConnections::Slot::Protect::Closed) {
                co_return;
            }
            if (inside == AdminConnections::Slot::Protect::Full) {
                buf.shrink_to_fit();
                ReadErrorReply full{
                    http::status::service_unavailable,
                    "{\"error\":\"too_many_connections\",\"detail\":\"admin.max_connections (" +
                        std::to_string(limits.max_connections) +
                        "): that many API calls less one are in progress (one connection stays "
                        "free for probes)\"}"};
                co_await answer_and_close(stream, std::move(full), limits);
                co_return;
            }
        }
        if (!ec && !parser.is_done()) {
            auto [bec, bn] = co_await http::async_read(stream, buf, parser, use_nothrow);
            ec = bec;
        }
        // What was read stays in the buffer's block after it is consumed: shrink_to_fit moves
        // what is left (a pipelined request) to a new block and frees the old one, zeroed.
        buf.shrink_to_fit();
        if (ec) {
            if (auto reply = read_error_reply(ec, limits)) {
                co_await answer_and_close(stream, std::move(*reply), limits);
            }
            co_return;
        }
        auto req = parser.release();
        http::response<http::string_body> res{http::status::ok, req.version()};
        res.set(http::field::server, "egressd");
        res.set(http::field::content_type, "application/json");
        std::string_view target = req.target();
        bool secret_body = false;  // zeroed once written (ApiResponse::secret)
        const bool probe = target == "/healthz" || target == "/readyz" || target == "/metrics";
        // Probes and scrapers GET; a body answered to HEAD would break its framing.
        const bool get = req.method() == http::verb::get;
        if (loopback && !host_is_loopback_name(req[http::field::host], port)) {
            res.result(http::status::forbidden);
            res.body() = kForbiddenHost;
        } else if (probe && !get) {
            res.result(http::status::method_not_allowed);
            res.set(http::field::allow, "GET");
            res.body() = R"({"error":"method_not_allowed","detail":"allowed: GET"})";
        } else if (target == "/healthz") {
            res.set(http::field::content_type, "text/plain");
            res.body() = "ok\n";
        } else if (target == "/readyz") {
            res.set(http::field::content_type, "text/plain");
            // state.etcd.max_staleness: a replica cut off from etcd serves what it last saw
            // (revocations made since included); past the bound it asks not to be routed to.
            const auto& limit = shared.max_staleness;
            const auto age = limit ? state_sync_age(shared) : std::nullopt;
            if (shared.draining.load()) {
                res.result(http::status::service_unavailable);
                res.body() = "draining\n";
            } else if (age && *age * 1000 > static_cast<double>(limit->count())) {
                res.result(http::status::service_unavailable);
                res.body() = "state stale: not in step with etcd for " +
                             std::to_string(static_cast<int64_t>(*age)) +
                             " s (state.etcd.max_staleness " +
                             std::to_string(limit->count()) + " ms)\n";
            } else {
                res.body() = "ready\n";
            }
        } else if (target == "/metrics") {
            res.set(http::field::content_type, "text/plain; version=0.0.4");
            res.body() = shared.metrics.render(state_sync_age(shared));
        } else if (target.substr(0, 4) == "/v1/" && shared.control != nullptr) {
            // On the control thread (the call may wait on the store up to state.etcd.timeout;
            // the probes on this thread go on answering); this coroutine resumes here after.
            auto r = co_await net::co_spawn(
                shared.control_executor,
                [&]() -> awaitable<std::optional<ApiResponse>> {
                    if (!shared.control->authorized(req[http::field::authorization])) {
                        co_return std::nullopt;
                    }
                    co_return shared.control->handle(req.method_string(), target, req.body());
                },
                net::use_awaitable);
            if (!r) {
                res.result(http::status::unauthorized);
                res.set(http::field::www_authenticate, "Bearer realm=\"egressd-admin\"");
                res.body() = kUnauthorized;
            } else {
                res.result(static_cast<http::status>(r->status));
                res.body() = std::move(r->body);
                secret_body = r->secret;
                if (!r->allow.empty()) {
                    res.set(http::field::allow, r->allow);
                }
            }
            // The request body may hold a secret value: wipe it.
            egress::secure_zero(req.body().data(), req.body().size());
        } else {
            res.result(http::status::not_found);
            res.body() = R"({"error":"not_found","detail":"no such route"})";
        }
        res.keep_alive(req.keep_alive());
        res.prepare_payload();
        stream.expires_after(limits.write_timeout);
        auto [wec, wn] = co_await http::async_write(stream, res, use_nothrow);
        if (secret_body) {
            egress::secure_zero(res.body().data(), res.body().size());
        }
        if (wec || !req.keep_alive()) {
            co_return;
        }
        slot.done();
    }
}

template awaitable<void> serve_admin_client<tcp::socket>(tcp::socket, Shared&);
template awaitable<void> serve_admin_client<net::local::stream_protocol::socket>(
    net::local::stream_protocol::socket, Shared&);

}  // namespace egress::proxy
