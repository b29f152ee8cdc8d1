// Fuzz target: HTTP/2 frames from the sandbox into our server session (proxy/h2_server.cc).
//
// proxy/h2_server.cc is compiled into this target (#include below: its nghttp2 callbacks,
// the per-connection Conn with its flood accounting, the stream handler serve_stream and the
// H2Downstream adapter live in an anonymous namespace). The session is created with the same
// callbacks, options and SETTINGS as serve_intercepted_h2(), and the input is fed to
// nghttp2_session_mem_recv in chunks the way read_loop() does: after each chunk the
// ENHANCE_YOUR_CALM check runs, complete request heads get their serve_stream() coroutine,
// the io_context runs what is ready, and the writer drains nghttp2_session_mem_send (the
// bytes are discarded: there is no socket). At the end the connection shuts down like
// serve_intercepted_h2() (GOAWAY, io.dead, fail_all) and every stream handler must finish.
//
// serve_exchange() (exchange.cc, upstream and audit) is replaced below by the part of the
// core that talks to the client codec: the pipeline runs on the head (invariants from
// fuzz_common.h), a refusal goes out through refuse(), a forwarded request has its body read
// through read_body() (window consumption), and gets a response head with hop-by-hop fields
// to strip, the body echoed through the Scrubber, and the request trailers as trailers.
//
// Input: byte 0 = mem_recv chunk size (0: 16 KiB as read_loop reads), byte 1 = the CONNECT
// target (bits 0-2: index into kTargets) and draining (bit 7); the rest is the client's
// bytes. The connection preface is prepended when the rest does not start with it.
#include "proxy/h2_server.cc"  // NOLINT(bugprone-suspicious-include)

#include <cstdint>

#include "fuzz_common.h"
#include "policy/scrubber.h"

namespace egress::proxy {

awaitable<bool> serve_exchange(Downstream& down, policy::RequestHead head, Scope& scope,
                               std::chrono::steady_clock::time_point) {
    const auto& f = fuzz::fixture();
    FUZZ_CHECK(head.scheme == "https", "serve_stream let a non-https scheme through");
    FUZZ_CHECK(head.method != "CONNECT", "CONNECT inside the tunnel reached the core");
    for (const auto& h : head.headers) {
        FUZZ_CHECK(!h.name.empty() && h.name[0] != ':', "pseudo-header in the head: " + h.name);
        FUZZ_CHECK(h.name != "host", "host header beside :authority");
    }
    policy::RequestContext ctx;
    ctx.global = &f.global;
    ctx.run = &f.run;
    ctx.target = scope.target;
    ctx.sni = scope.target.host;
    ctx.tls = true;
    ctx.now = f.now;
    ctx.upstream_h2 = !head.path.empty() && head.path.back() == '2';
    const auto sent = head.headers;
    policy::Decision d = policy::RequestPipeline{}.run(head, ctx);
    fuzz::check_forwarded(head, d, ctx, sent);
    if (!d.forward()) {
        co_await down.refuse(d.status, d.reason, false);
        co_return false;
    }
    FUZZ_CHECK(!head.method.empty() && !head.path.empty(), "forwarded without method or path");
    std::string body;
    for (;;) {
        BodyChunk chunk = co_await down.read_body();
        if (!chunk.ok) {
            co_return false;  // client reset or connection gone: nothing to answer
        }
        body.append(chunk.view());
        if (chunk.last) {
            break;
        }
    }
    Headers trailers = down.request_trailers();
    ResponseHead rh;
    rh.status = 200;
    rh.headers = {{"Content-Type", "text/plain"},
                  {"Connection", "close"},
                  {"Keep-Alive", "timeout=5"},
                  {"Transfer-Encoding", "chunked"},
                  {"TE", "trailers"},
                  {"X-Echo-Len", std::to_string(body.size())}};
    rh.body.none = head.method == "HEAD";
    if (!co_await down.send_head(rh)) {
        co_return false;
    }
    policy::Scrubber scrubber(d.scrub);
    std::string out;
    scrubber.feed(std::string_view(body).substr(0, body.size() / 2), out);
    if (!co_await down.send_body(out, false, nullptr)) {
        co_return false;
    }
    out.clear();
    scrubber.feed(std::string_view(body).substr(body.size() / 2), out);
    scrubber.finish(out);
    trailers.push_back({"Connection", "close"});
    co_return co_await down.send_body(out, true, &trailers);
}

}  // namespace egress::proxy

