// Link stubs for the socket-bound parts of proxy/ that proxy/http1.cc and proxy/h2_server.cc
// reference but the fuzz targets never reach: the worker's resolver and upstream pool
// (server.cc, resolver.cc, upstream.cc pull in c-ares and every dial path) and the audit of
// refusals (exchange.cc). Each target defines serve_exchange itself.
#include "proxy/exchange.h"

namespace egress::proxy {

struct Resolver::Impl {};
Resolver::~Resolver() = default;

UpstreamPool::~UpstreamPool() = default;
void UpstreamPool::release(std::unique_ptr<TlsConn>) {}

Worker::Worker(Shared& s) : metrics(s.metrics.add_shard()), shared(s) {}
Worker::~Worker() = default;

void audit_refusal(Scope&, const std::string&, const std::string&, int status,
                   const std::string& reason, std::chrono::steady_clock::time_point, uint64_t,
                   const std::string*) {
    // Every refusal is a 4xx/5xx with a reason, or status 0 where no answer can be written:
    // a request reset in the read that brought it (client_aborted), a header block or a
    // ClientHello that never completed (header_timeout).
    const bool unanswerable = status == 0 && (reason == "client_aborted" || reason == "header_timeout");
    if (!unanswerable && (status < 400 || status > 599 || reason.empty())) {
        std::abort();
    }
}

}  // namespace egress::proxy
