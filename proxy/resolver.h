#pragma once
// Asynchronous DNS with c-ares on an io_context (STYLE.md §3 "c-ares on an event loop").
// One Resolver per io_context thread: no locks, every callback runs on that thread.
#include <chrono>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include <boost/asio/awaitable.hpp>
#include <boost/asio/io_context.hpp>

#include "common/result.h"
#include "policy/address.h"

namespace egress::proxy {

class Resolver {
public:
    /// `servers`: "ip[:port]" list overriding /etc/resolv.conf (test-only DNS servers).
    /// `overrides`: normalized host → addresses, consulted before DNS (like curl --resolve).
    /// `timeout`: the budget of one whole lookup (limits.dns_timeout), whatever c-ares' retries.
    Resolver(boost::asio::io_context& ioc, std::vector<std::string> servers,
             std::map<std::string, std::vector<policy::IpAddress>> overrides,
             std::chrono::milliseconds timeout);
    ~Resolver();
    Resolver(const Resolver&) = delete;
    Resolver& operator=(const Resolver&) = delete;

    /// Every address of `host` (A and AAAA), or an error ("dns_failure: ...", also when no
    /// answer came within the timeout). IP literals resolve to themselves without a query.
    /// Must be awaited on this resolver's io_context.
    boost::asio::awaitable<Result<std::vector<policy::IpAddress>>> resolve(std::string host);

    /// Fails every lookup in flight at once ("dns_failure: ... cancelled"): the drain's cut.
    void cancel_all();

    /// c-ares' per-try timeout for `servers` servers and 2 tries, so that every server's
    /// tries end inside `budget`: budget / (3·servers + 1), at least 1 ms.
    static int try_timeout_ms(std::chrono::milliseconds budget, size_t servers);

private:
    struct Impl;
    std::unique_ptr<Impl> impl_;
};

}  // namespace egress::proxy
