// Admin listener: /healthz, /readyz, /metrics. The /v1 control-plane API builds on this.
#include "proxy/worker.h"

namespace egress::proxy {

namespace {

bool host_is_loopback_name(std::string_view host_header) {
    // Host pinning on loopback (DNS-rebinding defence): only loopback names and addresses.
    std::string_view h = host_header;
    if (!h.empty() && h.front() == '[') {
        auto end = h.find(']');
        h = end == std::string_view::npos ? std::string_view{} : h.substr(1, end - 1);
    } else if (auto colon = h.rfind(':'); colon != std::string_view::npos) {
        h = h.substr(0, colon);
    }
    return h == "localhost" || h == "127.0.0.1" || h == "::1" ||
           (h.size() > 4 && h.substr(0, 4) == "127.");
}

}  // namespace

awaitable<void> serve_admin_client(tcp::socket socket, Worker& w) {
    TcpStream stream(std::move(socket));
    beast::flat_buffer buf;
    for (;;) {
        http::request<http::string_body> req;
        http::request_parser<http::string_body> parser;
        parser.body_limit(1 << 20);
        parser.header_limit(16 * 1024);
        stream.expires_after(std::chrono::seconds(30));
        auto [ec, n] = co_await http::async_read(stream, buf, parser, use_nothrow);
        if (ec) {
            co_return;
        }
        req = parser.release();
        http::response<http::string_body> res{http::status::ok, req.version()};
        res.set(http::field::server, "egressd");
        res.set(http::field::content_type, "text/plain; charset=utf-8");
        std::string_view target = req.target();
        auto local = stream.socket().local_endpoint(ec);
        bool loopback = !ec && local.address().is_loopback();
        if (loopback && !host_is_loopback_name(req[http::field::host])) {
            res.result(http::status::forbidden);
            res.body() = "{\"error\":\"forbidden_host\",\"detail\":\"Host must be a loopback name\"}\n";
            res.set(http::field::content_type, "application/json");
        } else if (target == "/healthz") {
            res.body() = "ok\n";
        } else if (target == "/readyz") {
            if (w.shared.draining.load()) {
                res.result(http::status::service_unavailable);
                res.body() = "draining\n";
            } else {
                res.body() = "ready\n";
            }
        } else if (target == "/metrics") {
            res.set(http::field::content_type, "text/plain; version=0.0.4");
            res.body() = w.shared.metrics.render();
        } else {
            res.result(http::status::not_found);
            res.set(http::field::content_type, "application/json");
            res.body() = "{\"error\":\"not_found\",\"detail\":\"no such route\"}\n";
        }
        res.keep_alive(req.keep_alive());
        res.prepare_payload();
        auto [wec, wn] = co_await http::async_write(stream, res, use_nothrow);
        if (wec || !req.keep_alive()) {
            co_return;
        }
    }
}

}  // namespace egress::proxy
