#include "proxy/resolver.h"

#include <ares.h>
#include <netdb.h>

#include <unordered_map>

#include "proxy/net.h"

namespace egress::proxy {

namespace {

using AddrList = std::vector<policy::IpAddress>;

/// One lookup, shared by the coroutine awaiting it and c-ares (which holds a reference until
/// its callback runs). The coroutine may stop waiting at the deadline while c-ares is still
/// retrying; the late callback then writes into this object, which nobody reads any more.
/// (ares_cancel is no way out: it fails every query on the worker's shared channel.)
struct Lookup {
    explicit Lookup(net::io_context& ioc) : done(ioc) {}
    net::steady_timer done;  // expires at the deadline; cancelled when the answer arrives
    bool answered = false;
    int status = ARES_ETIMEOUT;
    AddrList addrs;
};

}  // namespace

struct Resolver::Impl {
    struct Watch {
        std::unique_ptr<net::posix::stream_descriptor> sd;
        bool want_read = false, want_write = false;
        bool reading = false, writing = false;
        uint64_t gen = 0;
    };

    net::io_context& ioc;
    ares_channel channel = nullptr;
    std::unordered_map<int, Watch> watches;
    net::steady_timer timer;
    uint64_t next_gen = 1;
    std::map<std::string, AddrList> overrides;
    std::chrono::milliseconds timeout;  // the whole lookup's budget (limits.dns_timeout)
    bool init_ok = false;
    std::string init_error;

    Impl(net::io_context& io, std::map<std::string, AddrList> ov, std::chrono::milliseconds t)
        : ioc(io), timer(io), overrides(std::move(ov)), timeout(t) {}

    ~Impl() {
        if (channel != nullptr) {
            ares_destroy(channel);  // fails pending queries with ARES_EDESTRUCTION
        }
        for (auto& [fd, w] : watches) {
            error_code ec;
            w.sd->cancel(ec);
            w.sd->release();  // c-ares owns the fd
        }
    }

    static void sock_state_cb(void* data, ares_socket_t fd, int readable, int writable) {
        static_cast<Impl*>(data)->on_sock_state(fd, readable != 0, writable != 0);
    }

    void on_sock_state(int fd, bool r, bool w) {
        if (!r && !w) {
            auto it = watches.find(fd);
            if (it != watches.end()) {
                error_code ec;
                it->second.sd->cancel(ec);
                it->second.sd->release();
                watches.erase(it);
            }
            return;
        }
        auto& watch = watches[fd];
        if (!watch.sd) {
            watch.sd = std::make_unique<net::posix::stream_descriptor>(ioc, fd);
            watch.gen = next_gen++;
        }
        watch.want_read = r;
        watch.want_write = w;
        arm(fd);
    }

    void arm(int fd) {
        auto it = watches.find(fd);
        if (it == watches.end()) {
            return;
        }
        auto& w = it->second;
        if (w.want_read && !w.reading) {
            w.reading = true;
            w.sd->async_wait(net::posix::descriptor_base::wait_read,
                             [this, fd, gen = w.gen](error_code ec) { on_ready(fd, gen, ec, true); });
        }
        if (w.want_write && !w.writing) {
            w.writing = true;
            w.sd->async_wait(net::posix::descriptor_base::wait_write,
                             [this, fd, gen = w.gen](error_code ec) { on_ready(fd, gen, ec, false); });
        }
    }

    void on_ready(int fd, uint64_t gen, error_code ec, bool read) {
        auto it = watches.find(fd);
        if (it == watches.end() || it->second.gen != gen) {
            return;  // socket closed by c-ares meanwhile
        }
        (read ? it->second.reading : it->second.writing) = false;
        if (ec) {
            return;
        }
        ares_process_fd(channel, read ? fd : ARES_SOCKET_BAD, read ? ARES_SOCKET_BAD : fd);
        arm(fd);
        rearm_timer();
    }

    void rearm_timer() {
        timeval tv{};
        if (ares_timeout(channel, nullptr, &tv) == nullptr) {
            timer.cancel();
            return;
        }
        // +1us so a zero timeout never spins (nghttpx adds 1e-9 s for the same reason).
        auto d = std::chrono::seconds(tv.tv_sec) + std::chrono::microseconds(tv.tv_usec + 1);
        timer.expires_after(d);
        timer.async_wait([this](error_code ec) {
            if (ec) {
                return;
            }
            ares_process_fd(channel, ARES_SOCKET_BAD, ARES_SOCKET_BAD);
            rearm_timer();
        });
    }

