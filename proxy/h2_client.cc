#include "proxy/h2_client.h"

#include <spdlog/spdlog.h>

#include <charconv>
#include <cstring>
#include <unordered_map>

#include "common/secure_zero.h"
#include "proxy/h2_common.h"
#include "proxy/h2_pool.h"

namespace egress::proxy {

using Clock = std::chrono::steady_clock;

struct H2ClientStreamState {
    explicit H2ClientStreamState(const net::any_io_executor& ex) : signal(ex) {}
    int32_t id = -1;
    /// Wakes the stream's owner when the response moves (head, data, end) or the stream ends.
    Signal signal;
    /// Wakes a request body writer (h2_send_body) when its bytes were taken or the stream
    /// ended: its own signal, so a writer and a response reader may wait at once (a
    /// full-duplex exchange) without waking or re-arming each other's wait.
    LazySignal sent;
    // request body, owner → nghttp2
    PieceQueue out;
    size_t out_off = 0;
    size_t out_bytes = 0;
    bool out_last = false;
    std::vector<policy::Header> out_trailers;
    bool deferred = false;
    // response, nghttp2 → owner
    H2ClientResponse head;
    bool head_done = false;
    bool in_trailers = false;
    size_t header_bytes = 0;
    size_t header_fields = 0;
    std::vector<policy::Header> trailers;
    PieceQueue in;
    bool front_out = false;  // in.front() was handed to the owner
    bool eof = false;
    bool closed = false;
    bool abandoned = false;
    uint32_t error = 0;
    /// A response header block over max_header_list_bytes or max_header_fields: reset by us
    /// (INTERNAL_ERROR), the upstream's fault.
    bool bad_response = false;
    /// A header block of ours over the session's max_send_header_block_length: never sent.
    bool too_large = false;
};

struct H2ClientSession::Impl {
    Impl(std::unique_ptr<TlsStream> s, H2ClientOptions o)
        : stream(std::move(s)), io(*stream), opts(o), pool(o.wipe_sent),
          watchdog(stream->get_executor()) {
        io.wipe_written = o.wipe_sent;
    }
    ~Impl() {
        // The session goes first: nothing its callbacks reference may die before it.
        session.reset();
        if (wipe_reads) {
            egress::secure_zero(read_buf.get(), kReadBytes);
        }
    }
    std::unique_ptr<TlsStream> stream;
    H2Io io;
    H2ClientOptions opts;
    size_t max_send_block = 0;  // max_send_header_block_length of the session
    H2Pool pool;  // nghttp2's memory: outlives the session
    SessionPtr session;
    StreamMap<H2ClientStreamState> streams;
    bool goaway = false;
    net::steady_timer watchdog;
    std::unique_ptr<uint8_t[]> read_buf = std::make_unique<uint8_t[]>(kReadBytes);
    // A response echoed a credential: the reader wipes its buffer after each read is parsed
    // (all of it after the first, what earlier reads left too), and when the session goes.
    bool wipe_reads = false;
    bool wiped_all = false;
    static constexpr size_t kReadBytes = 16 * 1024;
    // Since when the session has had no stream: its idle timeout counts from here, not from
    // the last frame read (an upstream's PINGs would keep an unused session open for ever).
    Clock::time_point idle_since = Clock::now();
    // SETTINGS frames of ours submitted and acknowledged (acknowledgements come in order), and
    // the HPACK table reset of wipe_reads(): at most one pair in flight. An echo while one is
    // in flight asks for one more after it (the upstream's encoder may have indexed it once it
    // had its table back), so an upstream that never acknowledges gets one pair, not a pair
    // per echoing response piling up in nghttp2's queue of unacknowledged settings.
    uint64_t settings_sent = 0;
    uint64_t settings_acked = 0;
    uint64_t table_reset_done_at = 0;  // settings_acked when the pending reset is complete
    bool table_reset_again = false;

    void reset_table() {
        const nghttp2_settings_entry none{NGHTTP2_SETTINGS_HEADER_TABLE_SIZE, 0};
        const nghttp2_settings_entry back{NGHTTP2_SETTINGS_HEADER_TABLE_SIZE,
                                          NGHTTP2_DEFAULT_HEADER_TABLE_SIZE};
        for (const auto* e : {&none, &back}) {
            if (nghttp2_submit_settings(session.get(), NGHTTP2_FLAG_NONE, e, 1) == 0) {
                ++settings_sent;
            }
        }
        table_reset_done_at = settings_sent;
        table_reset_again = false;
    }

