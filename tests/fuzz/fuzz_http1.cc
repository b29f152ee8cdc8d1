// Fuzz target: HTTP/1.1 request bytes from the sandbox, as the proxy port sees them.
//
// Boost.Beast's request parser (the same parser type, header limit and body limit as
// proxy/client.cc) reads every pipelined request in the input; each head then goes the way
// the server sends it:
//   * CONNECT host:port → policy::parse_authority, decide_destination; when the run would
//     intercept it, the rest of the input is the decrypted stream inside that tunnel and is
//     served like serve_intercepted_http1 (origin-form, tls = true, target = the CONNECT);
//   * anything else → the absolute-form checks of serve_proxy_client (http:// only, no
//     userinfo, parse_authority of the URI's authority, decide_destination), tls = false.
// Each head is converted by the real to_request_head() of proxy/http1.cc (included below:
// it lives in an anonymous namespace), runs through policy::RequestPipeline, and must meet
// the invariants in fuzz_common.h. A forwarded head is then serialized the way H1Upstream
// does and parsed back: the upstream must see exactly the fields we decided to send. The
// body is read with Beast too (chunked trailers through trailers_after()), and with a pin
// matched the Scrubber must keep the secret out of it.
#include "proxy/http1.cc"  // NOLINT(bugprone-suspicious-include)

#include <cstdint>

#include "fuzz_common.h"
#include "policy/header_rules.h"
#include "policy/scrubber.h"

namespace egress::proxy {

// Not reached: handle_request() is never called here.
awaitable<bool> serve_exchange(Downstream&, policy::RequestHead, Scope&,
                               std::chrono::steady_clock::time_point) {
    co_return false;
}

}  // namespace egress::proxy