namespace {

using namespace egress;
using namespace egress::proxy;

constexpr std::string_view kPreface = NGHTTP2_CLIENT_MAGIC;
const policy::HostPort kTargets[8] = {
    {"api.github.com", 443}, {"git.test", 443},  {"a.key.test", 443}, {"mixed.test", 443},
    {"pypi.org", 443},       {"x.open.test", 443}, {"api.port.test", 8443}, {"evil.test", 443},
};

/// What a worker and its never-connected TLS stream provide to the codec. The stream is
/// only an executor holder: nothing in this target reads or writes a socket.
struct Env {
    net::io_context ioc{1};
    ssl::context ssl_ctx{ssl::context::tls_server};
    TlsStream tls{ioc, ssl_ctx};
    Shared shared;
    Worker worker{shared};
};

Env& env() {
    static Env* e = new Env();
    return *e;
}

/// Runs the ready coroutines and lets the writer serialize until nothing moves.
void pump(Conn& c) {
    auto& ioc = env().ioc;
    for (int i = 0; i < 100000; ++i) {
        if (ioc.stopped()) {
            ioc.restart();
        }
        size_t ran = ioc.poll();
        size_t sent = 0;
        while (!c.io.dead) {
            const uint8_t* out = nullptr;
            ssize_t n = nghttp2_session_mem_send(c.session.get(), &out);
            if (n < 0) {
                c.io.dead = true;
                break;
            }
            if (n == 0) {
                break;
            }
            sent += static_cast<size_t>(n);
        }
        if (ran == 0 && sent == 0) {
            return;
        }
    }
    FUZZ_CHECK(false, "the connection never settles (busy loop)");
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
    spdlog::set_level(spdlog::level::off);
    (void)fuzz::fixture();
    (void)env();
    return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
    if (size < 2) {
        return 0;
    }
    Env& e = env();
    const size_t chunk = data[0] == 0 ? 16 * 1024 : data[0];
    e.shared.draining.store((data[1] & 0x80) != 0);
    std::string input(reinterpret_cast<const char*>(data + 2), size - 2);
    if (!input.starts_with(kPreface)) {
        input.insert(0, kPreface);
    }

    Scope scope;
    scope.worker = &e.worker;
    scope.target = kTargets[data[1] & 7];
    scope.sni = scope.target.host;
    scope.tls = true;
    scope.proto_in = "h2";
    auto c = std::make_shared<Conn>(e.tls, scope);
    c->limits = Limits{};
    if (!start_session(*c)) {
        return 0;
    }
    pump(*c);  // our SETTINGS first, as the writer would

    // read_loop(), one chunk per read.
    std::string_view in(input);
    while (!in.empty() && !c->io.dead) {
        const std::string_view piece = in.substr(0, chunk);
        in.remove_prefix(piece.size());
        c->io.last_activity = Clock::now();
        ssize_t rv = nghttp2_session_mem_recv(
            c->session.get(), reinterpret_cast<const uint8_t*>(piece.data()), piece.size());
        if (rv < 0) {
            if (rv != NGHTTP2_ERR_FLOODED && rv != NGHTTP2_ERR_BAD_CLIENT_MAGIC) {
                nghttp2_session_terminate_session(c->session.get(), NGHTTP2_PROTOCOL_ERROR);
            }
            break;
        }
        FUZZ_CHECK(static_cast<size_t>(rv) == piece.size(), "mem_recv left bytes unread");
        if (c->calm && !c->goaway_sent) {
            c->goaway_sent = true;
            nghttp2_session_terminate_session(c->session.get(), NGHTTP2_ENHANCE_YOUR_CALM);
            c->ready.clear();
        }
        for (int32_t id : c->ready) {
            auto it = c->streams.find(id);
            if (it == c->streams.end() || it->second->closed) {
                continue;
            }
            it->second->handled = true;
            ++c->handlers;
            net::co_spawn(e.ioc, serve_stream(c, it->second), log_error);
        }
        c->ready.clear();
        pump(*c);
        if (c->goaway_sent || !nghttp2_session_want_read(c->session.get())) {
            break;
        }
    }
    // The client stops sending: GOAWAY, flush, then the connection dies under its handlers.
    nghttp2_session_terminate_session(c->session.get(), NGHTTP2_NO_ERROR);
    pump(*c);
    c->io.dead = true;
    c->fail_all();
    pump(*c);
    FUZZ_CHECK(c->handlers == 0, "a stream handler outlived its connection (" +
                                     std::to_string(c->handlers) + " left)");
    for (const auto& [id, st] : c->streams) {
        FUZZ_CHECK(st.use_count() == 1, "stream " + std::to_string(id) + " still referenced");
    }
    FUZZ_CHECK(c.use_count() == 1, "the connection is still referenced after shutdown");
    return 0;
}
