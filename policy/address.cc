#include "policy/address.h"

#include <arpa/inet.h>

#include <algorithm>
#include <span>

namespace egress::policy {

namespace {

using Bytes = std::array<uint8_t, 16>;

// How restrictive a class is; when an IPv6 form embeds an IPv4 address the higher one wins.
int rank(AddressClass c) {
    switch (c) {
        case AddressClass::Public: return 0;
        case AddressClass::Reserved: return 1;
        case AddressClass::Multicast: return 2;
        case AddressClass::Unspecified: return 3;
        case AddressClass::CarrierNat: return 4;
        case AddressClass::Private: return 5;
        case AddressClass::UniqueLocal: return 6;
        case AddressClass::LinkLocal: return 7;
        case AddressClass::Loopback: return 8;
        case AddressClass::Metadata: return 9;
    }
    return 9;
}

AddressClass stricter(AddressClass a, AddressClass b) {
    return rank(a) >= rank(b) ? a : b;
}

// True if the first `bits` bits of `a` equal those of `prefix`.
bool has_prefix(const Bytes& a, std::initializer_list<uint8_t> prefix, int bits) {
    const uint8_t* p = prefix.begin();
    for (int i = 0; bits > 0; ++i, bits -= 8) {
        const uint8_t want = i < static_cast<int>(prefix.size()) ? p[i] : 0;
        const uint8_t mask = bits >= 8 ? 0xff : static_cast<uint8_t>(0xff << (8 - bits));
        if ((a[static_cast<size_t>(i)] & mask) != (want & mask)) {
            return false;
        }
    }
    return true;
}

bool all_zero(const Bytes& a, size_t from, size_t to) {
    return std::all_of(a.begin() + static_cast<long>(from), a.begin() + static_cast<long>(to),
                       [](uint8_t b) { return b == 0; });
}

AddressClass classify_v4(uint8_t a, uint8_t b, uint8_t c, uint8_t d) {
    if ((a == 169 && b == 254 && c == 169 && d == 254) ||
        (a == 169 && b == 254 && c == 170 && (d == 2 || d == 23)) ||  // ECS task, EKS Pod Identity
        (a == 169 && b == 254 && c == 0 && d == 23) ||    // Tencent Cloud
        (a == 169 && b == 254 && c == 42 && d == 42) ||   // Scaleway
        (a == 100 && b == 100 && c == 100 && d == 200) ||
        (a == 168 && b == 63 && c == 129 && d == 16)) {  // Azure WireServer
        return AddressClass::Metadata;
    }
    if (a == 0) {
        return AddressClass::Unspecified;
    }
    if (a == 127) {
        return AddressClass::Loopback;
    }
    if (a == 10 || (a == 172 && (b & 0xf0) == 16) || (a == 192 && b == 168)) {
        return AddressClass::Private;
    }
    if (a == 100 && (b & 0xc0) == 64) {
        return AddressClass::CarrierNat;
    }
    if (a == 169 && b == 254) {
        return AddressClass::LinkLocal;
    }
    if ((a & 0xf0) == 224) {
        return AddressClass::Multicast;
    }
    if ((a & 0xf0) == 240) {  // includes 255.255.255.255
        return AddressClass::Reserved;
    }
    if ((a == 192 && b == 0 && c == 0) ||     // IETF protocol assignments
        (a == 192 && b == 0 && c == 2) ||     // TEST-NET-1
        (a == 192 && b == 88 && c == 99) ||   // deprecated 6to4 relay anycast
        (a == 198 && (b & 0xfe) == 18) ||     // benchmarking
        (a == 198 && b == 51 && c == 100) ||  // TEST-NET-2
        (a == 203 && b == 0 && c == 113)) {   // TEST-NET-3
        return AddressClass::Reserved;
    }
    return AddressClass::Public;
}

AddressClass classify_v4(const Bytes& x, size_t at) {
    return classify_v4(x[at], x[at + 1], x[at + 2], x[at + 3]);
}

// The IPv4 address an IPv6 form embeds, if any, and the class of the IPv6 form itself. Most
// forms have one reading; local-use NAT64 has one per prefix length its translator may use.
struct Embedded {
    std::array<IpAddress, 4> v4{};  // v4[0]: the reading allow_networks exceptions key on
    size_t count = 0;
    AddressClass outer = AddressClass::Public;
};

Embedded embedded_v4(const Bytes& x) {
    Embedded e;
    auto take = [&](size_t i0, size_t i1, size_t i2, size_t i3) {
        e.v4[e.count++] = IpAddress::v4(x[i0], x[i1], x[i2], x[i3]);
    };
    if (all_zero(x, 0, 10) && x[10] == 0xff && x[11] == 0xff) {  // ::ffff:0:0/96 mapped
        take(12, 13, 14, 15);
    } else if (all_zero(x, 0, 12)) {  // ::/96 compatible (callers handle :: and ::1)
        take(12, 13, 14, 15);
        e.outer = AddressClass::Reserved;
    } else if (all_zero(x, 0, 8) && x[8] == 0xff && x[9] == 0xff && x[10] == 0 &&
               x[11] == 0) {  // ::ffff:0:0:0/96 SIIT translated
        take(12, 13, 14, 15);
        e.outer = AddressClass::Reserved;
    } else if (has_prefix(x, {0x00, 0x64, 0xff, 0x9b}, 96)) {
        take(12, 13, 14, 15);  // NAT64 well-known prefix 64:ff9b::/96
    } else if (has_prefix(x, {0x00, 0x64, 0xff, 0x9b, 0x00, 0x01}, 48)) {
        // RFC 8215 local-use NAT64 64:ff9b:1::/48. The operator's translator prefix may be any
        // RFC 6052 length carved from the /48, and the address does not say which, so the
        // IPv4 address is read at each layout that fits (byte 8, RFC 6052's "u" octet, is
        // never part of it); classify() takes the strictest reading (fail closed).
        take(6, 7, 9, 10);     // /48 (the key reading, as before)
        take(7, 9, 10, 11);    // /56
        take(9, 10, 11, 12);   // /64
        take(12, 13, 14, 15);  // /96
    } else if (x[0] == 0x20 && x[1] == 0x02) {  // 6to4 2002::/16
        take(2, 3, 4, 5);
    } else if (has_prefix(x, {0x20, 0x01, 0x00, 0x00}, 32)) {  // Teredo: client inverted
        e.v4[e.count++] =
            IpAddress::v4(static_cast<uint8_t>(x[12] ^ 0xff), static_cast<uint8_t>(x[13] ^ 0xff),
                          static_cast<uint8_t>(x[14] ^ 0xff), static_cast<uint8_t>(x[15] ^ 0xff));
    }
    return e;
}

AddressClass classify_v6_outer(const Bytes& x) {
    // IPv6 metadata services, one table: metadata whatever a wider exception says (fe80::/10,
    // fc00::/7), as metadata needs an exception naming it exactly.
    static const Bytes kMetadata[] = {
        {0xfd, 0x00, 0x0e, 0xc2, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0x02, 0x54},  // AWS fd00:ec2::254
        {0xfd, 0x00, 0x0e, 0xc2, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0x23},     // EKS Pod Identity
        {0xfe, 0x80, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xa9, 0xfe, 0xa9, 0xfe},  // OpenStack
        {0xfd, 0x20, 0x00, 0xce, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0x02, 0x54},  // Google fd20:ce::254
        {0xfd, 0x00, 0x00, 0xc1, 0, 0, 0, 0, 0, 0, 0, 0, 0xa9, 0xfe, 0xa9, 0xfe},  // Oracle
        {0xfd, 0x00, 0x00, 0x42, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0x42},     // Scaleway
        {0xfd, 0x00, 0xa9, 0xfe, 0xa9, 0xfe, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0x01},  // Linode
    };
    if (std::find(std::begin(kMetadata), std::end(kMetadata), x) != std::end(kMetadata)) {
        return AddressClass::Metadata;
    }
    if (all_zero(x, 0, 16)) {
        return AddressClass::Unspecified;
    }
    if (all_zero(x, 0, 15) && x[15] == 1) {
        return AddressClass::Loopback;
    }
    if (x[0] == 0xff) {
        return AddressClass::Multicast;
    }
    if (x[0] == 0xfe && (x[1] & 0xc0) == 0x80) {
        return AddressClass::LinkLocal;
    }
    if ((x[0] & 0xfe) == 0xfc) {
        return AddressClass::UniqueLocal;
    }
    if (has_prefix(x, {0x20, 0x01, 0x0d, 0xb8}, 32) ||        // documentation
        has_prefix(x, {0x3f, 0xff}, 20) ||                    // documentation (RFC 9637)
        has_prefix(x, {0x20, 0x01, 0x00, 0x02, 0, 0}, 48) ||  // benchmarking
        has_prefix(x, {0x20, 0x01, 0x00, 0x10}, 28)) {        // deprecated ORCHID
        return AddressClass::Reserved;
    }
    return AddressClass::Public;
}

std::optional<IpAddress> parse_family(const std::string& text, int af) {
    IpAddress ip;
    ip.family = af == AF_INET ? IpAddress::Family::V4 : IpAddress::Family::V6;
    if (inet_pton(af, text.c_str(), ip.bytes.data()) != 1) {
        return std::nullopt;
    }
    return ip;
}

bool exact(const Cidr& c) {
    return c.prefix == (c.base.is_v4() ? 32 : 128);
}

}  // namespace

std::optional<IpAddress> IpAddress::parse(std::string_view text) {
    if (text.find('\0') != std::string_view::npos) {
        return std::nullopt;
    }
    if (text.size() >= 2 && text.front() == '[' && text.back() == ']') {
        text = text.substr(1, text.size() - 2);
        if (text.find(':') == std::string_view::npos) {
            return std::nullopt;  // brackets are for IPv6 only
        }
    }
    const std::string copy(text);
    return parse_family(copy, copy.find(':') != std::string::npos ? AF_INET6 : AF_INET);
}

IpAddress IpAddress::v4(uint8_t a, uint8_t b, uint8_t c, uint8_t d) {
    IpAddress ip;
    ip.family = Family::V4;
    ip.bytes[0] = a;
    ip.bytes[1] = b;
    ip.bytes[2] = c;
    ip.bytes[3] = d;
    return ip;
}

std::string IpAddress::to_string() const {
    char buf[INET6_ADDRSTRLEN] = {};
    const int af = is_v4() ? AF_INET : AF_INET6;
    if (inet_ntop(af, bytes.data(), buf, sizeof(buf)) == nullptr) {
        return {};
    }
    return buf;
}

Result<Cidr> Cidr::parse(std::string_view text) {
    const size_t slash = text.find('/');
    const std::optional<IpAddress> ip = IpAddress::parse(text.substr(0, slash));
    if (!ip) {
        return make_error("invalid address in CIDR \"" + std::string(text) + "\"");
    }
    const int max_prefix = ip->is_v4() ? 32 : 128;
    int prefix = max_prefix;
    if (slash != std::string_view::npos) {
        const std::string_view digits = text.substr(slash + 1);
        if (digits.empty() || digits.size() > 3 ||
            !std::all_of(digits.begin(), digits.end(),
                         [](char c) { return c >= '0' && c <= '9'; })) {
            return make_error("invalid prefix length in CIDR \"" + std::string(text) + "\"");
        }
        prefix = 0;
        for (char c : digits) {
            prefix = prefix * 10 + (c - '0');
        }
        if (prefix > max_prefix) {
            return make_error("prefix length out of range in CIDR \"" + std::string(text) + "\"");
        }
    }
    Cidr c;
    c.base = *ip;
    c.prefix = prefix;
    for (int i = 0; i < 16; ++i) {
        const int bits = std::clamp(prefix - i * 8, 0, 8);
        c.base.bytes[static_cast<size_t>(i)] &= static_cast<uint8_t>(0xff00 >> bits);
    }
    return c;
}

bool Cidr::contains(const IpAddress& ip) const {
    if (ip.family != base.family) {
        return false;
    }
    for (int i = 0; i < 16; ++i) {
        const int bits = std::clamp(prefix - i * 8, 0, 8);
        const auto mask = static_cast<uint8_t>(0xff00 >> bits);
        const size_t k = static_cast<size_t>(i);
        if ((ip.bytes[k] & mask) != base.bytes[k]) {
            return false;
        }
    }
    return true;
}

std::string Cidr::to_string() const {
    return base.to_string() + "/" + std::to_string(prefix);
}

std::string_view to_string(AddressClass c) {
    switch (c) {
        case AddressClass::Public: return "public";
        case AddressClass::Unspecified: return "unspecified";
        case AddressClass::Loopback: return "loopback";
        case AddressClass::Private: return "private";
        case AddressClass::CarrierNat: return "carrier_nat";
        case AddressClass::LinkLocal: return "link_local";
        case AddressClass::UniqueLocal: return "unique_local";
        case AddressClass::Multicast: return "multicast";
        case AddressClass::Reserved: return "reserved";
        case AddressClass::Metadata: return "metadata";
    }
    return "unknown";
}

AddressClass classify(const IpAddress& ip) {
    if (ip.is_v4()) {
        return classify_v4(ip.bytes, 0);
    }
    const AddressClass outer = classify_v6_outer(ip.bytes);
    if (outer != AddressClass::Public) {
        return outer;  // none of these blocks embeds IPv4 (:: and ::1 are not "compatible")
    }
    const Embedded e = embedded_v4(ip.bytes);
    if (e.count > 0) {
        AddressClass cls = e.outer;
        for (size_t i = 0; i < e.count; ++i) {
            cls = stricter(cls, classify_v4(e.v4[i].bytes, 0));
        }
        return cls;
    }
    // Everything else outside global unicast 2000::/3 (the rest of ::/8, 100::/64 discard,
    // 64:ff9b::/16 outside the NAT64 prefixes, 5f00::/16 SRv6, fec0::/10 site-local,
    // unallocated space) is not a destination.
    if ((ip.bytes[0] & 0xe0) != 0x20) {
        return AddressClass::Reserved;
    }
    return AddressClass::Public;
}

AddressVerdict AddressPolicy::vet(const IpAddress& ip) const {
    AddressVerdict v;
    v.cls = classify(ip);
    if (v.cls == AddressClass::Public) {
        v.allowed = true;
        return v;
    }
    // Whether an exception contains `a`; metadata only through one that names it exactly.
    auto excepted = [&](const IpAddress& a, bool metadata) {
        return std::any_of(allow_.begin(), allow_.end(), [&](const Cidr& c) {
            return (!metadata || exact(c)) && c.contains(a);
        });
    };
    const bool metadata = v.cls == AddressClass::Metadata;
    if (excepted(ip, metadata)) {
        v.allowed = true;
        return v;
    }
    // :: and ::1 are IPv6's own unspecified and loopback, not IPv4-compatible forms of
    // 0.0.0.0 / 0.0.0.1: an IPv4 exception such as 0.0.0.0/8 never admits them (found by
    // fuzzing, tests/fuzz/regressions/address).
    const bool v6_special = !ip.is_v4() && all_zero(ip.bytes, 0, 15) && ip.bytes[15] <= 1;
    if (!ip.is_v4() && !v6_special) {
        // Through the embedded IPv4 address: the key reading must be excepted (exactly when
        // the address is metadata), and so must every other reading that is not public
        // (local-use NAT64's other layouts), so that an exception for what one layout reads
        // never admits a denied address another layout reads.
        const Embedded e = embedded_v4(ip.bytes);
        const auto readings = std::span(e.v4).first(e.count);
        if (!readings.empty() && excepted(readings.front(), metadata) &&
            std::all_of(readings.begin() + 1, readings.end(), [&](const IpAddress& a) {
                const AddressClass c = classify_v4(a.bytes, 0);
                return c == AddressClass::Public || excepted(a, c == AddressClass::Metadata);
            })) {
            v.allowed = true;
            return v;
        }
    }
    v.reason = "denied_address:" + std::string(to_string(v.cls));
    return v;
}

}  // namespace egress::policy