    H2ClientStreamState* find(int32_t id) {
        auto it = streams.find(id);
        return it == streams.end() ? nullptr : it->second.get();
    }
    void fail_all() {
        for (auto& [id, st] : streams) {
            st->closed = true;
            st->signal.notify();
            st->sent.notify();
        }
    }
};

namespace {

using Impl = H2ClientSession::Impl;

ssize_t read_request_body(nghttp2_session* session, int32_t stream_id, uint8_t* buf,
                          size_t length, uint32_t* data_flags, nghttp2_data_source* source,
                          void* user_data) {
    return read_outbound(session, stream_id, buf, length, data_flags,
                         static_cast<H2ClientStreamState*>(source->ptr),
                         static_cast<H2ClientSession::Impl*>(user_data)->io);
}

int on_begin_headers(nghttp2_session*, const nghttp2_frame* frame, void* user_data) {
    auto* im = static_cast<Impl*>(user_data);
    if (auto* st = im->find(frame->hd.stream_id)) {
        st->header_bytes = 0;
        st->header_fields = 0;
        st->in_trailers = st->head_done;
        if (!st->head_done) {
            st->head.headers.reserve(policy::kTypicalHeaderFields);
        }
    }
    return 0;
}

int on_header(nghttp2_session*, const nghttp2_frame* frame, const uint8_t* name, size_t namelen,
              const uint8_t* value, size_t valuelen, uint8_t, void* user_data) {
    auto* im = static_cast<Impl*>(user_data);
    auto* st = im->find(frame->hd.stream_id);
    if (st == nullptr) {
        return 0;
    }
    if (!within_header_budget(st, namelen, valuelen, im->opts.max_header_fields,
                              im->opts.max_header_list_bytes)) {
        st->bad_response = true;
        return NGHTTP2_ERR_TEMPORAL_CALLBACK_FAILURE;  // resets this stream only
    }
    auto n = sv(name, namelen);
    auto v = sv(value, valuelen);
    if (st->in_trailers) {
        if (!n.empty() && n[0] != ':') {
            st->trailers.push_back({std::string(n), std::string(v)});
        }
        return 0;
    }
    if (n == ":status") {
        int code = 0;
        std::from_chars(v.data(), v.data() + v.size(), code);
        st->head.status = code;
        st->head.headers.clear();
    } else if (!n.empty() && n[0] != ':') {
        st->head.headers.push_back({std::string(n), std::string(v)});
    }
    return 0;
}

int on_frame_recv(nghttp2_session*, const nghttp2_frame* frame, void* user_data) {
    auto* im = static_cast<Impl*>(user_data);
    if (frame->hd.type == NGHTTP2_GOAWAY) {
        im->goaway = true;
        return 0;
    }
    if (frame->hd.type == NGHTTP2_SETTINGS && (frame->hd.flags & NGHTTP2_FLAG_ACK) != 0) {
        ++im->settings_acked;
        if (im->table_reset_again && im->settings_acked >= im->table_reset_done_at) {
            im->reset_table();  // the read loop wakes the writer after this read
        }
        return 0;
    }
    auto* st = im->find(frame->hd.stream_id);
    if (st == nullptr) {
        return 0;
    }
    const bool end = (frame->hd.flags & NGHTTP2_FLAG_END_STREAM) != 0;
    if (frame->hd.type == NGHTTP2_HEADERS) {
        if (!st->head_done) {
            if (st->head.status >= 100 && st->head.status < 200) {
                st->head = {};  // interim response: wait for the final one
                return 0;
            }
            st->head_done = true;
            st->head.end_stream = end;
        }
        if (end) {
            st->eof = true;
        }
        st->signal.notify();
    } else if (frame->hd.type == NGHTTP2_DATA && end) {
        st->eof = true;
        st->signal.notify();
    }
    return 0;
}

int on_data_chunk(nghttp2_session* session, uint8_t, int32_t stream_id, const uint8_t* data,
                  size_t len, void* user_data) {
    auto* im = static_cast<Impl*>(user_data);
    // The connection window is given back on receipt, the stream's only once the bytes are
    // forwarded: per-stream windows bound what is buffered, and a stream whose client does
    // not read cannot starve the other streams of this pooled session (a few such streams
    // used to hold the whole connection window).
    nghttp2_session_consume_connection(session, len);
    auto* st = im->find(stream_id);
    if (st == nullptr || st->abandoned) {
        nghttp2_session_consume_stream(session, stream_id, len);  // nobody will forward it
        return 0;
    }
    st->in.append(std::string_view(reinterpret_cast<const char*>(data), len));
    st->signal.notify();
    return 0;
}

/// A header block of ours that nghttp2 did not send: over max_send_header_block_length (open()
/// checks a request head before, so this is the trailers', or a backstop) is marked too large,
/// so that it is not taken for a refusal to retry: nghttp2 closes the stream of a request head
/// it could not send with REFUSED_STREAM, and leaves open one whose trailers it could not send
/// (reset here). Other reasons (a GOAWAY came first: REFUSED_STREAM) stay as nghttp2 says.
int on_frame_not_send(nghttp2_session* session, const nghttp2_frame* frame, int lib_error,
                      void* user_data) {
    auto* im = static_cast<Impl*>(user_data);
    if (frame->hd.type != NGHTTP2_HEADERS || lib_error != NGHTTP2_ERR_FRAME_SIZE_ERROR) {
        return 0;
    }
    spdlog::info("h2 upstream stream {}: header block over {} bytes not sent", frame->hd.stream_id,
                 im->max_send_block);
    if (auto* st = im->find(frame->hd.stream_id)) {
        st->too_large = true;
        if (frame->headers.cat != NGHTTP2_HCAT_REQUEST) {
            nghttp2_submit_rst_stream(session, NGHTTP2_FLAG_NONE, st->id, NGHTTP2_CANCEL);
        }
    }
    return 0;
}

int on_stream_close(nghttp2_session*, int32_t stream_id, uint32_t error_code, void* user_data) {
    auto* im = static_cast<Impl*>(user_data);
    auto it = im->streams.find(stream_id);
    if (it == im->streams.end()) {
        return 0;
    }
    auto& st = *it->second;
    st.closed = true;
    st.error = error_code;
    st.signal.notify();
    st.sent.notify();
    im->io.dequeued(st.out_bytes);  // never sent now
    st.out.clear();
    st.out_bytes = 0;
    st.out_off = 0;
    im->streams.erase(it);  // the owner keeps its shared_ptr
    if (im->streams.empty()) {
        im->idle_since = Clock::now();
    }
    return 0;
}

awaitable<void> read_loop(std::shared_ptr<H2ClientSession> self, Impl& im) {
    uint8_t* const buf = im.read_buf.get();
    Arrival next = Arrival::Maybe;
    while (!im.io.dead) {
        auto [ec, n] = co_await read_some(*im.stream, net::buffer(buf, Impl::kReadBytes), next);
        if (ec) {
            break;
        }
        next = arrival_after(n, Impl::kReadBytes);
        im.io.last_activity = Clock::now();
        ssize_t rv = nghttp2_session_mem_recv(im.session.get(), buf, n);
        if (im.wipe_reads) {  // nghttp2 copied what it keeps
            egress::secure_zero(buf, im.wiped_all ? n : Impl::kReadBytes);
            im.wiped_all = true;
        }
        if (rv < 0) {
            spdlog::debug("h2 upstream: {}", nghttp2_strerror(static_cast<int>(rv)));
            break;
        }
        im.io.wsig.notify();
    }
    im.io.dead = true;
    im.io.wsig.notify();
    im.fail_all();
    im.watchdog.cancel();
}

awaitable<void> write_loop(std::shared_ptr<H2ClientSession> self, Impl& im) {
    co_await im.io.write_loop();
    im.fail_all();
    im.watchdog.cancel();
}

awaitable<void> watch_loop(std::shared_ptr<H2ClientSession> self, Impl& im) {
    while (!im.io.dead) {
        im.watchdog.expires_after(std::chrono::seconds(1));
        co_await im.watchdog.async_wait(use_nothrow);
        if (im.io.dead) {
            break;
        }
        auto now = Clock::now();
        if (im.io.writing && now - im.io.write_started > im.opts.io_timeout) {
            im.io.dead = true;  // the server stopped reading
            im.io.close_socket();
            im.fail_all();
            break;
        }
        if (im.streams.empty()) {
            im.pool.trim();  // a pooled connection between bursts holds no spare blocks
        }
        if (im.streams.empty() && now - im.idle_since > im.opts.idle_timeout) {
            im.goaway = true;
            nghttp2_session_terminate_session(im.session.get(), NGHTTP2_NO_ERROR);
            im.io.wsig.notify();
        }
    }
}

void log_error(std::exception_ptr e) {
    if (e) {
        try {
            std::rethrow_exception(e);
        } catch (const std::exception& ex) {
            spdlog::error("h2 client coroutine: {}", ex.what());
        }
    }
}

}  // namespace

std::shared_ptr<H2ClientSession> H2ClientSession::start(std::unique_ptr<TlsStream> stream,
                                                        H2ClientOptions opts) {
    std::shared_ptr<H2ClientSession> self(new H2ClientSession());
    self->impl_ = std::make_unique<Impl>(std::move(stream), opts);
    Impl& im = *self->impl_;

    nghttp2_session_callbacks* cbs_raw = nullptr;
    nghttp2_session_callbacks_new(&cbs_raw);
    CallbacksPtr cbs(cbs_raw);
    nghttp2_session_callbacks_set_on_begin_headers_callback(cbs.get(), on_begin_headers);
    nghttp2_session_callbacks_set_on_header_callback(cbs.get(), on_header);
    nghttp2_session_callbacks_set_on_frame_recv_callback(cbs.get(), on_frame_recv);
    nghttp2_session_callbacks_set_on_data_chunk_recv_callback(cbs.get(), on_data_chunk);
    nghttp2_session_callbacks_set_on_stream_close_callback(cbs.get(), on_stream_close);
    nghttp2_session_callbacks_set_on_frame_not_send_callback(cbs.get(), on_frame_not_send);
    nghttp2_option* opt_raw = nullptr;
    nghttp2_option_new(&opt_raw);
    OptionPtr opt(opt_raw);
    nghttp2_option_set_no_auto_window_update(opt.get(), 1);
    // Request heads as large as egressd's limits let through, with the injected fields.
    im.max_send_block = h2_send_block_limit(opts.max_header_list_bytes);
    nghttp2_option_set_max_send_header_block_length(opt.get(), im.max_send_block);
    nghttp2_option_set_peer_max_concurrent_streams(opt.get(), 100);
    nghttp2_session* s = nullptr;
    nghttp2_session_client_new3(&s, cbs.get(), &im, opt.get(), im.pool.mem());
    im.session.reset(s);
    im.io.session = s;

    nghttp2_settings_entry settings[] = {
        {NGHTTP2_SETTINGS_ENABLE_PUSH, 0},
        {NGHTTP2_SETTINGS_INITIAL_WINDOW_SIZE, opts.stream_window},
        {NGHTTP2_SETTINGS_MAX_HEADER_LIST_SIZE, static_cast<uint32_t>(opts.max_header_list_bytes)},
    };
    if (nghttp2_submit_settings(s, NGHTTP2_FLAG_NONE, settings, std::size(settings)) == 0) {
        im.settings_sent = 1;
    }
    nghttp2_session_set_local_window_size(s, NGHTTP2_FLAG_NONE, 0,
                                          static_cast<int32_t>(opts.connection_window));

    auto ex = im.stream->get_executor();
    net::co_spawn(ex, read_loop(self, im), log_error);
    net::co_spawn(ex, write_loop(self, im), log_error);
    net::co_spawn(ex, watch_loop(self, im), log_error);
    return self;
}

H2ClientSession::~H2ClientSession() = default;

bool H2ClientSession::alive() const { return !impl_->io.dead; }

size_t H2ClientSession::open_streams() const { return impl_->streams.size(); }

bool H2ClientSession::has_capacity() const {
    if (impl_->io.dead || impl_->goaway) {
        return false;
    }
    uint32_t remote = nghttp2_session_get_remote_settings(impl_->session.get(),
                                                          NGHTTP2_SETTINGS_MAX_CONCURRENT_STREAMS);
    return impl_->streams.size() < std::min<uint32_t>(remote, 256);
}

std::unique_ptr<H2ClientStream> H2ClientSession::open(const policy::RequestHead& head,
                                                      std::string_view scheme,
                                                      std::string_view authority,
                                                      bool end_stream,
                                                      std::optional<uint64_t> content_length) {
    Impl& im = *impl_;
    if (im.io.dead || im.goaway) {
        return nullptr;
    }
    NvList nva;
    nva.reserve(head.headers.size() + 5);
    nva.push_back(make_nv(":method", head.method));
    nva.push_back(make_nv(":scheme", scheme));
    nva.push_back(make_nv(":authority", authority));
    nva.push_back(make_nv(":path", head.path));
    for (const auto& h : head.headers) {
        if (!h2_forbidden(h) && h.name != "content-length") {
            const bool secret = head.never_indexed(h.name);
            nva.push_back(make_nv(h.name, h.value,
                                  secret ? NGHTTP2_NV_FLAG_NO_INDEX : NGHTTP2_NV_FLAG_NONE));
        }
    }
    char digits[20];  // nghttp2_submit_request copies the fields
    if (content_length) {
        auto [end, ec] = std::to_chars(digits, digits + sizeof digits, *content_length);
        nva.push_back(make_nv("content-length",
                              std::string_view(digits, static_cast<size_t>(end - digits))));
    }
    auto st = make_stream<H2ClientStreamState>(im.stream->get_executor());
    if (h2_block_bound(nva.data(), nva.size()) > im.max_send_block) {
        // nghttp2 would drop the head unsent and close the stream REFUSED_STREAM, as if the
        // upstream had refused it (sent again, in vain): a stream that never opens instead,
        // too_large for the caller (H2ClientStream::too_large).
        spdlog::info("h2 upstream: request head over the {} bytes a header block may take: "
                     "not sent", im.max_send_block);
        st->closed = true;
        st->too_large = true;
        return std::make_unique<H2ClientStream>(shared_from_this(), std::move(st));
    }
    nghttp2_data_provider prd{};
    prd.source.ptr = st.get();
    prd.read_callback = read_request_body;
    int32_t id = nghttp2_submit_request(im.session.get(), nullptr, nva.data(), nva.size(),
                                        end_stream ? nullptr : &prd, nullptr);
    if (id < 0) {
        spdlog::debug("h2 submit_request: {}", nghttp2_strerror(id));
        return nullptr;
    }
    st->id = id;
    st->out_last = end_stream;
    im.streams[id] = st;
    im.io.wsig.notify();
    return std::make_unique<H2ClientStream>(shared_from_this(), std::move(st));
}

void H2ClientSession::shutdown() {
    if (!impl_->io.dead) {
        impl_->goaway = true;
        nghttp2_session_terminate_session(impl_->session.get(), NGHTTP2_NO_ERROR);
        impl_->io.wsig.notify();
    }
}

void H2ClientSession::wipe_reads() {
    // Not the buffer itself, now: a read may have filled it already (one that completes at
    // its start posts its completion), its bytes not yet parsed. The reader wipes it.
    impl_->wipe_reads = true;
    impl_->stream->cleanse_plaintext();
    // The response's fields went through the HPACK decoder: a reflected credential the
    // upstream's encoder indexed stays in this session's dynamic table until evicted. Its size
    // goes to 0 and back: when the upstream acknowledges the first SETTINGS, nghttp2 empties
    // the table (the wiping pool zeroes each entry's block), and the upstream's encoder starts
    // its table over (RFC 7541 4.2: it must signal the smaller size first).
    if (!impl_->io.dead) {
        if (impl_->settings_acked < impl_->table_reset_done_at) {
            impl_->table_reset_again = true;  // after the pair in flight
        } else {
            impl_->reset_table();
            impl_->io.wsig.notify();
        }
    }
}

// --- stream ------------------------------------------------------------------------------

H2ClientStream::H2ClientStream(std::shared_ptr<H2ClientSession> session,
                               std::shared_ptr<H2ClientStreamState> state)
    : session_(std::move(session)), state_(std::move(state)) {}

H2ClientStream::~H2ClientStream() { reset(); }

void H2ClientStream::reset() {
    auto& st = *state_;
    auto& im = *session_->impl_;
    if (st.abandoned) {
        return;
    }
    st.abandoned = true;
    if (im.io.dead) {
        return;
    }
    if (!st.closed && !(st.eof && st.out_last && st.out.empty())) {
        nghttp2_submit_rst_stream(im.session.get(), NGHTTP2_FLAG_NONE, st.id, NGHTTP2_CANCEL);
    }
    // The piece read() handed out may still be in its reader's hands (the full-duplex
    // upload aborts the stream while the response part waits to pass that piece on): it
    // stays until that reader's next read(), which takes it back and ends the stream there.
    size_t left = 0;
    for (const auto& c : st.in) {
        left += c.size();
    }
    if (st.front_out) {
        left -= st.in.front().size();
        st.in.clear_after_front();
    } else {
        st.in.clear();
    }
    if (left > 0) {
        nghttp2_session_consume_stream(im.session.get(), st.id, left);  // connection: on receipt
    }
    im.io.wsig.notify();
}

awaitable<bool> H2ClientStream::write(std::string_view data, bool last,
                                      const std::vector<policy::Header>* trailers,
                                      std::optional<std::chrono::milliseconds> wait) {
    auto& im = *session_->impl_;
    const bool queued =
        co_await h2_send_body(im.io, *state_, data, last, trailers, im.opts.max_send_buffer,
                              wait.value_or(im.opts.io_timeout));
    co_return queued && !im.io.dead;
}

awaitable<bool> H2ClientStream::response(H2ClientResponse& out,
                                         std::optional<std::chrono::milliseconds> wait) {
    auto& st = *state_;
    auto& im = *session_->impl_;
    for (;;) {
        if (st.head_done) {
            out = std::move(st.head);  // handed out once (H2Upstream::read_head)
            co_return true;
        }
        if (st.closed || im.io.dead) {
            co_return false;
        }
        if (!co_await st.signal.wait(wait.value_or(im.opts.io_timeout))) {
            co_return false;
        }
    }
}

awaitable<H2ClientStream::Piece> H2ClientStream::read(
    std::optional<std::chrono::milliseconds> wait) {
    auto& st = *state_;
    auto& im = *session_->impl_;
    if (st.front_out) {
        // The previous piece has been forwarded: give its bytes back to the server (the
        // stream's window; the connection's was given back on receipt).
        st.front_out = false;
        size_t n = st.in.front().size();
        st.in.pop_front();
        if (!im.io.dead) {
            nghttp2_session_consume_stream(im.session.get(), st.id, n);
            im.io.wsig.notify();
        }
    }
    if (st.abandoned) {
        co_return Piece{{}, false, false};  // reset(): nothing more is read
    }
    for (;;) {
        if (!st.in.empty()) {
            st.front_out = true;
            // The end already came (an END_STREAM DATA frame, often empty, behind this one;
            // or trailers): said with the last bytes, so the relay sends them as the end
            // instead of holding the scrubber's tail for one more read.
            co_return Piece{st.in.front(), st.eof && st.in.size() == 1, true};
        }
        if (st.eof) {
            co_return Piece{{}, true, true};
        }
        if (st.closed || im.io.dead) {
            co_return Piece{{}, false, false};
        }
        if (!co_await st.signal.wait(wait.value_or(im.opts.io_timeout))) {
            co_return Piece{{}, false, false};
        }
    }
}

const std::vector<policy::Header>& H2ClientStream::trailers() const { return state_->trailers; }

bool H2ClientStream::responded() const {
    return (state_->head_done && state_->eof) || state_->closed || session_->impl_->io.dead;
}

uint32_t H2ClientStream::error_code() const { return state_->error; }

bool H2ClientStream::refused() const {
    return state_->error == NGHTTP2_REFUSED_STREAM && !state_->too_large;
}

bool H2ClientStream::bad_response() const { return state_->bad_response; }

bool H2ClientStream::too_large() const { return state_->too_large; }

}  // namespace egress::proxy