    static void on_addrinfo(void* arg, int status, int /*timeouts*/, ares_addrinfo* res) {
        using Ref = std::shared_ptr<Lookup>;
        std::unique_ptr<Ref> lookup(static_cast<Ref*>(arg));
        AddrList out;
        if (status == ARES_SUCCESS && res != nullptr) {
            for (auto* n = res->nodes; n != nullptr; n = n->ai_next) {
                policy::IpAddress ip;
                if (n->ai_family == AF_INET) {
                    auto* sa = reinterpret_cast<sockaddr_in*>(n->ai_addr);
                    ip.family = policy::IpAddress::Family::V4;
                    std::memcpy(ip.bytes.data(), &sa->sin_addr, 4);
                } else if (n->ai_family == AF_INET6) {
                    auto* sa = reinterpret_cast<sockaddr_in6*>(n->ai_addr);
                    ip.family = policy::IpAddress::Family::V6;
                    std::memcpy(ip.bytes.data(), &sa->sin6_addr, 16);
                } else {
                    continue;
                }
                if (std::find(out.begin(), out.end(), ip) == out.end()) {
                    out.push_back(ip);
                }
            }
        }
        if (res != nullptr) {
            ares_freeaddrinfo(res);
        }
        Lookup& l = **lookup;
        l.answered = true;
        l.status = status;
        l.addrs = std::move(out);
        // Cancelling posts the waiter's resumption: never resumed inside a c-ares callback.
        l.done.cancel();
    }
};

void Resolver::cancel_all() {
    if (impl_->channel != nullptr) {
        ares_cancel(impl_->channel);  // each callback runs with ARES_ECANCELLED
    }
}

namespace {

size_t server_count(ares_channel channel) {
    ares_addr_node* list = nullptr;
    if (ares_get_servers(channel, &list) != ARES_SUCCESS) {
        return 1;
    }
    size_t n = 0;
    for (ares_addr_node* p = list; p != nullptr; p = p->next) {
        ++n;
    }
    ares_free_data(list);
    return std::max<size_t>(n, 1);
}

}  // namespace

int Resolver::try_timeout_ms(std::chrono::milliseconds budget, size_t servers) {
    // c-ares (1.18, Debian 12's) asks each server in turn for `tries` rounds and doubles the
    // per-try timeout each round, so two rounds over N servers last 3·N·t, and a lookup only
    // ends when its last query does: with t = budget / 2, the AAAA query of a name whose
    // AAAA a firewall drops outlived the budget, and its A answer (there at once) was lost;
    // a dead first server cost half the budget per lookup. One t of the budget is left over.
    const auto n = static_cast<int64_t>(std::max<size_t>(servers, 1));
    return static_cast<int>(std::max<int64_t>(budget.count() / (3 * n + 1), 1));
}

Resolver::Resolver(net::io_context& ioc, std::vector<std::string> servers,
                   std::map<std::string, AddrList> overrides, std::chrono::milliseconds timeout)
    : impl_(std::make_unique<Impl>(ioc, std::move(overrides), timeout)) {
    static const int lib_init = ares_library_init(ARES_LIB_INIT_ALL);
    (void)lib_init;
    size_t nservers = servers.size();
    if (nservers == 0) {  // resolv.conf's: counted on a channel made for that
        ares_channel probe = nullptr;
        if (ares_init(&probe) == ARES_SUCCESS) {
            nservers = server_count(probe);
            ares_destroy(probe);
        }
    }
    ares_options opts{};
    opts.sock_state_cb = &Impl::sock_state_cb;
    opts.sock_state_cb_data = impl_.get();
    opts.timeout = try_timeout_ms(timeout, nservers);
    opts.tries = 2;
    // No search domains: the name the policy allowed is the name looked up. resolv.conf's
    // `search` (or LOCALDOMAIN) with `ndots:5`, as Kubernetes pods have, would first ask for
    // api.github.com.<namespace>.svc.cluster.local, which whoever answers for those zones
    // could point anywhere; an allowed name that does not exist would fall back to one
    // under a search zone too. (A trailing dot would do the same, but c-ares would then not
    // match /etc/hosts entries, which a pod's hostAliases are.)
    opts.domains = nullptr;
    opts.ndomains = 0;
    int mask = ARES_OPT_SOCK_STATE_CB | ARES_OPT_TIMEOUTMS | ARES_OPT_TRIES | ARES_OPT_DOMAINS;
    int rc = ares_init_options(&impl_->channel, &opts, mask);
    if (rc != ARES_SUCCESS) {
        impl_->init_error = ares_strerror(rc);
        impl_->channel = nullptr;
        return;
    }
    if (!servers.empty()) {
        std::string csv;
        for (const auto& s : servers) {
            csv += (csv.empty() ? "" : ",") + s;
        }
        rc = ares_set_servers_ports_csv(impl_->channel, csv.c_str());
        if (rc != ARES_SUCCESS) {
            impl_->init_error = std::string("bad resolver.servers: ") + ares_strerror(rc);
            return;
        }
    }
    impl_->init_ok = true;
}

Resolver::~Resolver() = default;

net::awaitable<Result<AddrList>> Resolver::resolve(std::string host) {
    if (auto ip = policy::IpAddress::parse(host)) {
        co_return AddrList{*ip};
    }
    if (auto it = impl_->overrides.find(host); it != impl_->overrides.end()) {
        co_return it->second;
    }
    if (!impl_->init_ok) {
        co_return make_error("dns_failure: resolver unavailable: " + impl_->init_error);
    }
    // c-ares' schedule is sized to end inside the budget (try_timeout_ms); the deadline is
    // ours all the same.
    auto lookup = std::make_shared<Lookup>(impl_->ioc);
    lookup->done.expires_after(impl_->timeout);
    ares_addrinfo_hints hints{};
    hints.ai_family = AF_UNSPEC;
    hints.ai_socktype = SOCK_STREAM;
    ares_getaddrinfo(impl_->channel, host.c_str(), nullptr, &hints, &Impl::on_addrinfo,
                     new std::shared_ptr<Lookup>(lookup));
    impl_->rearm_timer();
    if (!lookup->answered) {  // c-ares may answer at once (hosts file, a bad name)
        co_await lookup->done.async_wait(use_nothrow);
    }
    if (!lookup->answered) {
        co_return make_error("dns_failure: no answer within " +
                             std::to_string(impl_->timeout.count()) + "ms");
    }
    if (lookup->status != ARES_SUCCESS) {
        co_return make_error(std::string("dns_failure: ") + ares_strerror(lookup->status));
    }
    AddrList& addrs = lookup->addrs;
    if (addrs.empty()) {
        co_return make_error("dns_failure: no addresses");
    }
    co_return addrs;
}

}  // namespace egress::proxy