namespace {

using namespace egress;
using namespace egress::proxy;
using egress::fuzz::fixture;

constexpr size_t kMaxHeaderBytes = 65536;  // Limits::max_header_bytes default
constexpr int kMaxRequests = 16;

using Parser = H1RequestParser;

/// Feeds bytes to the parser until the header is complete. False: incomplete or bad.
bool read_header(Parser& p, std::string_view& in) {
    while (!p.is_header_done()) {
        beast::error_code ec;
        size_t n = p.put(net::buffer(in.data(), in.size()), ec);
        in.remove_prefix(n);
        if (ec || n == 0) {
            return false;
        }
    }
    return true;
}

/// Reads the body in pieces into `body`, as h1_read_body does. False: incomplete or bad.
bool read_body(Parser& p, std::string_view& in, std::string& body) {
    char buf[1024];
    while (!p.is_done()) {
        if (auto left = p.direct_body_left()) {
            // Content-Length: the bytes themselves, never past the body's end.
            const size_t n = std::min({*left, uint64_t{sizeof buf}, uint64_t{in.size()}});
            if (n == 0) {
                return false;  // the input ends inside the body
            }
            body.append(in.data(), n);
            in.remove_prefix(n);
            p.direct_body_read(n);
            continue;
        }
        p.body_buffer(buf, sizeof buf);
        beast::error_code ec;
        size_t n = p.put(net::buffer(in.data(), in.size()), ec);
        in.remove_prefix(n);
        if (ec == http::error::need_buffer) {
            ec = {};
        }
        const size_t got = sizeof buf - p.body_room();
        body.append(buf, got);
        if (ec || (n == 0 && got == 0)) {
            return false;
        }
    }
    return true;
}

/// H1Upstream::send_head's serialization (request_head_bytes), parsed back by a fresh Beast
/// parser: one request, same method, target, and exactly the fields we meant to send, in order
/// (no splitting, no smuggling).
void check_serialization(const policy::RequestHead& head, const std::string& host_header,
                         std::optional<uint64_t> length, bool chunked) {
    std::vector<std::pair<std::string, std::string>> expect{{"host", host_header}};
    for (const auto& h : head.headers) {
        if (h.name == "content-length" || h.name == "transfer-encoding" || h.name == "te") {
            continue;
        }
        expect.emplace_back(h.name, h.value);
    }
    if (length) {
        expect.emplace_back("content-length", std::to_string(*length));
    } else if (chunked) {
        expect.emplace_back("transfer-encoding", "chunked");
    }
    if (!head.upgrade.empty()) {  // a WebSocket handshake: its upgrade, written again
        FUZZ_CHECK(head.upgrade == "websocket" && head.method == "GET" && (!length || *length == 0) &&
                       !chunked,
                   "an upgrade that is not a bodiless WebSocket GET");
        expect.emplace_back("connection", "Upgrade");
        expect.emplace_back("upgrade", head.upgrade);
    }
    const std::string wire = request_head_bytes(head, host_header, length, chunked);

    Parser back;  // keeps the wire order (Beast's basic_fields groups equal names)
    back.header_limit(1u << 20);
    back.body_limit(boost::none);  // only the head is compared; any Content-Length is fine
    beast::error_code ec;
    size_t n = back.put(net::buffer(wire), ec);
    FUZZ_CHECK(!ec && back.is_header_done(), "serialized head does not parse: " + ec.message());
    FUZZ_CHECK(n == wire.size(), "serialized head has bytes after its end (smuggling)");
    FUZZ_CHECK(back.method_string() == head.method, "method changed on the wire");
    FUZZ_CHECK(back.target() == head.path, "target changed on the wire");
    size_t i = 0;
    for (const auto& f : back.fields()) {
        FUZZ_CHECK(i < expect.size(), "serialized head gained a field: " + f.name);
        FUZZ_CHECK(policy::iequals(f.name, expect[i].first),
                   "field name changed on the wire: " + expect[i].first);
        FUZZ_CHECK(policy::trim_ows(f.value) == policy::trim_ows(expect[i].second),
                   "field value changed on the wire: " + expect[i].first);
        ++i;
    }
    FUZZ_CHECK(i == expect.size(), "serialized head lost a field");
}

/// A pinned response body goes through the Scrubber in pieces: same length, no secret left.
void check_scrubber(const policy::Decision& d, std::string_view body) {
    if (d.scrub == nullptr || body.empty()) {
        return;
    }
    policy::Scrubber sc(d.scrub);
    std::string out;
    size_t step = 1 + static_cast<uint8_t>(body.front()) % 13;
    for (size_t off = 0; off < body.size(); off += step) {
        sc.feed(body.substr(off, step), out);
    }
    sc.finish(out);
    FUZZ_CHECK(out.size() == body.size(), "scrubber changed the body length");
    for (const std::string_view needle : d.scrub->needles()) {
        FUZZ_CHECK(needle.empty() || out.find(needle) == std::string::npos,
                   "scrubber let a secret through");
    }
}

/// One parsed request: conversion, pipeline, invariants, serialization, body.
/// Returns whether the connection would continue with the next request.
bool serve_one(Parser& p, std::string_view& in, bool tls, const policy::HostPort& target) {
    const auto& f = fixture();
    auto head_or = to_request_head(p, tls, !tls);
    if (std::holds_alternative<Refusal>(head_or)) {
        const auto& r = std::get<Refusal>(head_or);
        FUZZ_CHECK(r.status == 400 && !r.reason.empty(), r.reason);
        return false;
    }
    auto& head = std::get<policy::RequestHead>(head_or);
    FUZZ_CHECK(head.count("host") == 0, "to_request_head kept a host header");
    FUZZ_CHECK(!(head.count("content-length") > 0 && head.count("transfer-encoding") > 0),
               "CL and TE both passed to_request_head");
    for (const auto& h : head.headers) {
        FUZZ_CHECK(h.name == policy::ascii_lower(h.name), "header name not lowercase");
    }
    const auto sent = head.headers;
    policy::RequestContext ctx;
    ctx.global = &f.global;
    ctx.run = &f.run;
    ctx.target = target;
    if (tls) {
        ctx.sni = target.host;
    }
    ctx.tls = tls;
    ctx.now = f.now;
    // Either upstream codec: "te: trailers" is kept only for an HTTP/2 upstream.
    ctx.upstream_h2 = !head.path.empty() && head.path.back() == '2';
    auto d = policy::RequestPipeline{}.run(head, ctx);
    fuzz::check_forwarded(head, d, ctx, sent);

    std::optional<uint64_t> length;
    if (auto cl = p.content_length(); cl && !p.chunked()) {
        length = *cl;
    }
    std::string body;
    const bool complete = read_body(p, in, body);
    FUZZ_CHECK(!complete || !length || body.size() == *length,
               "a complete Content-Length body of another length");
    for (const auto& t : p.trailers()) {
        FUZZ_CHECK(t.name == policy::ascii_lower(t.name), "trailer name not lowercase");
    }
    if (d.forward()) {
        check_serialization(head, target.authority(), length, p.chunked());
        check_scrubber(d, body);
    }
    return complete && d.forward() && p.keep_alive();
}

/// The decrypted stream inside an intercepted CONNECT tunnel.
void serve_intercepted(std::string_view in, const policy::HostPort& target) {
    for (int i = 0; i < kMaxRequests && !in.empty(); ++i) {
        Parser p;
        p.header_limit(kMaxHeaderBytes);
        p.body_limit(boost::none);
        if (!read_header(p, in) || !serve_one(p, in, true, target)) {
            return;
        }
    }
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
    spdlog::set_level(spdlog::level::off);
    (void)fixture();
    return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
    const auto& f = fixture();
    std::string_view in(reinterpret_cast<const char*>(data), size);
    for (int i = 0; i < kMaxRequests && !in.empty(); ++i) {
        Parser p;
        p.header_limit(kMaxHeaderBytes);
        p.body_limit(boost::none);
        if (!read_header(p, in)) {
            return 0;
        }
        if (const std::string* auth = p.find("proxy-authorization")) {
            std::string user;
            std::string pass;
            if (parse_proxy_basic(*auth, user, pass)) {
                FUZZ_CHECK(user.find(':') == std::string::npos, "user with ':'");
            }
        }
        if (p.method() == http::verb::connect) {
            auto hp = policy::parse_authority(p.target(), std::nullopt);
            if (!hp) {
                return 0;
            }
            auto dd = policy::decide_destination(f.global, f.run, *hp, f.now);
            if (dd.carry == policy::Carry::Deny) {
                FUZZ_CHECK(!dd.reason.empty(), "deny without a reason");
                return 0;
            }
            FUZZ_CHECK(policy::host_allowed(f.global, f.run, *hp) ||
                           policy::host_pinned(f.global, f.run, *hp, f.now),
                       "CONNECT allowed to a host nobody named: " + hp->authority());
            if (dd.carry == policy::Carry::Intercept) {
                serve_intercepted(in, *hp);
            }
            return 0;
        }
        auto url = boost::urls::parse_absolute_uri(p.target());
        if (!url || url->scheme_id() != boost::urls::scheme::http || url->has_userinfo()) {
            return 0;
        }
        auto hp = policy::parse_authority(url->encoded_authority(), 80);
        if (!hp) {
            return 0;
        }
        auto dd = policy::decide_destination(f.global, f.run, *hp, f.now);
        if (dd.carry == policy::Carry::Deny) {
            if (!(p.keep_alive() && p.is_done())) {
                return 0;
            }
            continue;
        }
        if (!serve_one(p, in, false, *hp)) {
            return 0;
        }
    }
    return 0;
}
