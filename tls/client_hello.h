#pragma once
// Reads the server name (SNI) from the first bytes of a TLS connection without consuming them:
// the transparent listener peeks at the ClientHello (MSG_PEEK), decides policy on the name,
// then lets OpenSSL read the same bytes for the real handshake (or relays them untouched).
// Pure parsing, no OpenSSL, no I/O; bounded by the bytes given.
#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <string>

namespace egress::tls {

struct ClientHelloPeek {
    enum class Status : uint8_t {
        NeedMore,   // a prefix of a plausible ClientHello: peek again (up to kMaxClientHello)
        NotTls,     // the first byte is not a TLS handshake record: treat as cleartext
        Malformed,  // a TLS record that is not a well-formed ClientHello
        Complete,   // the whole ClientHello was parsed; `sni` set if it carried one
    };
    Status status = Status::NeedMore;
    std::optional<std::string> sni;  // host_name as sent (not yet normalized)
};

/// Largest ClientHello accepted (handshake message bytes, across records).
inline constexpr size_t kMaxClientHello = 16384;

ClientHelloPeek peek_client_hello(std::span<const uint8_t> bytes);

/// A server_name extension's body (RFC 6066 3): its host_name as sent, if it has one;
/// `malformed` when the list's lengths do not add up or it has two host_names or an empty one.
struct ServerNameExtension {
    bool malformed = false;
    std::optional<std::string> host;
};
ServerNameExtension parse_server_name(std::span<const uint8_t> ext);

}  // namespace egress::tls
