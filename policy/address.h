#pragma once
// IP addresses, CIDRs and the classification that decides which addresses egressd may
// connect to. Pure logic, no I/O, no Asio (so it can be fuzzed and table-tested alone).
#include <array>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "common/result.h"

namespace egress::policy {

struct IpAddress {
    enum class Family : uint8_t { V4, V6 };
    Family family = Family::V4;
    std::array<uint8_t, 16> bytes{};  // V4 uses bytes[0..3], network order

    /// Strict parse (inet_pton): "1.2.3.4", "::1", "[::1]" also accepted.
    static std::optional<IpAddress> parse(std::string_view text);
    static IpAddress v4(uint8_t a, uint8_t b, uint8_t c, uint8_t d);
    std::string to_string() const;
    bool is_v4() const { return family == Family::V4; }
    bool operator==(const IpAddress&) const = default;
};

struct Cidr {
    IpAddress base;  // masked
    int prefix = 0;

    /// "10.0.0.0/8", "fe80::/10", or a bare address (= /32 or /128).
    static Result<Cidr> parse(std::string_view text);
    /// Families must match; an IPv4-mapped IPv6 address is not contained in a V4 CIDR.
    bool contains(const IpAddress& ip) const;
    std::string to_string() const;
};

enum class AddressClass : uint8_t {
    Public,
    Unspecified,   // 0.0.0.0/8, ::
    Loopback,      // 127/8, ::1
    Private,       // 10/8, 172.16/12, 192.168/16
    CarrierNat,    // 100.64/10
    LinkLocal,     // 169.254/16, fe80::/10
    UniqueLocal,   // fc00::/7
    Multicast,     // 224/4, ff00::/8
    Reserved,      // 240/4, 255.255.255.255, 192.0.0/24, 192.0.2/24, 198.18/15, 198.51.100/24,
                   // 203.0.113/24, 2001:db8::/32, 100::/64, other IETF special-purpose blocks
    Metadata,      // 169.254.169.254, fd00:ec2::254, fe80::a9fe:a9fe, 100.100.100.200,
                   // 168.63.129.16, and AWS container credentials: 169.254.170.2 (ECS task),
                   // 169.254.170.23 and fd00:ec2::23 (EKS Pod Identity agent)
};

std::string_view to_string(AddressClass c);

/// Classifies an address. IPv6 forms that embed an IPv4 address are classified by the
/// embedded address (the more restrictive of the two wins): IPv4-mapped ::ffff:0:0/96,
/// IPv4-compatible ::/96, NAT64 64:ff9b::/96 and 64:ff9b:1::/48, 6to4 2002::/16 and Teredo
/// 2001::/32 (client address, bits inverted). The local-use NAT64 /48 (RFC 8215) may hold a
/// translator prefix of any RFC 6052 length carved from it, so its IPv4 address is read at
/// the /48, /56, /64 and /96 layouts (skipping the "u" octet, bits 64-71) and the strictest
/// reading wins: the address is public only when every layout reads a public address.
AddressClass classify(const IpAddress& ip);

struct AddressVerdict {
    bool allowed = false;
    AddressClass cls = AddressClass::Public;
    /// "" when allowed, else e.g. "denied_address:loopback".
    std::string reason;
};

/// Vets resolved addresses. Public addresses are allowed; every other class is denied unless
/// the address lies in one of `allow_networks` (named exceptions, e.g. 127.0.0.1/32 for test
/// upstreams). For an IPv6 form embedding IPv4, the exception is checked against the embedded
/// address too; for local-use NAT64 that is the /48 layout's reading, and every other layout
/// whose reading is not public must be excepted as well (an exception for what one layout
/// reads never admits what another reads; naming the IPv6 address or its translator prefix
/// always works). Metadata addresses are allowed only by an exception that names them exactly
/// (/32 or /128), never by a wider network.
class AddressPolicy {
public:
    AddressPolicy() = default;
    explicit AddressPolicy(std::vector<Cidr> allow_networks) : allow_(std::move(allow_networks)) {}
    AddressVerdict vet(const IpAddress& ip) const;
    const std::vector<Cidr>& allow_networks() const { return allow_; }

private:
    std::vector<Cidr> allow_;
};

}  // namespace egress::policy
