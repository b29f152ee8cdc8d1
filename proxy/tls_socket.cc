#include "proxy/tls_socket.h"

#include <sys/socket.h>

#include <boost/asio/error.hpp>
#include <boost/system/system_error.hpp>
#include <cerrno>

namespace egress::proxy {

namespace {

namespace net = boost::asio;
using error_code = boost::system::error_code;
using socket_type = TlsSocket::socket_type;

bool retriable(int err) { return err == EAGAIN || err == EWOULDBLOCK || err == EINTR; }

long bio_ctrl(BIO*, int cmd, long, void*) {
    // Writes are unbuffered: a flush (after each handshake flight) has nothing to do. Every
    // other query (kTLS, pending bytes, EOF) answers "no".
    return cmd == BIO_CTRL_FLUSH ? 1 : 0;
}

int bio_create(BIO* bio) {
    BIO_set_init(bio, 1);
    return 1;
}

/// Before each SSL call: classify() reads OpenSSL's error queue and errno, so neither may hold
/// something from an earlier call. ERR_clear_error resets all 16 slots of the queue (about 840
/// instructions, 4% of a proxied request's); the queue is almost always empty, which a peek
/// finds for much less.
void clear_errors() {
    if (ERR_peek_error() != 0) {
        ERR_clear_error();
    }
    errno = 0;
}

error_code ssl_error(unsigned long e) {
    return error_code(static_cast<int>(e), net::error::get_ssl_category());
}

int descriptor(socket_type& s) { return s.is_open() ? s.native_handle() : -1; }

}  // namespace

// The BIO between OpenSSL and the socket. Unlike OpenSSL's socket BIO it sends with
// MSG_NOSIGNAL (a peer that went away is EPIPE, not SIGPIPE) and asks the Asio socket for its
// descriptor on every call: once the socket is closed, a late SSL call fails with EBADF
// instead of reading a descriptor number the kernel has handed to another connection. Its
// data is the stream's Core, which owns the SSL object and so outlives the BIO.

int TlsSocket::bio_write(BIO* bio, const char* data, int len) {
    BIO_clear_retry_flags(bio);
    auto* core = static_cast<Core*>(BIO_get_data(bio));
    const int fd = descriptor(core->socket);
    if (fd < 0) {
        errno = EBADF;
        return -1;
    }
    const int flags = MSG_NOSIGNAL | (core->more_to_send ? MSG_MORE : 0);
    const ssize_t n = ::send(fd, data, static_cast<size_t>(len), flags);
    if (n < 0 && retriable(errno)) {
        BIO_set_retry_write(bio);
    }
    return static_cast<int>(n);
}

int TlsSocket::bio_read(BIO* bio, char* data, int len) {
    BIO_clear_retry_flags(bio);
    auto* core = static_cast<Core*>(BIO_get_data(bio));
    const int fd = descriptor(core->socket);
    if (fd < 0) {
        errno = EBADF;
        return -1;
    }
    const ssize_t n = ::recv(fd, data, static_cast<size_t>(len), 0);
    if (n < 0 && retriable(errno)) {
        BIO_set_retry_read(bio);
    }
    return static_cast<int>(n);  // 0: the peer closed
}

const BIO_METHOD* TlsSocket::socket_bio_method() {
    static const BIO_METHOD* method = [] {
        BIO_METHOD* m = BIO_meth_new(BIO_get_new_index() | BIO_TYPE_SOURCE_SINK, "egressd socket");
        if (m == nullptr || BIO_meth_set_write(m, bio_write) != 1 ||
            BIO_meth_set_read(m, bio_read) != 1 || BIO_meth_set_ctrl(m, bio_ctrl) != 1 ||
            BIO_meth_set_create(m, bio_create) != 1) {
            throw std::bad_alloc();
        }
        return m;
    }();
    return method;
}

TlsSocket::TlsSocket(socket_type socket, boost::asio::ssl::context& ctx) {
    auto core = std::make_shared<Core>(std::move(socket));
    core->ssl = SSL_new(ctx.native_handle());
    if (core->ssl == nullptr) {
        throw boost::system::system_error(ssl_error(ERR_get_error()), "SSL_new");
    }
    // As asio::ssl::stream sets them: SSL_write may return after some records (a write_some),
    // may be retried from another address with the same bytes, and frees its record buffers
    // while a connection is idle (until it is busy: start_keeping_buffers).
    SSL_set_mode(core->ssl, SSL_MODE_ENABLE_PARTIAL_WRITE | SSL_MODE_ACCEPT_MOVING_WRITE_BUFFER |
                                SSL_MODE_RELEASE_BUFFERS);
    core->cleanse_released = (SSL_get_options(core->ssl) & SSL_OP_CLEANSE_PLAINTEXT) != 0;
    // Read what the socket has (several records) in one recv, not a header then a body.
    SSL_set_read_ahead(core->ssl, 1);
    BIO* bio = BIO_new(socket_bio_method());
    if (bio == nullptr) {
        throw boost::system::system_error(ssl_error(ERR_get_error()), "BIO_new");
    }
    BIO_set_data(bio, core.get());
    SSL_set_bio(core->ssl, bio, bio);  // one reference, owned by the SSL object
    if (core->socket.is_open()) {
        error_code ec;
        core->socket.native_non_blocking(true, ec);
        if (ec) {
            throw boost::system::system_error(ec, "non-blocking socket");
        }
    }
    core_ = std::move(core);
}

void TlsSocket::close_core() noexcept {
    if (!core_) {
        return;  // moved from
    }
    core_->closed = true;
    error_code ignored;
    core_->timer.cancel();
    core_->socket.close(ignored);
    core_.reset();
}

TlsSocket::Core::~Core() {
    if (ssl != nullptr) {
        if (cleanse_released) {
            SSL_set_options(ssl, SSL_OP_CLEANSE_PLAINTEXT);  // the buffers it kept, too
        }
        SSL_free(ssl);  // cleanses its keys (and, with the option, its record buffers)
    }
}

TlsSocket::Status TlsSocket::classify(SSL* ssl, int ret) {
    const int saved_errno = errno;
    const int err = SSL_get_error(ssl, ret);
    switch (err) {
        case SSL_ERROR_WANT_READ:
            return {Status::WantRead, {}, 0};
        case SSL_ERROR_WANT_WRITE:
            return {Status::WantWrite, {}, 0};
        case SSL_ERROR_ZERO_RETURN:
            return {Status::Failed, net::error::eof, 0};  // the peer's close_notify
        case SSL_ERROR_SYSCALL: {
            const unsigned long e = ERR_get_error();
            ERR_clear_error();
            if (e != 0) {
                return {Status::Failed, ssl_error(e), 0};
            }
            if (saved_errno != 0) {
                return {Status::Failed, error_code(saved_errno, boost::system::system_category()), 0};
            }
            return {Status::Failed, net::ssl::error::stream_truncated, 0};
        }
        case SSL_ERROR_SSL: {
            const unsigned long e = ERR_get_error();
            ERR_clear_error();
            if (ERR_GET_REASON(e) == SSL_R_UNEXPECTED_EOF_WHILE_READING) {
                return {Status::Failed, net::ssl::error::stream_truncated, 0};
            }
            return {Status::Failed, ssl_error(e), 0};
        }
        default:
            ERR_clear_error();
            return {Status::Failed, error_code(err, net::error::get_ssl_category()), 0};
    }
}

TlsSocket::Status TlsSocket::HandshakeStep::operator()(Core& core) const {
    SSL* ssl = core.ssl;
    clear_errors();
    const int r = SSL_do_handshake(ssl);
    return r == 1 ? Status{Status::Done, {}, 0} : classify(ssl, r);
}

TlsSocket::Status TlsSocket::ShutdownStep::operator()(Core& core) const {
    SSL* ssl = core.ssl;
    clear_errors();
    const int r = SSL_shutdown(ssl);
    if (r == 1) {
        return {Status::Done, {}, 0};
    }
    if (r == 0) {
        // Ours is sent. Try for the peer's now: it is often in already (the peer closed first).
        clear_errors();
        const int again = SSL_shutdown(ssl);
        if (again == 1) {
            return {Status::Done, {}, 0};
        }
        return again == 0 ? Status{Status::WantRead, {}, 0} : classify(ssl, again);
    }
    return classify(ssl, r);
}

TlsSocket::Status TlsSocket::ReadStep::operator()(Core& core) const {
    SSL* ssl = core.ssl;
    if (size == 0) {
        return {Status::Done, {}, 0};
    }
    clear_errors();
    size_t n = 0;
    if (SSL_read_ex(ssl, data, size, &n) != 1) {
        return classify(ssl, 0);
    }
    // Read ahead may have buffered more records: hand them out in this completion rather than
    // one record per turn of the event loop. A failure here (no whole record yet, a
    // close_notify) is left for the next read to report.
    while (n < size && SSL_has_pending(ssl) == 1) {
        size_t more = 0;
        clear_errors();
        if (SSL_read_ex(ssl, data + n, size - n, &more) != 1) {
            clear_errors();
            break;
        }
        n += more;
    }
    return {Status::Done, {}, n};
}

TlsSocket::Status TlsSocket::WriteStep::operator()(Core& core) const {
    // With SSL_MODE_ENABLE_PARTIAL_WRITE each SSL_write_ex sends one record (at most 16 KiB
    // of plaintext, less if the peer asked for smaller fragments), so only a write with more
    // than 16 KiB left has a record after this one: MSG_MORE never holds back a write's last.
    size_t done = 0;
    while (done < size) {
        clear_errors();
        size_t n = 0;
        core.more_to_send = size - done > kMaxRecordPlaintext;
        const int ok = SSL_write_ex(core.ssl, data + done, size - done, &n);
        core.more_to_send = false;
        if (ok != 1) {
            if (done > 0) {
                // Report what went out. The caller writes the rest with the same bytes, as
                // OpenSSL requires after WANT_WRITE, and that call waits if it must.
                clear_errors();
                break;
            }
            return classify(core.ssl, 0);
        }
        done += n;
    }
    return {Status::Done, {}, done};
}

bool TlsSocket::arm(const std::shared_ptr<Core>& core) {
    if (core->deadline == Clock::time_point::max()) {
        return true;
    }
    if (core->expired) {
        return false;
    }
    if (Clock::now() >= core->deadline) {
        core->expired = true;
        return false;
    }
    fire_by(core, core->deadline);  // if the deadline moved later, it re-arms when it fires
    return true;
}

void TlsSocket::fire_by(const std::shared_ptr<Core>& core, Clock::time_point at) {
    if (core->armed_at <= at) {
        return;
    }
    core->armed_at = at;
    const uint64_t generation = ++core->generation;
    core->timer.expires_at(at);  // cancels an earlier wait (a stale generation)
    core->timer.async_wait([core, generation](error_code) { on_timer(core, generation); });
}

void TlsSocket::cleanse_plaintext() {
    core_->cleanse_always = true;
    SSL_set_options(core_->ssl, SSL_OP_CLEANSE_PLAINTEXT);
    // Refused (0) while a record is half read or written, or read ahead is still unread (a
    // large body): a busy stream then gives its buffers back (wiped) as soon as they drain,
    // not at its next idle second, which a pooled connection kept busy may never have.
    if (SSL_free_buffers(core_->ssl) == 0 && core_->keep_buffers) {
        SSL_set_mode(core_->ssl, SSL_MODE_RELEASE_BUFFERS);
        SSL_set_default_read_buffer_len(core_->ssl, 0);
        core_->keep_buffers = false;
        core_->calls = 0;
    }
}

void TlsSocket::start_keeping_buffers(const std::shared_ptr<Core>& core) {
    SSL_clear_mode(core->ssl, SSL_MODE_RELEASE_BUFFERS);
    if (!core->cleanse_always) {
        // Nothing is freed while they are kept: what is read stays in them until the next
        // records overwrite it, a wipe_reads() or their release (wiped then). A busy stream
        // does not pay a wipe of every byte it reads (5 % of egressd's instructions with
        // 64 KiB responses).
        SSL_clear_options(core->ssl, SSL_OP_CLEANSE_PLAINTEXT);
    }
    SSL_set_default_read_buffer_len(core->ssl, kBusyReadBufferBytes);
    core->keep_buffers = true;
    core->release_due = Clock::now() + kIdleRelease;
    fire_by(core, core->release_due);
}

void TlsSocket::on_timer(const std::shared_ptr<Core>& core, uint64_t generation) {
    if (generation != core->generation) {
        return;
    }
    core->armed_at = Clock::time_point::max();
    if (core->closed) {
        return;
    }
    const auto now = Clock::now();
    if (core->keep_buffers && now >= core->release_due) {
        if (core->used) {
            core->used = false;  // busy in the last period: look again after the next one
            core->release_due = now + kIdleRelease;
        } else {
            // A whole period without a call. SSL_free_buffers refuses while a record is half
            // read or half written; the mode then frees them when they drain.
            SSL_set_mode(core->ssl, SSL_MODE_RELEASE_BUFFERS);
            if (core->cleanse_released) {
                SSL_set_options(core->ssl, SSL_OP_CLEANSE_PLAINTEXT);  // before they are freed
            }
            SSL_free_buffers(core->ssl);
            SSL_set_default_read_buffer_len(core->ssl, 0);  // OpenSSL's one-record minimum
            core->keep_buffers = false;
            core->calls = 0;
        }
    }
    if (core->deadline != Clock::time_point::max() && !core->expired) {
        if (now >= core->deadline) {
            core->expired = true;
            if (core->waiting > 0) {
                error_code ignored;
                core->socket.cancel(ignored);  // the waiting operations complete with timeout
            }
        } else if (core->waiting > 0) {
            arm(core);  // the deadline moved later while they waited
        }
    }
    if (core->keep_buffers) {
        fire_by(core, core->release_due);
    }
}

}  // namespace egress::proxy
