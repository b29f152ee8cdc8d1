#include "policy/address.h"

#include <gtest/gtest.h>

#include <cstdio>

namespace egress::policy {
namespace {

IpAddress ip(std::string_view text) {
    std::optional<IpAddress> a = IpAddress::parse(text);
    EXPECT_TRUE(a.has_value()) << text;
    return a.value_or(IpAddress{});
}

TEST(IpAddress, Parse) {
    EXPECT_EQ(IpAddress::parse("1.2.3.4"), IpAddress::v4(1, 2, 3, 4));
    EXPECT_TRUE(IpAddress::parse("::1").has_value());
    EXPECT_EQ(IpAddress::parse("[::1]"), IpAddress::parse("::1"));
    EXPECT_FALSE(IpAddress::parse("[1.2.3.4]").has_value());
    for (const char* bad : {"", "1.2.3", "1.2.3.4.5", "256.1.1.1", "01.2.3.4", "0x7f.0.0.1",
                            "2130706433", "::1::2", "fe80::1%eth0", "host", "1.2.3.4 "}) {
        EXPECT_FALSE(IpAddress::parse(bad).has_value()) << bad;
    }
    EXPECT_FALSE(IpAddress::parse(std::string_view("1.2.3.4\0", 8)).has_value());
}

TEST(IpAddress, ToString) {
    EXPECT_EQ(IpAddress::v4(10, 0, 0, 1).to_string(), "10.0.0.1");
    EXPECT_EQ(ip("2001:DB8:0::1").to_string(), "2001:db8::1");
    EXPECT_EQ(ip("::ffff:1.2.3.4").to_string(), "::ffff:1.2.3.4");
}

TEST(Cidr, ParseAndContains) {
    Result<Cidr> c = Cidr::parse("10.1.2.3/8");
    ASSERT_TRUE(c.ok()) << c.error();
    EXPECT_EQ(c->to_string(), "10.0.0.0/8");
    EXPECT_TRUE(c->contains(ip("10.255.0.1")));
    EXPECT_FALSE(c->contains(ip("11.0.0.1")));
    EXPECT_FALSE(c->contains(ip("::ffff:10.0.0.1")));  // families must match

    Result<Cidr> bare = Cidr::parse("127.0.0.1");
    ASSERT_TRUE(bare.ok());
    EXPECT_EQ(bare->prefix, 32);
    EXPECT_TRUE(bare->contains(ip("127.0.0.1")));
    EXPECT_FALSE(bare->contains(ip("127.0.0.2")));

    Result<Cidr> v6 = Cidr::parse("fe80::/10");
    ASSERT_TRUE(v6.ok());
    EXPECT_TRUE(v6->contains(ip("febf::1")));
    EXPECT_FALSE(v6->contains(ip("fec0::1")));
    EXPECT_EQ(Cidr::parse("::1")->prefix, 128);

    Result<Cidr> odd = Cidr::parse("172.16.0.0/12");
    ASSERT_TRUE(odd.ok());
    EXPECT_TRUE(odd->contains(ip("172.31.255.255")));
    EXPECT_FALSE(odd->contains(ip("172.32.0.0")));

    Result<Cidr> all = Cidr::parse("0.0.0.0/0");
    ASSERT_TRUE(all.ok());
    EXPECT_TRUE(all->contains(ip("8.8.8.8")));

    for (const char* bad : {"10.0.0.0/33", "::/129", "10.0.0.0/", "10.0.0.0/x", "10.0.0.0/-1",
                            "nope/8", "10.0.0.0/8/8", "/8"}) {
        EXPECT_FALSE(Cidr::parse(bad).ok()) << bad;
    }
}

struct ClassCase {
    std::string address;
    AddressClass want;
};

class ClassifyTest : public ::testing::TestWithParam<ClassCase> {};

TEST_P(ClassifyTest, Classifies) {
    const ClassCase& c = GetParam();
    EXPECT_EQ(to_string(classify(ip(c.address))), to_string(c.want)) << c.address;
}

// Every denied IPv4 range, with the edge of each range.
const ClassCase kV4Cases[] = {
    {"8.8.8.8", AddressClass::Public},
    {"1.1.1.1", AddressClass::Public},
    {"0.0.0.0", AddressClass::Unspecified},
    {"0.255.255.255", AddressClass::Unspecified},
    {"127.0.0.1", AddressClass::Loopback},
    {"127.255.255.254", AddressClass::Loopback},
    {"10.0.0.1", AddressClass::Private},
    {"10.255.255.255", AddressClass::Private},
    {"172.16.0.1", AddressClass::Private},
    {"172.31.255.255", AddressClass::Private},
    {"172.15.255.255", AddressClass::Public},
    {"172.32.0.0", AddressClass::Public},
    {"192.168.1.1", AddressClass::Private},
    {"100.64.0.1", AddressClass::CarrierNat},
    {"100.127.255.255", AddressClass::CarrierNat},
    {"100.63.255.255", AddressClass::Public},
    {"100.128.0.0", AddressClass::Public},
    {"169.254.0.1", AddressClass::LinkLocal},
    {"169.254.169.254", AddressClass::Metadata},
    {"100.100.100.200", AddressClass::Metadata},
    {"169.254.170.2", AddressClass::Metadata},   // ECS task credentials
    {"169.254.170.23", AddressClass::Metadata},  // EKS Pod Identity agent
    {"169.254.0.23", AddressClass::Metadata},    // Tencent Cloud
    {"169.254.42.42", AddressClass::Metadata},   // Scaleway
    {"169.254.170.3", AddressClass::LinkLocal},
    {"224.0.0.1", AddressClass::Multicast},
    {"239.255.255.255", AddressClass::Multicast},
    {"240.0.0.1", AddressClass::Reserved},
    {"255.255.255.255", AddressClass::Reserved},
    {"192.0.0.8", AddressClass::Reserved},
    {"192.0.2.1", AddressClass::Reserved},
    {"198.18.0.1", AddressClass::Reserved},
    {"198.19.255.255", AddressClass::Reserved},
    {"198.20.0.0", AddressClass::Public},
    {"198.51.100.7", AddressClass::Reserved},
    {"203.0.113.9", AddressClass::Reserved},
    {"192.88.99.1", AddressClass::Reserved},
};
INSTANTIATE_TEST_SUITE_P(V4, ClassifyTest, ::testing::ValuesIn(kV4Cases));

// IPv6 native ranges and IPv6-only reserved blocks.
INSTANTIATE_TEST_SUITE_P(
    V6, ClassifyTest,
    ::testing::Values(
        ClassCase{"2606:4700:4700::1111", AddressClass::Public},
        ClassCase{"2a00:1450:4001:800::200e", AddressClass::Public},
        ClassCase{"::", AddressClass::Unspecified}, ClassCase{"::1", AddressClass::Loopback},
        ClassCase{"fe80::1", AddressClass::LinkLocal},
        ClassCase{"febf:ffff::1", AddressClass::LinkLocal},
        ClassCase{"fc00::1", AddressClass::UniqueLocal},
        ClassCase{"fdff:ffff::1", AddressClass::UniqueLocal},
        ClassCase{"fd00:ec2::254", AddressClass::Metadata},
        ClassCase{"fd20:ce::254", AddressClass::Metadata},          // Google Cloud
        ClassCase{"fd00:c1::a9fe:a9fe", AddressClass::Metadata},    // Oracle Cloud
        ClassCase{"fd00:42::42", AddressClass::Metadata},           // Scaleway
        ClassCase{"fd00:a9fe:a9fe::1", AddressClass::Metadata},     // Linode
        ClassCase{"fd20:ce::255", AddressClass::UniqueLocal},
        ClassCase{"fd00:ec2::23", AddressClass::Metadata},  // EKS Pod Identity agent
        ClassCase{"fd00:ec2::24", AddressClass::UniqueLocal},
        ClassCase{"fe80::a9fe:a9fe", AddressClass::Metadata},  // OpenStack's IPv6 metadata
        ClassCase{"fe80::a9fe:a9ff", AddressClass::LinkLocal},
        ClassCase{"ff02::1", AddressClass::Multicast},
        ClassCase{"2001:db8::1", AddressClass::Reserved},
        ClassCase{"100::1", AddressClass::Reserved},
        ClassCase{"2001:10::1", AddressClass::Reserved},
        ClassCase{"2001:2::1", AddressClass::Reserved},
        ClassCase{"3fff::1", AddressClass::Reserved}, ClassCase{"5f00::1", AddressClass::Reserved},
        ClassCase{"fec0::1", AddressClass::Reserved}, ClassCase{"4000::1", AddressClass::Reserved},
        ClassCase{"::1:2:3:4", AddressClass::Reserved},
        ClassCase{"64:ff9b:2::1", AddressClass::Reserved},
        // SIIT ::ffff:0:0:0/96 is reserved itself, stricter embedded wins.
        ClassCase{"::ffff:0:808:808", AddressClass::Reserved},
        ClassCase{"::ffff:0:7f00:1", AddressClass::Loopback},
        // IPv4-compatible ::/96.
        ClassCase{"::127.0.0.1", AddressClass::Loopback},
        ClassCase{"::8.8.8.8", AddressClass::Reserved},
        ClassCase{"::10.0.0.1", AddressClass::Private},
        // 6to4 and Teredo embed public or private IPv4.
        ClassCase{"2002:808:808::1", AddressClass::Public},
        ClassCase{"2002:7f00:1::1", AddressClass::Loopback},
        ClassCase{"2002:a9fe:a9fe::", AddressClass::Metadata},
        ClassCase{"2001:0:4136:e378:8000:63bf:f7f7:f7f7", AddressClass::Public},
        ClassCase{"2001:0:4136:e378:8000:63bf:80ff:fffe", AddressClass::Loopback},
        ClassCase{"2001:0:4136:e378:8000:63bf:f5ff:fffe", AddressClass::Private},
        // Local-use NAT64 64:ff9b:1::/48 (RFC 8215): the translator's prefix may be any RFC
        // 6052 length carved from the /48, so the IPv4 address is read at every layout that
        // fits (/48: bytes 6,7,9,10; /56: 7,9,10,11; /64: 9-12; /96: 12-15; byte 8 is the u
        // octet) and the strictest class wins.
        ClassCase{"64:ff9b:1:7f00:0:100::", AddressClass::Loopback},     // /48 127.0.0.1
        ClassCase{"64:ff9b:1:a9fe:a9:fe00::", AddressClass::Metadata},   // /48 169.254.169.254
        // A /96 translator at 64:ff9b:1:abcd:ef01::/96: 169.254.169.254 and 127.0.0.1 (the /48
        // reading is 171.205.1.0, public, which is all that was looked at before).
        ClassCase{"64:ff9b:1:abcd:ef01:0:a9fe:a9fe", AddressClass::Metadata},
        ClassCase{"64:ff9b:1:abcd:ef01::7f00:1", AddressClass::Loopback},
        ClassCase{"64:ff9b:1:abcd:0:ef01:a00:1", AddressClass::Private},     // /96 10.0.0.1
        // /56 translator at 64:ff9b:1:1200::/56: 127.0.0.1 and 10.1.2.3.
        ClassCase{"64:ff9b:1:127f:0:1::", AddressClass::Loopback},
        ClassCase{"64:ff9b:1:120a:1:203::", AddressClass::Private},
        // /64 translator at 64:ff9b:1:1234::/64: 127.0.0.1 and 192.168.1.1 (every other
        // layout reads a public address here).
        ClassCase{"64:ff9b:1:1234:7f:0:100:0", AddressClass::Loopback},
        ClassCase{"64:ff9b:1:1234:c0:a801:100:0", AddressClass::Private},
        // 8.8.8.8 in each layout, where every layout reads a public address: public.
        ClassCase{"64:ff9b:1:808:8:808:808:808", AddressClass::Public},    // /48 (all 8.8.8.8)
        ClassCase{"64:ff9b:1:1208:8:808:808:808", AddressClass::Public},   // /56
        ClassCase{"64:ff9b:1:1234:8:808:800:0", AddressClass::Public},     // /64
        ClassCase{"64:ff9b:1:abcd:ef01:0:808:808", AddressClass::Public},  // /96
        // 8.8.8.8 in the /48 layout with the zero suffix RFC 6052 recommends: the /96 layout
        // reads 0.0.0.0, so it is not public (fail closed; name the translator's prefix in
        // allow_networks to reach it).
        ClassCase{"64:ff9b:1:808:8:800::", AddressClass::Unspecified}));

// Every denied IPv4 case again, through the IPv4-mapped and NAT64 /96 forms.
std::vector<ClassCase> embedded_cases() {
    std::vector<ClassCase> out;
    for (const ClassCase& c : kV4Cases) {
        const IpAddress v4 = ip(c.address);
        char nat64[64];
        std::snprintf(nat64, sizeof(nat64), "64:ff9b::%u.%u.%u.%u", v4.bytes[0], v4.bytes[1],
                      v4.bytes[2], v4.bytes[3]);
        out.push_back({"::ffff:" + c.address, c.want});
        out.push_back({nat64, c.want});
    }
    return out;
}
INSTANTIATE_TEST_SUITE_P(Embedded, ClassifyTest, ::testing::ValuesIn(embedded_cases()));

TEST(ClassifyNames, ToString) {
    EXPECT_EQ(to_string(AddressClass::Public), "public");
    EXPECT_EQ(to_string(AddressClass::Loopback), "loopback");
    EXPECT_EQ(to_string(AddressClass::Metadata), "metadata");
    EXPECT_EQ(to_string(AddressClass::CarrierNat), "carrier_nat");
}

std::vector<Cidr> cidrs(std::initializer_list<const char*> texts) {
    std::vector<Cidr> out;
    for (const char* t : texts) {
        Result<Cidr> c = Cidr::parse(t);
        EXPECT_TRUE(c.ok()) << t;
        out.push_back(*c);
    }
    return out;
}

struct VetCase {
    std::vector<std::string> allow;
    std::string address;
    bool allowed;
    std::string reason;
};

class AddressPolicyTest : public ::testing::TestWithParam<VetCase> {};

TEST_P(AddressPolicyTest, Vets) {
    const VetCase& c = GetParam();
    std::vector<Cidr> allow;
    for (const std::string& a : c.allow) {
        Result<Cidr> parsed = Cidr::parse(a);
        ASSERT_TRUE(parsed.ok()) << a;
        allow.push_back(*parsed);
    }
    const AddressVerdict v = AddressPolicy(allow).vet(ip(c.address));
    EXPECT_EQ(v.allowed, c.allowed) << c.address;
    EXPECT_EQ(v.reason, c.reason) << c.address;
}

INSTANTIATE_TEST_SUITE_P(
    Table, AddressPolicyTest,
    ::testing::Values(
        VetCase{{}, "8.8.8.8", true, ""}, VetCase{{}, "2606:4700::1", true, ""},
        VetCase{{}, "127.0.0.1", false, "denied_address:loopback"},
        VetCase{{}, "::1", false, "denied_address:loopback"},
        VetCase{{}, "10.0.0.1", false, "denied_address:private"},
        VetCase{{}, "::ffff:10.0.0.1", false, "denied_address:private"},
        VetCase{{}, "169.254.169.254", false, "denied_address:metadata"},
        VetCase{{}, "fe80::1", false, "denied_address:link_local"},
        VetCase{{"127.0.0.1/32"}, "127.0.0.1", true, ""},
        VetCase{{"127.0.0.1/32"}, "127.0.0.2", false, "denied_address:loopback"},
        VetCase{{"127.0.0.1/32"}, "::ffff:127.0.0.1", true, ""},
        VetCase{{"127.0.0.1/32"}, "64:ff9b::127.0.0.1", true, ""},
        VetCase{{"127.0.0.1/32"}, "::1", false, "denied_address:loopback"},
        // :: and ::1 are not IPv4-compatible 0.0.0.0 / 0.0.0.1 (fuzz regression).
        VetCase{{"0.0.0.0/8"}, "::1", false, "denied_address:loopback"},
        VetCase{{"0.0.0.0/8"}, "::", false, "denied_address:unspecified"},
        VetCase{{"0.0.0.0/8"}, "::0.0.0.2", true, ""},
        VetCase{{"::1"}, "::1", true, ""}, VetCase{{"10.0.0.0/8"}, "10.9.8.7", true, ""},
        VetCase{{"10.0.0.0/8"}, "192.168.0.1", false, "denied_address:private"},
        // Metadata needs an exception that names it exactly.
        VetCase{{"169.254.0.0/16"}, "169.254.169.254", false, "denied_address:metadata"},
        VetCase{{"169.254.0.0/16"}, "169.254.1.1", true, ""},
        VetCase{{"0.0.0.0/0"}, "169.254.169.254", false, "denied_address:metadata"},
        VetCase{{"0.0.0.0/0"}, "100.100.100.200", false, "denied_address:metadata"},
        VetCase{{"169.254.169.254/32"}, "169.254.169.254", true, ""},
        VetCase{{"169.254.169.254/32"}, "::ffff:169.254.169.254", true, ""},
        VetCase{{"fd00::/8"}, "fd00:ec2::254", false, "denied_address:metadata"},
        VetCase{{"fd00::/8"}, "fd20:ce::254", false, "denied_address:metadata"},
        VetCase{{"fc00::/7"}, "fd00:c1::a9fe:a9fe", false, "denied_address:metadata"},
        VetCase{{"169.254.0.0/16"}, "169.254.0.23", false, "denied_address:metadata"},
        VetCase{{"169.254.0.0/16"}, "169.254.42.42", false, "denied_address:metadata"},
        VetCase{{"fd20:ce::254/128"}, "fd20:ce::254", true, ""},
        VetCase{{"fd00:ec2::254/128"}, "fd00:ec2::254", true, ""},
        // AWS container credential endpoints (ECS task role, EKS Pod Identity) are metadata.
        VetCase{{"169.254.0.0/16"}, "169.254.170.2", false, "denied_address:metadata"},
        VetCase{{"169.254.0.0/16"}, "169.254.170.23", false, "denied_address:metadata"},
        VetCase{{"169.254.0.0/16"}, "::ffff:169.254.170.2", false, "denied_address:metadata"},
        VetCase{{"fd00::/8"}, "fd00:ec2::23", false, "denied_address:metadata"},
        VetCase{{"169.254.170.2/32"}, "169.254.170.2", true, ""},
        VetCase{{"fd00:ec2::23/128"}, "fd00:ec2::23", true, ""},
        VetCase{{"fe80::/10"}, "fe80::a9fe:a9fe", false, "denied_address:metadata"},
        VetCase{{"fe80::/10"}, "fe80::1", true, ""},
        VetCase{{"fd00::/8"}, "fd00::1", true, ""},
        VetCase{{"64:ff9b::/96"}, "64:ff9b::169.254.169.254", false, "denied_address:metadata"},
        // Local-use NAT64: an exception for the IPv4 address the /48 layout reads admits the
        // address as before, but only when every other layout that reads a denied address is
        // excepted too; the address itself (or its translator's prefix) may always be named.
        VetCase{{"10.1.2.3/32"}, "64:ff9b:1:a01:2:308:808:808", true, ""},
        VetCase{{}, "64:ff9b:1:a01:2:308:808:808", false, "denied_address:private"},
        VetCase{{"10.0.0.1/32"}, "64:ff9b:1:a00:0:100::", false, "denied_address:private"},
        VetCase{{"10.0.0.1/32", "0.0.0.0/8"}, "64:ff9b:1:a00:0:100::", true, ""},
        VetCase{{"64:ff9b:1::/48"}, "64:ff9b:1:a00:0:100::", true, ""},
        // An exception for what one layout reads never admits what another reads; and since
        // exceptions through the embedded address key on the /48 reading (171.205.1.0 in the
        // /96 examples), a /96 form is admitted by naming it or its prefix, not its IPv4.
        VetCase{{"127.0.0.1/32", "0.0.0.0/8"}, "64:ff9b:1:7f00:0:100:a00:1", false,
                "denied_address:loopback"},
        VetCase{{"127.0.0.1/32", "0.0.0.0/8", "10.0.0.1/32"}, "64:ff9b:1:7f00:0:100:a00:1", true,
                ""},
        VetCase{{"127.0.0.1/32"}, "64:ff9b:1:abcd:ef01::7f00:1", false, "denied_address:loopback"},
        VetCase{{"64:ff9b:1:abcd:ef01::/96"}, "64:ff9b:1:abcd:ef01::7f00:1", true, ""},
        // Metadata in any layout: only an exact exception, never a wider network.
        VetCase{{"169.254.169.254/32"}, "64:ff9b:1:abcd:ef01:0:a9fe:a9fe", false,
                "denied_address:metadata"},
        VetCase{{"64:ff9b:1:abcd:ef01::/96"}, "64:ff9b:1:abcd:ef01:0:a9fe:a9fe", false,
                "denied_address:metadata"},
        VetCase{{"64:ff9b:1:abcd:ef01:0:a9fe:a9fe/128"}, "64:ff9b:1:abcd:ef01:0:a9fe:a9fe", true,
                ""}));

TEST(AddressPolicy, DefaultDeniesEverythingSpecial) {
    const AddressPolicy policy;
    EXPECT_TRUE(policy.allow_networks().empty());
    for (const ClassCase& c : kV4Cases) {
        EXPECT_EQ(policy.vet(ip(c.address)).allowed, c.want == AddressClass::Public) << c.address;
    }
    EXPECT_EQ(cidrs({"127.0.0.1/32"}).size(), 1U);
}

}  // namespace
}  // namespace egress::policy
