// Fuzz target: address classification (policy/address.h): IpAddress::parse, classify, Cidr
// and AddressPolicy::vet.
//
// Input: lines. The first is an address, the others (at most 8) are allow_networks CIDRs.
// Invariants checked beyond "no sanitizer report":
//   * parse/to_string and Cidr::parse/to_string round-trip; a CIDR's base is masked and
//     contains itself; contains() agrees with a bit-by-bit reading;
//   * DESIGN.md step 8, written independently of classify(): loopback, RFC 1918, CGNAT,
//     link-local, unique-local, unspecified, multicast, reserved 240/4 and the metadata
//     addresses are never Public, nor are their IPv4-mapped/compatible, NAT64, 6to4 and
//     Teredo forms;
//   * vet() allows a non-public address only through an exception containing it (or the
//     IPv4 address it embeds), and a metadata address only through an exact one.
#include <array>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "fuzz_common.h"
#include "policy/address.h"

namespace {

using namespace egress::policy;

/// The IPv4 address an IPv6 form carries (mapped, compatible, SIIT, NAT64, 6to4, Teredo).
std::optional<IpAddress> embedded(const IpAddress& ip) {
    const auto& b = ip.bytes;
    auto zero = [&](size_t from, size_t to) {
        for (size_t i = from; i < to; ++i) {
            if (b[i] != 0) {
                return false;
            }
        }
        return true;
    };
    if (zero(0, 10) && b[10] == 0xff && b[11] == 0xff) {
        return IpAddress::v4(b[12], b[13], b[14], b[15]);  // ::ffff:a.b.c.d
    }
    if (zero(0, 12) && !(zero(12, 15) && b[15] <= 1)) {
        return IpAddress::v4(b[12], b[13], b[14], b[15]);  // ::a.b.c.d (not :: nor ::1)
    }
    if (zero(0, 8) && b[8] == 0xff && b[9] == 0xff && b[10] == 0 && b[11] == 0) {
        return IpAddress::v4(b[12], b[13], b[14], b[15]);  // ::ffff:0:a.b.c.d
    }
    if (b[0] == 0 && b[1] == 0x64 && b[2] == 0xff && b[3] == 0x9b && zero(4, 12)) {
        return IpAddress::v4(b[12], b[13], b[14], b[15]);  // 64:ff9b::/96
    }
    if (b[0] == 0 && b[1] == 0x64 && b[2] == 0xff && b[3] == 0x9b && b[4] == 0 && b[5] == 1) {
        return IpAddress::v4(b[6], b[7], b[9], b[10]);  // 64:ff9b:1::/48 (RFC 6052, /48)
    }
    if (b[0] == 0x20 && b[1] == 0x02) {
        return IpAddress::v4(b[2], b[3], b[4], b[5]);  // 6to4
    }
    if (b[0] == 0x20 && b[1] == 0x01 && b[2] == 0 && b[3] == 0) {  // Teredo, inverted
        return IpAddress::v4(static_cast<uint8_t>(~b[12]), static_cast<uint8_t>(~b[13]),
                             static_cast<uint8_t>(~b[14]), static_cast<uint8_t>(~b[15]));
    }
    return std::nullopt;
}

/// DESIGN.md step 8's denied IPv4 networks, read off the octets (not via classify).
bool denied_v4(const IpAddress& ip) {
    const auto& b = ip.bytes;
    return b[0] == 0 || b[0] == 10 || b[0] == 127 || (b[0] == 169 && b[1] == 254) ||
           (b[0] == 172 && b[1] >= 16 && b[1] <= 31) || (b[0] == 192 && b[1] == 168) ||
           (b[0] == 100 && b[1] >= 64 && b[1] <= 127) || b[0] >= 224 ||
           (b[0] == 100 && b[1] == 100 && b[2] == 100 && b[3] == 200);
}

bool denied_v6_outer(const IpAddress& ip) {
    const auto& b = ip.bytes;
    bool zero15 = true;
    for (size_t i = 0; i < 15; ++i) {
        zero15 = zero15 && b[i] == 0;
    }
    static const std::array<uint8_t, 16> kEc2 = {0xfd, 0x00, 0x0e, 0xc2, 0, 0, 0, 0,
                                                 0,    0,    0,    0,    0, 0, 0x02, 0x54};
    return (zero15 && b[15] <= 1) || b[0] == 0xff || (b[0] == 0xfe && (b[1] & 0xc0) == 0x80) ||
           (b[0] & 0xfe) == 0xfc || b == kEc2;
}

bool is_metadata(const IpAddress& ip) {
    static const auto a = *IpAddress::parse("169.254.169.254");
    static const auto b = *IpAddress::parse("100.100.100.200");
    static const auto c = *IpAddress::parse("fd00:ec2::254");
    static const auto ecs = *IpAddress::parse("169.254.170.2");
    static const auto eks = *IpAddress::parse("169.254.170.23");
    static const auto eks6 = *IpAddress::parse("fd00:ec2::23");
    auto inner = ip.is_v4() ? std::optional<IpAddress>(ip) : embedded(ip);
    return ip == c || ip == eks6 ||
           (inner && (*inner == a || *inner == b || *inner == ecs || *inner == eks));
}

bool bit(const IpAddress& ip, int i) {
    return (ip.bytes[static_cast<size_t>(i / 8)] >> (7 - i % 8)) & 1;
}

bool contains_bitwise(const Cidr& c, const IpAddress& ip) {
    if (c.base.family != ip.family) {
        return false;
    }
    for (int i = 0; i < c.prefix; ++i) {
        if (bit(c.base, i) != bit(ip, i)) {
            return false;
        }
    }
    return true;
}

void check_cidr(const Cidr& c) {
    const int max = c.base.is_v4() ? 32 : 128;
    FUZZ_CHECK(c.prefix >= 0 && c.prefix <= max, c.to_string());
    for (int i = c.prefix; i < max; ++i) {
        FUZZ_CHECK(!bit(c.base, i), "CIDR base not masked: " + c.to_string());
    }
    FUZZ_CHECK(c.contains(c.base), "CIDR does not contain its base: " + c.to_string());
    auto back = Cidr::parse(c.to_string());
    FUZZ_CHECK(back && back->base == c.base && back->prefix == c.prefix,
               "CIDR does not round-trip: " + c.to_string());
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
    std::string_view in(reinterpret_cast<const char*>(data), size);
    std::vector<std::string_view> lines;
    while (lines.size() < 9) {
        const size_t nl = in.find('\n');
        lines.push_back(in.substr(0, nl));
        if (nl == std::string_view::npos) {
            break;
        }
        in.remove_prefix(nl + 1);
    }
    std::vector<Cidr> allow;
    for (size_t i = 1; i < lines.size(); ++i) {
        if (auto c = Cidr::parse(lines[i])) {
            check_cidr(*c);
            allow.push_back(*c);
        }
    }
    auto ip = IpAddress::parse(lines[0]);
    if (!ip) {
        if (auto c = Cidr::parse(lines[0])) {
            check_cidr(*c);
        }
        return 0;
    }
    FUZZ_CHECK(lines[0].find('\0') == std::string_view::npos, "address with NUL accepted");
    auto back = IpAddress::parse(ip->to_string());
    FUZZ_CHECK(back && *back == *ip, "address does not round-trip: " + ip->to_string());

    const AddressClass cls = classify(*ip);
    const std::string text = ip->to_string();
    FUZZ_CHECK(!to_string(cls).empty(), text);
    std::optional<IpAddress> inner = ip->is_v4() ? std::nullopt : embedded(*ip);
    if (ip->is_v4()) {
        FUZZ_CHECK(!denied_v4(*ip) || cls != AddressClass::Public, "public: " + text);
    } else {
        FUZZ_CHECK(!denied_v6_outer(*ip) || cls != AddressClass::Public, "public: " + text);
        if (inner) {
            FUZZ_CHECK(!denied_v4(*inner) || cls != AddressClass::Public,
                       "embedded " + inner->to_string() + " is denied but " + text + " is public");
            const AddressClass ic = classify(*inner);
            FUZZ_CHECK(ic == AddressClass::Public || cls != AddressClass::Public,
                       "embedded form of a denied address is public: " + text);
        }
    }
    FUZZ_CHECK(!is_metadata(*ip) || cls == AddressClass::Metadata, "metadata missed: " + text);

    for (const auto& c : allow) {
        FUZZ_CHECK(c.contains(*ip) == contains_bitwise(c, *ip),
                   c.to_string() + " contains " + text);
    }
    const AddressVerdict none = AddressPolicy().vet(*ip);
    FUZZ_CHECK(none.allowed == (none.cls == AddressClass::Public), "default policy: " + text);
    const AddressVerdict v = AddressPolicy(allow).vet(*ip);
    FUZZ_CHECK(v.cls == cls, "vet and classify disagree: " + text);
    if (!v.allowed) {
        FUZZ_CHECK(v.reason == "denied_address:" + std::string(to_string(cls)), v.reason);
        return 0;
    }
    FUZZ_CHECK(v.reason.empty(), v.reason);
    if (cls == AddressClass::Public) {
        return 0;
    }
    bool justified = false;
    for (const auto& c : allow) {
        const bool exact = c.prefix == (c.base.is_v4() ? 32 : 128);
        const bool hit = c.contains(*ip) || (inner && c.contains(*inner));
        justified = justified || (hit && (cls != AddressClass::Metadata || exact));
    }
    FUZZ_CHECK(justified, "non-public " + text + " allowed without a matching exception");
    return 0;
}
