// Config loading: defaults, a full round trip, the example configs, and one table row per
// error class, each checking that the message names the YAML path (STYLE.md 15, 19).
#include "proxy/config.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

namespace egress::proxy {
namespace {

using std::chrono::milliseconds;
using std::chrono::seconds;

std::vector<std::string> lines_of(const std::string& text) {
    std::vector<std::string> out;
    std::istringstream in(text);
    for (std::string line; std::getline(in, line);) {
        out.push_back(line);
    }
    return out;
}

bool has_line_starting_with(const std::string& message, const std::string& prefix) {
    for (const auto& line : lines_of(message)) {
        if (line.rfind(prefix, 0) == 0) {
            return true;
        }
    }
    return false;
}

/// The repository root, from this file's path (tests/config/config_test.cc).
std::filesystem::path source_root() {
    std::filesystem::path here(__FILE__);
    if (here.is_relative()) {
        here = std::filesystem::current_path() / here;
    }
    return here.parent_path().parent_path().parent_path();
}

// --- defaults ---------------------------------------------------------------------------

void expect_default(const Config& c) {
    const Config d;
    EXPECT_EQ(c.proxy.to_string(), "127.0.0.1:3128");
    EXPECT_EQ(c.admin.to_string(), "127.0.0.1:9901");
    EXPECT_FALSE(c.transparent.has_value());
    EXPECT_EQ(c.admin_token_file, d.admin_token_file);
    EXPECT_EQ(c.admin_limits.max_body_bytes, 1u << 20);
    EXPECT_EQ(c.admin_limits.max_runs, 10'000u);
    EXPECT_EQ(c.admin_limits.max_pins_per_run, 1'000u);
    EXPECT_EQ(c.admin_limits.max_header_bytes, 16u * 1024);
    EXPECT_EQ(c.admin_limits.read_timeout, milliseconds(30'000));
    EXPECT_EQ(c.admin_limits.write_timeout, milliseconds(5'000));
    EXPECT_EQ(c.admin_limits.max_connections, 128u);
    EXPECT_EQ(c.state_backend, "file");
    EXPECT_EQ(c.state_path, d.state_path);
    EXPECT_EQ(c.etcd.endpoints, d.etcd.endpoints);
    EXPECT_EQ(c.etcd.prefix, d.etcd.prefix);
    EXPECT_EQ(c.etcd.timeout, milliseconds(5'000));
    EXPECT_EQ(c.etcd.lease_grace, std::chrono::seconds(60));
    EXPECT_EQ(c.etcd.max_txn_ops, 128u);
    EXPECT_EQ(c.etcd.ca_file, "system");
    EXPECT_FALSE(c.etcd.cert_file.has_value());
    EXPECT_FALSE(c.etcd.key_file.has_value());
    EXPECT_EQ(c.master_key_file, d.master_key_file);
    EXPECT_FALSE(c.kms_command.has_value());
    EXPECT_EQ(c.upstream_ca_file, "system");
    EXPECT_TRUE(c.resolver_overrides.empty());
    EXPECT_TRUE(c.resolver_servers.empty());
    EXPECT_EQ(c.policy.unpinned, policy::Unpinned::Tunnel);
    EXPECT_TRUE(c.policy.allow_hosts.empty());
    EXPECT_TRUE(c.policy.deny_hosts.empty());
    EXPECT_TRUE(c.policy.websocket);
    EXPECT_EQ(c.policy.allowed_ports, std::vector<uint16_t>{443});
    EXPECT_TRUE(c.allow_networks.empty());
    EXPECT_EQ(c.limits.max_header_bytes, d.limits.max_header_bytes);
    EXPECT_EQ(c.limits.header_timeout, milliseconds(10'000));
    EXPECT_EQ(c.limits.idle_timeout, d.limits.idle_timeout);
    EXPECT_EQ(c.limits.connect_timeout, d.limits.connect_timeout);
    EXPECT_EQ(c.limits.max_dial_addresses, 8u);
    EXPECT_EQ(c.limits.tls_timeout, d.limits.tls_timeout);
    EXPECT_EQ(c.limits.dns_timeout, d.limits.dns_timeout);
    EXPECT_EQ(c.limits.drain_timeout, d.limits.drain_timeout);
    EXPECT_EQ(c.limits.linger_timeout, milliseconds(2'000));
    EXPECT_EQ(c.limits.refusal_timeout, milliseconds(5'000));
    EXPECT_EQ(c.limits.upstream_idle_timeout, milliseconds(30'000));
    EXPECT_EQ(c.limits.scrub_hold_timeout, milliseconds(200));
    EXPECT_EQ(c.limits.h2_connection_window, 0u);  // derived: 4 × h2_stream_window
    EXPECT_EQ(c.limits.connection_window(), 4 * c.limits.h2_stream_window);
    EXPECT_EQ(c.limits.connections_per_run, d.limits.connections_per_run);
    EXPECT_EQ(c.limits.h2_max_concurrent_streams, d.limits.h2_max_concurrent_streams);
    EXPECT_EQ(c.limits.h2_max_concurrent_streams, 100u);
    EXPECT_EQ(c.limits.h2_max_header_list_bytes, 65536u);
    EXPECT_EQ(c.limits.h2_max_header_fields, 100u);
    EXPECT_EQ(c.limits.max_header_fields, 100u);
    EXPECT_EQ(c.limits.max_unidentified_connections, 1024u);
    EXPECT_EQ(c.limits.h2_max_continuations, 8u);
    EXPECT_EQ(c.limits.h2_stream_reset_burst, 200u);
    EXPECT_EQ(c.limits.h2_stream_reset_rate, 33u);
    EXPECT_EQ(c.limits.h2_max_premature_resets, 100u);
    EXPECT_EQ(c.limits.h2_control_frame_burst, 1000u);
    EXPECT_EQ(c.limits.h2_max_outbound_ack, 100u);
    EXPECT_EQ(c.limits.h2_max_settings, 32u);
    EXPECT_EQ(c.limits.h2_stream_window, 262144u);
    EXPECT_EQ(c.limits.h2_settings_timeout, milliseconds(10'000));
    EXPECT_EQ(c.limits.leaf_cache_size, d.limits.leaf_cache_size);
    EXPECT_EQ(c.limits.static_ca_validity, std::chrono::hours(24 * 365));
    EXPECT_EQ(c.limits.max_upstream_idle_per_host, d.limits.max_upstream_idle_per_host);
    EXPECT_EQ(c.limits.upstream_tls_sessions, 1024u);
    EXPECT_EQ(c.limits.retry_body_bytes, 65536u);
    EXPECT_EQ(c.limits.sign_body_bytes, 1u << 20);
    EXPECT_EQ(c.limits.method_body_bytes, 1u << 20);
    EXPECT_EQ(c.limits.worker_threads, 0u);  // one per usable CPU
    EXPECT_EQ(c.audit.path, "var/audit.jsonl");
    EXPECT_FALSE(c.audit.durable);
    EXPECT_EQ(c.log_level, "info");
    EXPECT_TRUE(c.runs.empty());
}

TEST(ConfigDefaults, EmptyDocumentsGiveTheStructDefaults) {
    for (const char* text : {"{}", "{}  # all the defaults\n", "---\n{}\n",
                             "listen:\nlimits:\nruns:\n", "policy: {}\nruns: []\n"}) {
        SCOPED_TRACE(text);
        auto c = parse_config(text, "t.yaml");
        ASSERT_TRUE(c.ok()) << c.error();
        expect_default(*c);
        EXPECT_EQ(c->source, "t.yaml");
    }
}

TEST(ConfigDefaults, AnEmptyFileIsRefused) {
    // What a reload reads while an editor has truncated the file: as all the defaults it
    // dropped every static run. An explicit {} still means all the defaults (above).
    for (const char* text : {"", "\n", "  \n\t\n", "# only a comment\n", "# a\n\n# b\n",
                             "---\n", "--- # x\n...\n", "~\n", "null\n"}) {
        SCOPED_TRACE(text);
        auto c = parse_config(text, "t.yaml");
        ASSERT_FALSE(c.ok());
        EXPECT_EQ(c.error(), "t.yaml: config is empty (write {} for all the defaults)");
    }
}

TEST(ConfigDefaults, AnEmptyFileOnDiskIsRefused) {
    const std::string path = testing::TempDir() + "/empty-config.yaml";
    std::ofstream(path) << "# all commented out\n";
    auto c = load_config_file(path);
    std::remove(path.c_str());
    ASSERT_FALSE(c.ok());
    EXPECT_EQ(c.error(), path + ": config is empty (write {} for all the defaults)");
}

// --- full round trip --------------------------------------------------------------------

constexpr const char* kFull = R"(
listen:
  proxy: 0.0.0.0:0
  admin: unix:/run/egressd/admin.sock
  transparent: "[::1]:3129"
admin:
  token_file: /etc/egressd/admin.token
  max_body_bytes: 65536
  max_header_bytes: 4096
  read_timeout: 3s
  write_timeout: 250ms
  max_connections: 9
  max_runs: 50
  max_pins_per_run: 7
state:
  backend: etcd
  path: /var/lib/egressd
  etcd: {endpoints: [https://10.0.0.1:2379, http://10.0.0.2:2379], prefix: /e/, timeout: 750ms,
         lease_grace: 2m, max_txn_ops: 1024, ca_file: /etc/egressd/etcd-ca.pem,
         cert_file: /etc/egressd/etcd.pem,
         key_file: /etc/egressd/etcd.key}
keys:
  master_key_file: /etc/egressd/master.key
  kms_command: /usr/bin/unwrap-key
upstream:
  ca_file: /etc/egressd/upstream-ca.pem
resolver:
  overrides:
    API.Example.TEST.: [127.0.0.1, "::1"]
  servers: [127.0.0.1:5353, 10.0.0.53, "[::1]:53"]
policy:
  unpinned: intercept
  allow_hosts: [pypi.org, "*.s3.amazonaws.com", "files.example.test:8443"]
  deny_hosts: ["*.internal", "private.s3.amazonaws.com"]
  websocket: false
  allow_networks: [127.0.0.1/32, "fd00::/8"]
  allowed_ports: [443, 8443]
limits:
  max_header_bytes: 32768
  header_timeout: 500ms
  idle_timeout: 2m
  connect_timeout: 3
  max_dial_addresses: 3
  tls_timeout: 4s
  dns_timeout: 1s
  drain_timeout: 1h
  linger_timeout: 750ms
  refusal_timeout: 1500ms
  upstream_idle_timeout: 4s
  scrub_hold_timeout: 50ms
  connections_per_run: 64
  h2_max_concurrent_streams: 50
  h2_max_header_list_bytes: 16384
  h2_max_header_fields: 40
  max_header_fields: 30
  max_unidentified_connections: 64
  h2_max_continuations: 2
  h2_stream_reset_burst: 50
  h2_stream_reset_rate: 10
  h2_max_premature_resets: 20
  h2_control_frame_burst: 100
  h2_max_outbound_ack: 10
  h2_max_settings: 16
  h2_stream_window: 65536
  h2_connection_window: 131072
  h2_settings_timeout: 2s
  static_ca_validity: 720h
  leaf_cache_size: 16
  leaf_mints_per_minute: 120
  max_upstream_idle_per_host: 0
  upstream_tls_sessions: 0
  retry_body_bytes: 0
  sign_body_bytes: 4096
  method_body_bytes: 2048
  worker_threads: 3
audit:
  path: "-"
  durable: true
log:
  level: debug
runs:
  - id: app-1
    token_file: /etc/egressd/app.token
    ttl: 30m
    sources: [10.1.0.0/16]
    allow_hosts: [example.org]
    scope: {org: acme, project: web, workflow: nightly}
    pins:
      - host: api.github.com
        secret_file: /run/secrets/gh
        inject: {type: bearer}
        path_prefixes: [/repos/acme/]
        methods: [get, Post]
      - host: registry.example.test:8443
        secret: npm_token
        inject: {type: basic, username: ci}
        headers: {X-Registry-Client: egressd, Accept: application/json}
      - host: "*.api.example.test"
        secret: key
        inject: {type: header, name: X-Api-Key, template: "Token {secret}"}
      - host: "*.s3.amazonaws.com"
        secret: aws_secret_key
        inject: {type: aws-sigv4, access_key_id: AKIAIOSFODNN7EXAMPLE, region: eu-west-1,
                 service: s3}
      - host: sts.amazonaws.com
        secret: aws_role_credentials
        inject: {type: aws-sigv4, region: us-east-1, service: sts}
  - id: other.run_2
    token_file: /etc/egressd/other.token
    ttl: null
    ca_cert_out: /tmp/other-ca.pem
    ca_bundle_out: /tmp/other-bundle.pem
)";

TEST(ConfigParse, FullConfigRoundTrip) {
    auto r = parse_config(kFull, "full.yaml");
    ASSERT_TRUE(r.ok()) << r.error();
    const Config& c = *r;
    EXPECT_EQ(c.proxy.host, "0.0.0.0");
    EXPECT_EQ(c.proxy.port, 0);
    EXPECT_TRUE(c.admin.is_unix());
    EXPECT_EQ(c.admin.unix_path, "/run/egressd/admin.sock");
    EXPECT_EQ(c.admin.to_string(), "unix:/run/egressd/admin.sock");
    ASSERT_TRUE(c.transparent.has_value());
    EXPECT_EQ(c.transparent->host, "::1");
    EXPECT_EQ(c.transparent->port, 3129);
    EXPECT_EQ(c.transparent->to_string(), "[::1]:3129");
    EXPECT_EQ(c.admin_token_file, "/etc/egressd/admin.token");
    EXPECT_EQ(c.admin_limits.max_body_bytes, 65536u);
    EXPECT_EQ(c.admin_limits.max_header_bytes, 4096u);
    EXPECT_EQ(c.admin_limits.read_timeout, milliseconds(3'000));
    EXPECT_EQ(c.admin_limits.write_timeout, milliseconds(250));
    EXPECT_EQ(c.admin_limits.max_connections, 9u);
    EXPECT_EQ(c.admin_limits.max_runs, 50u);
    EXPECT_EQ(c.admin_limits.max_pins_per_run, 7u);
    EXPECT_EQ(c.state_backend, "etcd");
    EXPECT_EQ(c.state_path, "/var/lib/egressd");
    EXPECT_EQ(c.etcd.endpoints,
              (std::vector<std::string>{"https://10.0.0.1:2379", "http://10.0.0.2:2379"}));
    EXPECT_EQ(c.etcd.prefix, "/e/");
    EXPECT_EQ(c.etcd.timeout, milliseconds(750));
    EXPECT_EQ(c.etcd.lease_grace, std::chrono::seconds(120));
    EXPECT_EQ(c.etcd.max_txn_ops, 1024u);
    EXPECT_EQ(c.etcd.ca_file, "/etc/egressd/etcd-ca.pem");
    EXPECT_EQ(c.etcd.cert_file, "/etc/egressd/etcd.pem");
    EXPECT_EQ(c.etcd.key_file, "/etc/egressd/etcd.key");
    EXPECT_EQ(c.master_key_file, "/etc/egressd/master.key");
    EXPECT_EQ(c.kms_command, "/usr/bin/unwrap-key");
    EXPECT_EQ(c.upstream_ca_file, "/etc/egressd/upstream-ca.pem");

    ASSERT_EQ(c.resolver_overrides.size(), 1u);
    auto it = c.resolver_overrides.find("api.example.test");
    ASSERT_NE(it, c.resolver_overrides.end());
    ASSERT_EQ(it->second.size(), 2u);
    EXPECT_EQ(it->second[0], policy::IpAddress::v4(127, 0, 0, 1));
    EXPECT_FALSE(it->second[1].is_v4());
    EXPECT_EQ(c.resolver_servers,
              (std::vector<std::string>{"127.0.0.1:5353", "10.0.0.53", "[::1]:53"}));

    EXPECT_EQ(c.policy.unpinned, policy::Unpinned::Intercept);
    EXPECT_FALSE(c.policy.websocket);
    ASSERT_EQ(c.policy.deny_hosts.size(), 2u);
    EXPECT_TRUE(c.policy.deny_hosts[0].matches_host("metadata.google.internal"));  // any depth
    EXPECT_TRUE(c.policy.deny_hosts[0].matches_host("a.internal"));
    EXPECT_FALSE(c.policy.deny_hosts[0].matches_host("internal"));
    EXPECT_TRUE(c.policy.deny_hosts[1].matches_host("private.s3.amazonaws.com"));
    EXPECT_FALSE(c.policy.deny_hosts[1].matches_host("public.s3.amazonaws.com"));
    ASSERT_EQ(c.policy.allow_hosts.size(), 3u);
    EXPECT_TRUE(c.policy.allow_hosts[1].wildcard());
    EXPECT_EQ(c.policy.allow_hosts[2].port(), 8443);
    ASSERT_EQ(c.allow_networks.size(), 2u);
    EXPECT_EQ(c.allow_networks[0].prefix, 32);
    EXPECT_EQ(c.allow_networks[1].prefix, 8);
    EXPECT_EQ(c.policy.allowed_ports, (std::vector<uint16_t>{443, 8443}));

    EXPECT_EQ(c.limits.max_header_bytes, 32768u);
    EXPECT_EQ(c.limits.header_timeout, milliseconds(500));
    EXPECT_EQ(c.limits.idle_timeout, milliseconds(120'000));
    EXPECT_EQ(c.limits.connect_timeout, milliseconds(3'000));
    EXPECT_EQ(c.limits.max_dial_addresses, 3u);
    EXPECT_EQ(c.limits.tls_timeout, milliseconds(4'000));
    EXPECT_EQ(c.limits.dns_timeout, milliseconds(1'000));
    EXPECT_EQ(c.limits.drain_timeout, milliseconds(3'600'000));
    EXPECT_EQ(c.limits.linger_timeout, milliseconds(750));
    EXPECT_EQ(c.limits.refusal_timeout, milliseconds(1'500));
    EXPECT_EQ(c.limits.upstream_idle_timeout, milliseconds(4'000));
    EXPECT_EQ(c.limits.scrub_hold_timeout, milliseconds(50));
    EXPECT_EQ(c.limits.connection_window(), 131072u);
    EXPECT_EQ(c.limits.connections_per_run, 64u);
    EXPECT_EQ(c.limits.h2_max_concurrent_streams, 50u);
    EXPECT_EQ(c.limits.h2_max_header_list_bytes, 16384u);
    EXPECT_EQ(c.limits.h2_max_header_fields, 40u);
    EXPECT_EQ(c.limits.max_header_fields, 30u);
    EXPECT_EQ(c.limits.max_unidentified_connections, 64u);
    EXPECT_EQ(c.limits.h2_max_continuations, 2u);
    EXPECT_EQ(c.limits.h2_stream_reset_burst, 50u);
    EXPECT_EQ(c.limits.h2_stream_reset_rate, 10u);
    EXPECT_EQ(c.limits.h2_max_premature_resets, 20u);
    EXPECT_EQ(c.limits.h2_control_frame_burst, 100u);
    EXPECT_EQ(c.limits.h2_max_outbound_ack, 10u);
    EXPECT_EQ(c.limits.h2_max_settings, 16u);
    EXPECT_EQ(c.limits.h2_stream_window, 65536u);
    EXPECT_EQ(c.limits.h2_settings_timeout, milliseconds(2'000));
    EXPECT_EQ(c.limits.static_ca_validity, std::chrono::hours(720));
    EXPECT_EQ(c.limits.leaf_cache_size, 16u);
    EXPECT_EQ(c.limits.leaf_mints_per_minute, 120u);
    EXPECT_EQ(c.limits.max_upstream_idle_per_host, 0u);
    EXPECT_EQ(c.limits.upstream_tls_sessions, 0u);
    EXPECT_EQ(c.limits.retry_body_bytes, 0u);
    EXPECT_EQ(c.limits.sign_body_bytes, 4096u);
    EXPECT_EQ(c.limits.method_body_bytes, 2048u);
    EXPECT_EQ(c.limits.worker_threads, 3u);
    EXPECT_EQ(c.audit.path, "-");
    EXPECT_TRUE(c.audit.durable);
    EXPECT_EQ(c.log_level, "debug");

    ASSERT_EQ(c.runs.size(), 2u);
    const RunConfig& a = c.runs[0];
    EXPECT_EQ(a.id, "app-1");
    EXPECT_EQ(a.yaml_path, "runs[0]");
    EXPECT_EQ(a.token_file, "/etc/egressd/app.token");
    EXPECT_EQ(a.ttl, seconds(1800));
    EXPECT_EQ(a.ca_cert_out, "var/run-app-1-ca.pem");  // default
    ASSERT_EQ(a.sources.size(), 1u);
    EXPECT_EQ(a.sources[0].prefix, 16);
    ASSERT_EQ(a.allow_hosts.size(), 1u);
    ASSERT_TRUE(a.scope.has_value());
    EXPECT_EQ(a.scope->to_string(), "org=acme,project=web,workflow=nightly");
    EXPECT_FALSE(c.runs[1].scope.has_value());
    ASSERT_EQ(a.pins.size(), 5u);

    const PinConfig& bearer = a.pins[0];
    EXPECT_EQ(bearer.yaml_path, "runs[0].pins[0]");
    EXPECT_TRUE(bearer.host.matches_host("api.github.com"));
    EXPECT_EQ(bearer.secret_file, "/run/secrets/gh");
    EXPECT_TRUE(bearer.secret.empty());
    EXPECT_EQ(bearer.inject.type, policy::InjectType::Bearer);
    EXPECT_EQ(bearer.path_prefixes, std::vector<std::string>{"/repos/acme/"});
    EXPECT_EQ(bearer.methods, (std::vector<std::string>{"GET", "POST"}));

    const PinConfig& basic = a.pins[1];
    EXPECT_EQ(basic.host.port(), 8443);
    EXPECT_EQ(basic.secret, "npm_token");
    EXPECT_TRUE(basic.secret_file.empty());
    EXPECT_EQ(basic.inject.type, policy::InjectType::Basic);
    EXPECT_EQ(basic.inject.username, "ci");
    ASSERT_EQ(basic.extra_headers.size(), 2u);  // document order, names lowercased
    EXPECT_EQ(basic.extra_headers[0].name, "x-registry-client");
    EXPECT_EQ(basic.extra_headers[0].value, "egressd");
    EXPECT_EQ(basic.extra_headers[1].name, "accept");
    EXPECT_EQ(basic.extra_headers[1].value, "application/json");
    EXPECT_TRUE(bearer.extra_headers.empty());

    const PinConfig& header = a.pins[2];
    EXPECT_TRUE(header.host.wildcard());
    EXPECT_EQ(header.inject.type, policy::InjectType::Header);
    EXPECT_EQ(header.inject.header_name, "x-api-key");  // lowercased by validate_injection
    EXPECT_EQ(header.inject.value_template, "Token {secret}");

    const PinConfig& aws = a.pins[3];
    EXPECT_EQ(aws.inject.type, policy::InjectType::AwsSigV4);
    EXPECT_EQ(aws.inject.access_key_id, "AKIAIOSFODNN7EXAMPLE");
    EXPECT_EQ(aws.inject.region, "eu-west-1");
    EXPECT_EQ(aws.inject.service, "s3");
    const PinConfig& role = a.pins[4];  // a credentials document as the secret
    EXPECT_EQ(role.inject.type, policy::InjectType::AwsSigV4);
    EXPECT_TRUE(role.inject.access_key_id.empty());
    EXPECT_EQ(role.inject.service, "sts");

    const RunConfig& b = c.runs[1];
    EXPECT_EQ(b.id, "other.run_2");
    EXPECT_FALSE(b.ttl.has_value());
    EXPECT_EQ(b.ca_cert_out, "/tmp/other-ca.pem");
    EXPECT_EQ(b.ca_bundle_out, "/tmp/other-bundle.pem");
    EXPECT_TRUE(c.runs[0].ca_bundle_out.empty());  // not written unless asked for
    EXPECT_TRUE(b.pins.empty());
}

// limits.scrub_hold_timeout may be 0 (the strict mode: held bytes wait for the next piece).
TEST(ConfigParse, ScrubHoldTimeoutMayBeZero) {
    for (const char* zero : {"0", "0ms", "0s"}) {
        auto r = parse_config(std::string("limits: {scrub_hold_timeout: ") + zero + "}\n", "t");
        ASSERT_TRUE(r.ok()) << zero << ": " << r.error();
        EXPECT_EQ(r.value().limits.scrub_hold_timeout, milliseconds(0));
    }
}

TEST(ConfigParse, CaBundleOutIsNotTheCaFile) {
    auto r = parse_config(R"(
runs:
  - id: app
    token_file: null
    ca_cert_out: var/app-ca.pem
    ca_bundle_out: var/./app-ca.pem
)",
                          "t");
    ASSERT_FALSE(r.ok());
    EXPECT_NE(r.error().find("runs[0].ca_bundle_out: names the same file as ca_cert_out"),
              std::string::npos)
        << r.error();
}

TEST(ConfigParse, SingleRunWithoutTokenFileAndDefaults) {
    auto r = parse_config(R"(
runs:
  - id: app
    token_file: null
    pins:
      - host: api.test
        secret_file: s
        inject: {type: header, name: X-Key}
)",
                          "t");
    ASSERT_TRUE(r.ok()) << r.error();
    ASSERT_EQ(r->runs.size(), 1u);
    EXPECT_FALSE(r->runs[0].token_file.has_value());
    EXPECT_FALSE(r->runs[0].ttl.has_value());
    EXPECT_EQ(r->runs[0].ca_cert_out, "var/run-app-ca.pem");
    EXPECT_EQ(r->runs[0].pins[0].inject.value_template, "{secret}");
}

// --- durations --------------------------------------------------------------------------

TEST(ParseDuration, Table) {
    struct Row {
        const char* text;
        long long ms;  // -1: error
    };
    const Row rows[] = {
        {"500ms", 500}, {"10s", 10'000}, {"2m", 120'000}, {"1h", 3'600'000},
        {"7", 7'000},   {"0s", 0},       {"0", 0},        {"87600h", 87600LL * 3600000},
        {"", -1},       {"s", -1},       {"10 s", -1},    {"10 parsecs", -1},
        {"-5s", -1},    {"+5s", -1},     {"1.5s", -1},    {"10S", -1},
        {"1d", -1},     {" 10s", -1},    {"10s ", -1},    {"1000000000h", -1},
        {"10msec", -1}, {"5mm", -1},     {"0x10", -1},
    };
    // Over ten years: refused (steady_clock's now() + d would wrap past ~292 years and fire at
    // once), a message of its own.
    for (const char* too_long : {"87601h", "999999999h", "5256001m", "315360001s"}) {
        auto d = parse_duration(too_long);
        ASSERT_FALSE(d.ok()) << too_long;
        EXPECT_EQ(d.error(), "duration '" + std::string(too_long) +
                                 "' is over the longest allowed, 87600h");
    }
    for (const auto& row : rows) {
        SCOPED_TRACE(row.text);
        auto d = parse_duration(row.text);
        if (row.ms < 0) {
            ASSERT_FALSE(d.ok());
            EXPECT_EQ(d.error(), "bad duration '" + std::string(row.text) +
                                     "' (expected e.g. 500ms, 10s, 2m, 1h)");
        } else {
            ASSERT_TRUE(d.ok()) << d.error();
            EXPECT_EQ(d->count(), row.ms);
        }
    }
}

// --- listen addresses -------------------------------------------------------------------

TEST(ConfigParse, ListenAddresses) {
    struct Row {
        const char* key;
        const char* value;
        const char* expect;  // to_string() on success, or the error's first line
    };
    const Row rows[] = {
        {"proxy", "127.0.0.1:3128", "127.0.0.1:3128"},
        {"proxy", "0.0.0.0:0", "0.0.0.0:0"},
        {"proxy", "'[::1]:3128'", "[::1]:3128"},
        {"admin", "unix:/tmp/egressd.sock", "unix:/tmp/egressd.sock"},
        {"transparent", "127.0.0.1:3129", "127.0.0.1:3129"},
        {"proxy", "3128", "listen.proxy: expected host:port"},
        {"proxy", "localhost:3128", "listen.proxy: host must be an IP address"},
        {"proxy", "'::1:3128'", "listen.proxy: expected host:port"},
        {"proxy", "127.0.0.1:65536", "listen.proxy: bad port '65536'"},
        {"proxy", "'127.0.0.1:'", "listen.proxy: bad port ''"},
        {"proxy", "127.0.0.1:http", "listen.proxy: bad port 'http'"},
        {"proxy", "unix:/tmp/p.sock", "listen.proxy: unix sockets are only supported"},
        {"transparent", "unix:/tmp/p.sock", "listen.transparent: unix sockets are only"},
        {"admin", "'unix:'", "listen.admin: expected unix:/path.sock"},
        {"admin", "[1, 2]", "listen.admin: expected a string, got a list"},
        {"admin", "null", "listen.admin: expected a string, got null"},
    };
    for (const auto& row : rows) {
        std::string yaml = std::string("listen:\n  ") + row.key + ": " + row.value + "\n";
        SCOPED_TRACE(yaml);
        auto r = parse_config(yaml, "t");
        std::string expect = row.expect;
        if (expect.rfind("listen.", 0) == 0) {
            ASSERT_FALSE(r.ok());
            EXPECT_EQ(lines_of(r.error())[0].rfind(expect, 0), 0u) << r.error();
            continue;
        }
        ASSERT_TRUE(r.ok()) << r.error();
        std::string key = row.key;
        const ListenAddress& got = key == "proxy"   ? r->proxy
                                   : key == "admin" ? r->admin
                                                    : *r->transparent;
        EXPECT_EQ(got.to_string(), expect);
    }
}

TEST(ConfigParse, ListenAdvertise) {
    struct Row {
        const char* value;
        const char* expect;  // the stored authority, or the error's first line
    };
    const Row rows[] = {
        {"egressd-gateway.default.svc.cluster.local:3128",
         "egressd-gateway.default.svc.cluster.local:3128"},
        {"EgressD.Example.:3128", "egressd.example:3128"},
        {"10.0.0.5:3128", "10.0.0.5:3128"},
        {"'[fd00::5]:3128'", "[fd00::5]:3128"},
        {"'[::1]:3128'", "[::1]:3128"},
        {"egressd.svc", "listen.advertise: expected host:port that sandboxes connect to"},
        {"egressd.svc:0", "listen.advertise: expected host:port"},
        {"egressd.svc:70000", "listen.advertise: expected host:port"},
        {"'user@egressd.svc:3128'", "listen.advertise: expected host:port"},
        {"'http://egressd.svc:3128'", "listen.advertise: expected host:port"},
        {"0.0.0.0:3128", "listen.advertise: unspecified address '0.0.0.0'"},
        {"'[::]:3128'", "listen.advertise: unspecified address '::'"},
        {"[1, 2]", "listen.advertise: expected a string, got a list"},
    };
    for (const auto& row : rows) {
        std::string yaml = std::string("listen:\n  advertise: ") + row.value + "\n";
        SCOPED_TRACE(yaml);
        auto r = parse_config(yaml, "t");
        std::string expect = row.expect;
        if (expect.rfind("listen.", 0) == 0) {
            ASSERT_FALSE(r.ok());
            EXPECT_EQ(lines_of(r.error())[0].rfind(expect, 0), 0u) << r.error();
            continue;
        }
        ASSERT_TRUE(r.ok()) << r.error();
        ASSERT_TRUE(r->advertise.has_value());
        EXPECT_EQ(*r->advertise, expect);
    }
    auto unset = parse_config("listen:\n  advertise: null\n", "t");
    ASSERT_TRUE(unset.ok()) << unset.error();
    EXPECT_FALSE(unset->advertise.has_value());
}

TEST(ConfigParse, ProxyAuthorityOfANewRun) {
    // listen.advertise wins; else the listener's address, loopback for an unspecified bind,
    // an IPv6 host bracketed (and only then).
    EXPECT_EQ(proxy_authority(std::string("gw.example:3128"), "0.0.0.0", 4000),
              "gw.example:3128");
    EXPECT_EQ(proxy_authority(std::nullopt, "0.0.0.0", 4000), "127.0.0.1:4000");
    EXPECT_EQ(proxy_authority(std::nullopt, "::", 4000), "[::1]:4000");
    EXPECT_EQ(proxy_authority(std::nullopt, "127.0.0.1", 4000), "127.0.0.1:4000");
    EXPECT_EQ(proxy_authority(std::nullopt, "::1", 4000), "[::1]:4000");
    EXPECT_EQ(proxy_authority(std::nullopt, "10.1.2.3", 3128), "10.1.2.3:3128");
    EXPECT_EQ(proxy_authority(std::nullopt, "fd00::5", 3128), "[fd00::5]:3128");
}

TEST(ConfigParse, ListenersMustNotCollide) {
    auto r = parse_config("listen: {proxy: 127.0.0.1:9000, admin: 127.0.0.1:9000}\n", "t");
    ASSERT_FALSE(r.ok());
    EXPECT_TRUE(has_line_starting_with(r.error(), "listen.admin: same address as listen.proxy"));
    // Port 0 means "any free port", so two of them never collide.
    EXPECT_TRUE(parse_config("listen: {proxy: 127.0.0.1:0, admin: 127.0.0.1:0}\n", "t").ok());
}

// --- one row per error class ------------------------------------------------------------

/// A minimal valid run with one pin; `pin_extra` replaces the pin body after its host.
std::string run_with_pin(const std::string& pin_body) {
    return "runs:\n  - id: app\n    token_file: t\n    pins:\n      - host: api.test\n" + pin_body;
}

struct ErrorRow {
    const char* name;
    std::string yaml;
    std::string line_prefix;  // some line of the message starts with this
};

class ConfigErrors : public testing::TestWithParam<ErrorRow> {};

TEST_P(ConfigErrors, MessageNamesThePath) {
    const ErrorRow& row = GetParam();
    SCOPED_TRACE(row.yaml);
    auto r = parse_config(row.yaml, "test.yaml");
    ASSERT_FALSE(r.ok());
    EXPECT_TRUE(has_line_starting_with(r.error(), row.line_prefix))
        << "message:\n"
        << r.error() << "\nwanted a line starting with: " << row.line_prefix;
}

const ErrorRow kErrorRows[] = {
    // unknown keys, at each level
    {"UnknownTopLevelKey", "listne: {proxy: 127.0.0.1:1}\n",
     "listne: unknown key (expected listen, admin, state"},
    {"UnknownNestedKey", "limits:\n  header_timeuot: 5s\n", "limits.header_timeuot: unknown key"},
    {"UnknownEtcdKey", "state: {etcd: {endpoint: [http://x]}}\n",
     "state.etcd.endpoint: unknown key"},
    {"EtcdCertWithoutKey",
     "state: {backend: etcd, etcd: {endpoints: [https://10.0.0.2:2379], cert_file: /c.pem}}\n",
     "state.etcd.key_file: must be set with etcd.cert_file"},
    {"EtcdKeyWithoutCert",
     "state: {backend: etcd, etcd: {endpoints: [https://10.0.0.2:2379], key_file: /c.key}}\n",
     "state.etcd.cert_file: must be set with etcd.key_file"},
    {"EtcdClientCertWithoutTls",
     "state: {backend: etcd, etcd: {endpoints: [http://10.0.0.2:2379], cert_file: /c.pem, "
     "key_file: /c.key}}\n",
     "state.etcd.cert_file: is set but no state.etcd.endpoints entry is https://"},
    {"EtcdEmptyCaFile", "state: {etcd: {ca_file: ''}}\n", "state.etcd.ca_file: must not be empty"},
    {"EtcdEmptyPrefix", "state: {backend: etcd, etcd: {prefix: ''}}\n",
     "state.etcd.prefix: must not be empty"},
    {"EtcdTimeoutTooShort", "state: {etcd: {timeout: 10ms}}\n",
     "state.etcd.timeout: must be between 100ms and 10m"},
    {"EtcdTimeoutNotADuration", "state: {etcd: {timeout: soon}}\n", "state.etcd.timeout: "},
    {"EtcdMaxTxnOpsZero", "state: {etcd: {max_txn_ops: 0}}\n", "state.etcd.max_txn_ops: "},
    {"EtcdLeaseGraceFraction", "state: {etcd: {lease_grace: 1500ms}}\n",
     "state.etcd.lease_grace: must be a whole number of seconds"},
    {"EtcdLeaseGraceTooLong", "state: {etcd: {lease_grace: 48h}}\n",
     "state.etcd.lease_grace: must be a whole number of seconds, at most 24h"},
    {"UnknownRunKey", "runs:\n  - id: a\n    tokenfile: x\n", "runs[0].tokenfile: unknown key"},
    {"UnknownPinKey",
     run_with_pin("        secret: s\n        inject: {type: bearer}\n"
                  "        header: x\n"),
     "runs[0].pins[0].header: unknown key"},
    {"UnknownInjectKey",
     run_with_pin("        secret: s\n        inject: {type: bearer, value: x}\n"),
     "runs[0].pins[0].inject.value: unknown key"},
    {"DuplicateKey", "audit:\n  path: a\n  path: b\n", "audit.path: duplicate key"},
    // wrong types
    {"SectionNotAMapping", "limits: [1, 2]\n", "limits: expected a mapping, got a list"},
    {"IntegerGotString", "limits: {max_header_bytes: lots}\n",
     "limits.max_header_bytes: expected an integer"},
    {"DurationOverTenYears", "limits: {drain_timeout: 3000000h}\n",
     "limits.drain_timeout: duration '3000000h' is over the longest allowed, 87600h"},
    {"IntegerOutOfRange", "limits: {connections_per_run: 0}\n",
     "limits.connections_per_run: expected an integer in 1.."},
    {"OneAdminConnection", "admin: {max_connections: 1}\n",
     "admin.max_connections: expected an integer in 2..100000"},
    {"NoDialAddresses", "limits: {max_dial_addresses: 0}\n",
     "limits.max_dial_addresses: expected an integer in 1..64"},
    {"TooManyDialAddresses", "limits: {max_dial_addresses: 65}\n",
     "limits.max_dial_addresses: expected an integer in 1..64"},
    {"TooManyWorkers", "limits: {worker_threads: 1000}\n",
     "limits.worker_threads: expected an integer in 0..256"},
    {"RetryBodyTooLarge", "limits: {retry_body_bytes: 99999999}\n",
     "limits.retry_body_bytes: expected an integer in 0..16777216"},
    {"SignBodyTooLarge", "limits: {sign_body_bytes: 99999999}\n",
     "limits.sign_body_bytes: expected an integer in 0..67108864"},
    {"MethodBodyTooLarge", "limits: {method_body_bytes: 99999999}\n",
     "limits.method_body_bytes: expected an integer in 0..67108864"},
    {"NegativeInteger", "limits: {h2_max_concurrent_streams: -1}\n",
     "limits.h2_max_concurrent_streams: expected an integer"},
    {"StringGotMapping", "audit: {path: {a: b}}\n", "audit.path: expected a string, got a mapping"},
    {"BoolGotString", "audit: {durable: maybe}\n", "audit.durable: expected true or false"},
    {"WebsocketNotABool", "policy: {websocket: sometimes}\n",
     "policy.websocket: expected true or false"},
    {"ListGotScalar", "policy: {allow_hosts: pypi.org}\n",
     "policy.allow_hosts: expected a list, got 'pypi.org'"},
    {"RunsNotAList", "runs: {id: a}\n", "runs: expected a list, got a mapping"},
    {"EmptyString", "admin: {token_file: ''}\n", "admin.token_file: must not be empty"},
    {"AdminBodyLimitTooSmall", "admin: {max_body_bytes: 10}\n",
     "admin.max_body_bytes: expected an integer in 1024..67108864"},
    {"AdminHeadLimitTooLarge", "admin: {max_header_bytes: 1073741824}\n",
     "admin.max_header_bytes: expected an integer in 1024..1048576"},
    {"AdminZeroReadTimeout", "admin: {read_timeout: 0s}\n",
     "admin.read_timeout: must be greater than 0"},
    {"AdminBadWriteTimeout", "admin: {write_timeout: soon}\n",
     "admin.write_timeout: bad duration 'soon'"},
    {"ZeroRefusalTimeout", "limits: {refusal_timeout: 0ms}\n",
     "limits.refusal_timeout: must be greater than 0"},
    {"TopLevelNotAMapping", "- a\n- b\n", "test.yaml: expected a mapping"},
    // durations
    {"BadDuration", "limits:\n  header_timeout: 10 parsecs\n",
     "limits.header_timeout: bad duration '10 parsecs' (expected e.g. 500ms, 10s, 2m, 1h)"},
    {"ZeroTimeout", "limits: {idle_timeout: 0s}\n", "limits.idle_timeout: must be greater than 0"},
    {"BadScrubHoldTimeout", "limits: {scrub_hold_timeout: -1s}\n",
     "limits.scrub_hold_timeout: bad duration '-1s'"},
    {"StaticCaValidityUnderASecond", "limits: {static_ca_validity: 500ms}\n",
     "limits.static_ca_validity: must be at least 1s"},
    {"TtlNotWholeSeconds", "runs: [{id: a, ttl: 1500ms}]\n",
     "runs[0].ttl: must be a whole number of seconds"},
    {"BadTtl", "runs: [{id: a, ttl: forever}]\n", "runs[0].ttl: bad duration 'forever'"},
    // ports, addresses, networks, hosts
    {"BadListenPort", "listen: {proxy: '127.0.0.1:70000'}\n", "listen.proxy: bad port '70000'"},
    {"BadAllowedPort", "policy: {allowed_ports: [443, 0]}\n",
     "policy.allowed_ports[1]: expected an integer in 1..65535"},
    {"BadCidr", "policy: {allow_networks: [127.0.0.1/33]}\n", "policy.allow_networks[0]: "},
    {"BadSourceCidr", "runs: [{id: a, sources: [not-a-net]}]\n", "runs[0].sources[0]: "},
    {"WildcardTld", "policy: {allow_hosts: [pypi.org, '*.com']}\n", "policy.allow_hosts[1]: "},
    {"BareWildcard", "runs: [{id: a, allow_hosts: ['*']}]\n", "runs[0].allow_hosts[0]: "},
    {"BadPinHost", "runs: [{id: a, pins: [{host: '*.com', secret: s, inject: {type: bearer}}]}]\n",
     "runs[0].pins[0].host: "},
    {"BadOverrideAddress", "resolver: {overrides: {a.test: [1.2.3]}}\n",
     "resolver.overrides.a.test[0]: bad IP address '1.2.3'"},
    {"BadOverrideHost", "resolver: {overrides: {'a b': [1.2.3.4]}}\n", "resolver.overrides.a b: "},
    {"EmptyOverride", "resolver: {overrides: {a.test: []}}\n",
     "resolver.overrides.a.test: must list at least one address"},
    {"BadDnsServer", "resolver: {servers: ['127.0.0.1:0']}\n", "resolver.servers[0]: bad port"},
    {"BadEtcdEndpoint", "state: {etcd: {endpoints: [10.0.0.1:2379]}}\n",
     "state.etcd.endpoints[0]: expected an http:// or https://host:port URL"},
    // enumerations
    {"BadUnpinned", "policy: {unpinned: block}\n",
     "policy.unpinned: unknown value 'block' (expected tunnel or intercept)"},
    {"BadBackend", "state: {backend: redis}\n",
     "state.backend: unknown value 'redis' (expected file or etcd)"},
    {"BadLogLevel", "log: {level: verbose}\n", "log.level: unknown value 'verbose'"},
    {"BadInjectType", run_with_pin("        secret: s\n        inject: {type: token}\n"),
     "runs[0].pins[0].inject.type: unknown value 'token' (expected bearer, basic, header or aws-sigv4)"},
    // injection rules
    {"HeaderInjectionIntoContentLength",
     run_with_pin("        secret: s\n        inject: {type: header, name: Content-Length}\n"),
     "runs[0].pins[0].inject"},
    {"HeaderInjectionIntoProxyHeader",
     run_with_pin("        secret: s\n        inject: {type: header, name: proxy-authorization}\n"),
     "runs[0].pins[0].inject"},
    {"TemplateWithoutSecret",
     run_with_pin(
         "        secret: s\n        inject: {type: header, name: x-key, template: abc}\n"),
     "runs[0].pins[0].inject"},
    {"BasicWithoutUsername", run_with_pin("        secret: s\n        inject: {type: basic}\n"),
     "runs[0].pins[0].inject.username: required for type basic"},
    {"HeaderWithoutName", run_with_pin("        secret: s\n        inject: {type: header}\n"),
     "runs[0].pins[0].inject.name: required for type header"},
    {"UsernameWithBearer",
     run_with_pin("        secret: s\n        inject: {type: bearer, username: u}\n"),
     "runs[0].pins[0].inject.username: only valid with type basic"},
    {"InjectMissing", run_with_pin("        secret: s\n"), "runs[0].pins[0].inject: required"},
    {"AwsWithoutRegion",
     run_with_pin("        secret: s\n        inject: {type: aws-sigv4, access_key_id: "
                  "AKIAIOSFODNN7EXAMPLE, service: s3}\n"),
     "runs[0].pins[0].inject.region: required for type aws-sigv4"},
    {"AwsBadAccessKeyId",
     run_with_pin("        secret: s\n        inject: {type: aws-sigv4, access_key_id: "
                  "AKIA/EXAMPLE, region: us-east-1, service: s3}\n"),
     "runs[0].pins[0].inject.access_key_id: expected 16 to 128 letters and digits"},
    {"AwsBadService",
     run_with_pin("        secret: s\n        inject: {type: aws-sigv4, access_key_id: "
                  "AKIAIOSFODNN7EXAMPLE, region: us-east-1, service: S3}\n"),
     "runs[0].pins[0].inject.service: expected a service such as s3"},
    {"AwsWithoutService",
     run_with_pin("        secret: s\n        inject: {type: aws-sigv4, region: us-east-1}\n"),
     "runs[0].pins[0].inject.service: required for type aws-sigv4"},
    {"RegionWithBearer",
     run_with_pin("        secret: s\n        inject: {type: bearer, region: us-east-1}\n"),
     "runs[0].pins[0].inject.region: only valid with type aws-sigv4"},
    {"PinHeadersNotAMap",
     run_with_pin("        secret: s\n        inject: {type: bearer}\n        headers: [a]\n"),
     "runs[0].pins[0].headers: expected a mapping of header name to value"},
    {"PinHeaderTransport",
     run_with_pin("        secret: s\n        inject: {type: bearer}\n"
                  "        headers: {Content-Length: '5'}\n"),
     "runs[0].pins[0].headers.content-length: transport and proxy headers cannot be set"},
    {"PinHeaderIsTheInjectedOne",
     run_with_pin("        secret: s\n        inject: {type: bearer}\n"
                  "        headers: {Authorization: x}\n"),
     "runs[0].pins[0].headers.authorization: is the injected credential header"},
    {"PinHeaderEgressNamespace",
     run_with_pin("        secret: s\n        inject: {type: bearer}\n"
                  "        headers: {X-Egress-Run: other}\n"),
     "runs[0].pins[0].headers.x-egress-run: transport and proxy headers cannot be set"},
    {"PinHeaderValueNotAString",
     run_with_pin("        secret: s\n        inject: {type: bearer}\n"
                  "        headers: {X-A: [1]}\n"),
     "runs[0].pins[0].headers.X-A: expected a string"},
    {"InjectTypeMissing", run_with_pin("        secret: s\n        inject: {username: u}\n"),
     "runs[0].pins[0].inject.type: required"},
    // pins
    {"SecretFileAndSecret",
     run_with_pin("        secret: s\n        secret_file: f\n        inject: {type: bearer}\n"),
     "runs[0].pins[0]: secret_file and secret are mutually exclusive"},
    {"NeitherSecretNorFile", run_with_pin("        inject: {type: bearer}\n"),
     "runs[0].pins[0]: one of secret_file or secret is required"},
    {"PinWithoutHost",
     "runs: [{id: a, token_file: t, pins: [{secret: s, inject: {type: bearer}}]}]\n",
     "runs[0].pins[0].host: required"},
    {"PathPrefixWithoutSlash",
     run_with_pin(
         "        secret: s\n        inject: {type: bearer}\n        path_prefixes: [repos]\n"),
     "runs[0].pins[0].path_prefixes[0]: must start with '/'"},
    {"MethodNotAToken",
     run_with_pin(
         "        secret: s\n        inject: {type: bearer}\n        methods: [GET, 'PO ST']\n"),
     "runs[0].pins[0].methods[1]: not an HTTP method token"},
    // a static run's scope, which its store secrets are found by
    {"StoreSecretWithoutScope", run_with_pin("        secret: s\n        inject: {type: bearer}\n"),
     "runs[0].scope: required by runs[0].pins[0].secret (a store secret is found by the run's "
     "scope"},
    {"ScopeWithoutOrg", "runs: [{id: a, scope: {project: web}}]\n", "runs[0].scope.org: required"},
    {"ScopeBadValue", "runs: [{id: a, scope: {org: 'a b'}}]\n",
     "runs[0].scope.org: must be 1..64 characters of [A-Za-z0-9._-]"},
    {"ScopeUnknownField", "runs: [{id: a, scope: {org: a, team: x}}]\n",
     "runs[0].scope.team: unknown key (expected org, project, user or workflow)"},
    {"ScopeNotAMapping", "runs: [{id: a, scope: acme}]\n",
     "runs[0].scope: expected a mapping, got 'acme'"},
    {"ScopeNull", "runs: [{id: a, scope: null}]\n",
     "runs[0].scope: expected a mapping such as {org: acme}, got null"},
    {"BadSecretName",
     "runs: [{id: a, scope: {org: a}, pins: [{host: a.test, secret: 'gh/x', inject: {type: "
     "bearer}}]}]\n",
     "runs[0].pins[0].secret: bad secret name 'gh/x' (expected 1..128 characters of "
     "[A-Za-z0-9_.-])"},
    // runs
    {"RunWithoutId", "runs: [{token_file: t}]\n", "runs[0].id: required"},
    {"BadRunId", "runs: [{id: 'a/b'}]\n", "runs[0].id: bad run id 'a/b'"},
    {"DuplicateRunIds", "runs:\n  - {id: app, token_file: a}\n  - {id: app, token_file: b}\n",
     "runs[1].id: duplicate run id 'app' (first at runs[0])"},
    {"TwoRunsOneWithoutTokenFile",
     "runs:\n  - {id: a, token_file: a}\n  - {id: b, token_file: null}\n",
     "runs[1].token_file: null (requests without proxy credentials belong to this run) is "
     "allowed only when it is the only static run"},
    {"TwoRunsTokenFileAbsent", "runs:\n  - {id: a}\n  - {id: b, token_file: b}\n",
     "runs[0].token_file: null"},
    // YAML syntax
    {"YamlSyntaxError", "listen:\n  proxy: [127.0.0.1:3128\n", "test.yaml: line 3: "},
    {"YamlBadIndent", "listen:\n  proxy: 127.0.0.1:1\n admin: x\n", "test.yaml: line "},
    {"YamlUndefinedAlias", "audit: {path: *nope}\n", "test.yaml: line 1: "},
    // anchors and aliases are refused at the line of the first one (an alias is walked again
    // wherever it is used: nested ones multiply)
    {"YamlAnchor", "log: {level: info}\naudit: {path: &p a.jsonl}\n",
     "test.yaml: line 2: YAML anchors and aliases (&name, *name) are not supported"},
    {"YamlAnchorAndAlias", "audit: {path: &p a.jsonl}\nadmin: {token_file: *p}\n",
     "test.yaml: line 1: YAML anchors and aliases"},
    // a file egressd writes never names one it reads (key, token, secret, CA bundle, store,
    // the config itself) nor one another key writes
    {"CaCertOutOnMasterKey", "runs: [{id: a, ca_cert_out: var/master.key}]\n",
     "runs[0].ca_cert_out: names the file of keys.master_key_file (var/master.key), which "
     "egressd reads: writing runs[0].ca_cert_out would destroy it; give another path"},
    {"CaBundleOutOnAdminToken", "runs: [{id: a, ca_bundle_out: var/admin.token}]\n",
     "runs[0].ca_bundle_out: names the file of admin.token_file (var/admin.token)"},
    {"AdminSocketOnMasterKey", "listen: {admin: 'unix:var/master.key'}\n",
     "listen.admin: names the file of keys.master_key_file"},
    {"AuditOnMasterKey", "keys: {master_key_file: /k/m.key}\naudit: {path: /k/m.key}\n",
     "audit.path: names the file of keys.master_key_file (/k/m.key)"},
    {"AuditOnRotationsNextKey", "audit: {path: var/master.key.next}\n",
     "audit.path: names the file of keys.master_key_file (its .next)"},
    {"CaCertOutOnRunToken", "runs: [{id: a, token_file: /s/a.tok, ca_cert_out: /s/a.tok}]\n",
     "runs[0].ca_cert_out: names the file of runs[0].token_file"},
    {"CaCertOutOnOtherRunsToken",
     "runs: [{id: a, token_file: /s/a.tok}, {id: b, token_file: /s/b.tok, ca_cert_out: "
     "/s/a.tok}]\n",
     "runs[1].ca_cert_out: names the file of runs[0].token_file"},
    {"CaCertOutOnSecretFile",
     "runs: [{id: a, ca_cert_out: /s/gh, pins: [{host: h.test, secret_file: /s/gh, "
     "inject: {type: bearer}}]}]\n",
     "runs[0].ca_cert_out: names the file of runs[0].pins[0].secret_file"},
    {"CaBundleOutOnUpstreamCa", "upstream: {ca_file: /pki/ca.pem}\n"
     "runs: [{id: a, ca_bundle_out: /pki/ca.pem}]\n",
     "runs[0].ca_bundle_out: names the file of upstream.ca_file"},
    {"CaCertOutOnEtcdKey", "state: {etcd: {cert_file: /e/c.pem, key_file: /e/k.pem}}\n"
     "runs: [{id: a, ca_cert_out: /e/k.pem}]\n",
     "runs[0].ca_cert_out: names the file of state.etcd.key_file"},
    {"CaCertOutOnEtcdCa", "state: {etcd: {ca_file: /e/ca.pem}}\n"
     "runs: [{id: a, ca_cert_out: /e/ca.pem}]\n",
     "runs[0].ca_cert_out: names the file of state.etcd.ca_file"},
    {"CaCertOutOnTheConfigFile", "runs: [{id: a, ca_cert_out: ./test.yaml}]\n",
     "runs[0].ca_cert_out: names the file of the config file (test.yaml)"},
    {"CaCertOutOnMasterKeyOtherSpelling",
     "keys: {master_key_file: /k/m.key}\nruns: [{id: a, ca_cert_out: /k/x/../m.key}]\n",
     "runs[0].ca_cert_out: names the file of keys.master_key_file"},
    {"CaCertOutInState", "state: {path: /st/}\nruns: [{id: a, ca_cert_out: /st/state.json}]\n",
     "runs[0].ca_cert_out: is inside state.path (/st/), egressd's store: give a path outside it"},
    {"AuditIsTheStateFolder", "audit: {path: var/state}\n", "audit.path: is inside state.path"},
    {"TwoRunsOneCaCertOut",
     "runs: [{id: a, token_file: t, ca_cert_out: ca.pem}, {id: b, token_file: u, "
     "ca_cert_out: ./ca.pem}]\n",
     "runs[1].ca_cert_out: names the same file as runs[0].ca_cert_out (ca.pem): give each its "
     "own file"},
    {"CaBundleOutOnAnotherRunsCaCertOut",
     "runs: [{id: a, token_file: t}, {id: b, token_file: u, ca_bundle_out: var/run-a-ca.pem}]\n",
     "runs[1].ca_bundle_out: names the same file as runs[0].ca_cert_out (var/run-a-ca.pem)"},
    {"CaCertOutOnTheAuditFile", "audit: {path: /l/a.jsonl}\nruns: [{id: a, ca_cert_out: "
     "/l/a.jsonl}]\n",
     "runs[0].ca_cert_out: names the same file as audit.path"},
    {"AuditOnTheAdminSocket", "listen: {admin: 'unix:/run/e.sock'}\naudit: {path: /run/e.sock}\n",
     "audit.path: names the same file as listen.admin"},
    {"TwoDocuments", "audit: {path: a}\n---\naudit: {path: b}\n",
     "test.yaml: expected one YAML document, found more than one"},
    // fuzz_config regressions: yaml-cpp's endless empty documents are refused, not looped on;
    // echoed values never break a line.
    {"YamlEndlessDocuments", ",", "test.yaml: expected one YAML document, found more than one"},
};

TEST(ConfigWrittenFiles, DistinctFilesAndTheStdoutAuditAreAccepted) {
    for (const char* text : {
             // the defaults: CA files beside the key and token, not on them
             "runs: [{id: a, token_file: t}, {id: b, token_file: u}]\n",
             "runs: [{id: a, ca_cert_out: var/a.pem, ca_bundle_out: var/a-bundle.pem}]\n",
             // standard output is no file
             "audit: {path: '-'}\nruns: [{id: a}]\n",
             // a name that only starts like the state folder's is outside it
             "runs: [{id: a, ca_cert_out: var/state-ca.pem}]\n",
             // with etcd, state.path is not used
             "state: {backend: etcd}\nruns: [{id: a, ca_cert_out: var/state/ca.pem}]\n",
             // the token and secret files a run reads may be one file (nothing writes them)
             "runs: [{id: a, token_file: /s/x, pins: [{host: h.test, secret_file: /s/x, "
             "inject: {type: bearer}}]}]\n",
         }) {
        SCOPED_TRACE(text);
        auto c = parse_config(text, "t.yaml");
        EXPECT_TRUE(c.ok()) << c.error();
    }
}

TEST(ConfigWrittenFiles, EveryCollisionIsReportedOnceUnderTheWritingKey) {
    auto r = parse_config(
        "listen: {admin: 'unix:var/master.key'}\n"
        "audit: {path: var/admin.token}\n"
        "runs: [{id: a, token_file: t, ca_cert_out: c.pem}, {id: b, token_file: u, ca_cert_out: "
        "c.pem, ca_bundle_out: var/state/b.pem}]\n",
        "t.yaml");
    ASSERT_FALSE(r.ok());
    const auto lines = lines_of(r.error());
    ASSERT_EQ(lines.size(), 4u) << r.error();
    EXPECT_EQ(lines[0].rfind("listen.admin: names the file of keys.master_key_file", 0), 0u);
    EXPECT_EQ(lines[1].rfind("audit.path: names the file of admin.token_file", 0), 0u);
    EXPECT_EQ(lines[2].rfind("runs[1].ca_cert_out: names the same file as runs[0].ca_cert_out",
                             0),
              0u);
    EXPECT_EQ(lines[3].rfind("runs[1].ca_bundle_out: is inside state.path", 0), 0u);
}

TEST(ConfigErrorsAliases, AnAliasBombIsRefusedBeforeItIsWalked) {
    // 50 runs of 50 pins of 50 path prefixes once expanded (125 000 prefixes, each checked),
    // from a file of about 1.5 KB: refused at its first anchor, before anything is walked.
    auto repeat = [](const std::string& item, int n) {
        std::string out;
        for (int i = 0; i < n; ++i) {
            out += ", " + item;
        }
        return out;
    };
    const std::string yaml =
        "runs: [&r {id: a, token_file: t, pins: [&p {host: a.test, secret_file: s, "
        "inject: {type: bearer}, path_prefixes: [/a" + repeat("/a", 49) + "]}" +
        repeat("*p", 49) + "]}" + repeat("*r", 49) + "]\n";
    const auto start = std::chrono::steady_clock::now();
    auto r = parse_config(yaml, "bomb.yaml");
    const auto took = std::chrono::steady_clock::now() - start;
    ASSERT_FALSE(r.ok());
    EXPECT_EQ(r.error().find('\n'), std::string::npos) << r.error();  // one line
    EXPECT_EQ(r.error().rfind("bomb.yaml: line 1: YAML anchors and aliases (&name, *name) are "
                              "not supported; write the value out (column ",
                              0),
              0u)
        << r.error();
    EXPECT_LT(took, std::chrono::seconds(1));
}

TEST(ConfigErrorsEcho, ControlBytesInEchoedValuesAreEscaped) {
    auto r = parse_config("listen:\n  proxy: \"127.0.0.1:1\\nruns[0].id: x\\e[2J\"\n", "test.yaml");
    ASSERT_FALSE(r.ok());
    EXPECT_EQ(r.error().find('\n'), std::string::npos) << r.error();  // one problem, one line
    EXPECT_EQ(r.error().find('\x1b'), std::string::npos) << r.error();
    EXPECT_NE(r.error().find("got '127.0.0.1:1\\x0aruns[0].id: x\\x1b[2J'"), std::string::npos)
        << r.error();
}

INSTANTIATE_TEST_SUITE_P(Table, ConfigErrors, testing::ValuesIn(kErrorRows),
                         [](const testing::TestParamInfo<ErrorRow>& info) {
                             return std::string(info.param.name);
                         });

TEST(ConfigErrorsExact, FirstLineIsTheFirstErrorInDocumentOrder) {
    auto r = parse_config(R"(
listen:
  proxy: nowhere
limits:
  header_timeout: 10 parsecs
  bogus: 1
policy:
  unpinned: sometimes
  allow_hosts: ['*.com']
runs:
  - id: a
    pins:
      - host: api.test
        inject: {type: token}
  - id: a
    token_file: null
)",
                          "t.yaml");
    ASSERT_FALSE(r.ok());
    auto lines = lines_of(r.error());
    ASSERT_GE(lines.size(), 7u) << r.error();
    EXPECT_EQ(lines[0].rfind("listen.proxy: expected host:port", 0), 0u) << r.error();
    EXPECT_EQ(lines[1],
              "limits.header_timeout: bad duration '10 parsecs' (expected e.g. 500ms, "
              "10s, 2m, 1h)");
    EXPECT_EQ(lines[2].rfind("limits.bogus: unknown key", 0), 0u);
    EXPECT_EQ(lines[3],
              "policy.unpinned: unknown value 'sometimes' (expected tunnel or intercept)");
    EXPECT_EQ(lines[4].rfind("policy.allow_hosts[0]: ", 0), 0u);
    EXPECT_EQ(
        lines[5],
        "runs[0].pins[0].inject.type: unknown value 'token' (expected bearer, basic, header or aws-sigv4)");
    EXPECT_EQ(lines[6], "runs[0].pins[0]: one of secret_file or secret is required");
    for (const auto& line : lines) {
        EXPECT_EQ(line.find("t.yaml"), std::string::npos) << "semantic errors carry the YAML path";
    }
}

TEST(ConfigErrorsExact, NeverThrowsOnTruncatedInput) {
    // Every prefix of a valid config: syntax errors, half-written keys, dangling lists.
    const std::string full = kFull;
    for (size_t n = 0; n <= full.size(); ++n) {
        EXPECT_NO_THROW((void)parse_config(full.substr(0, n), "t")) << "prefix length " << n;
    }
    for (const char* text : {"\t", "\xff\xfe", "\xef\xbb\xbf", "\0", "key: \xc3\x28"}) {
        EXPECT_NO_THROW((void)parse_config(text, "t")) << text;
    }
    // These are all errors, never exceptions.
    for (const char* text :
         {"[", "{", ":", "- - -", "? [a]\n: b\n", "!!binary AAAA", "&a [*a]", "runs: [[]]",
          "runs: [null]", "runs: [{pins: [null]}]", "runs: [{id: a, pins: [{inject: null}]}]",
          "{[a]: b}", "limits: {max_header_bytes: 99999999999999999999999}",
          "limits: {idle_timeout: 99999999999999999999s}"}) {
        SCOPED_TRACE(text);
        Result<Config> r = make_error("unset");
        EXPECT_NO_THROW(r = parse_config(text, "t"));
        EXPECT_FALSE(r.ok());
    }
}

TEST(ConfigErrorsExact, ErrorsDoNotEchoSecretFields) {
    auto r = parse_config(run_with_pin("        secret: s\n        secret_file: ghp_TOPSECRET\n"
                                       "        inject: {type: bearer}\n"),
                          "t");
    ASSERT_FALSE(r.ok());
    EXPECT_EQ(r.error().find("ghp_TOPSECRET"), std::string::npos) << r.error();
}

// --- normalization ----------------------------------------------------------------------

TEST(ConfigParse, NormalizesOverrideHostsAndMethods) {
    auto r = parse_config(R"(
resolver:
  overrides: {"Upstream.TEST.": ["127.0.0.1"]}
runs:
  - id: a
    scope: {org: acme}
    pins:
      - {host: a.test, secret: s, inject: {type: bearer}, methods: [get, delete]}
)",
                          "t");
    ASSERT_TRUE(r.ok()) << r.error();
    EXPECT_EQ(r->resolver_overrides.count("upstream.test"), 1u);
    EXPECT_EQ(r->runs[0].pins[0].methods, (std::vector<std::string>{"GET", "DELETE"}));
}

TEST(ConfigParse, DuplicateOverrideHostsAfterNormalization) {
    auto r = parse_config("resolver: {overrides: {a.test: [1.2.3.4], A.TEST: [1.2.3.5]}}\n", "t");
    ASSERT_FALSE(r.ok());
    EXPECT_TRUE(has_line_starting_with(r.error(), "resolver.overrides.A.TEST: duplicate host"));
}

// --- files ------------------------------------------------------------------------------

TEST(LoadConfigFile, MissingFileNamesPathAndReason) {
    auto r = load_config_file("/nonexistent/egressd.yaml");
    ASSERT_FALSE(r.ok());
    EXPECT_EQ(r.error(), "/nonexistent/egressd.yaml: cannot read: No such file or directory");
}

TEST(LoadConfigFile, DirectoryIsNotAConfig) {
    auto r = load_config_file("/");
    ASSERT_FALSE(r.ok());
    EXPECT_EQ(r.error().rfind("/: cannot read: ", 0), 0u) << r.error();
}

TEST(LoadConfigFile, ReadsAndNamesTheSource) {
    auto path = std::filesystem::temp_directory_path() /
                ("egress_config_test_" + std::to_string(::getpid()) + ".yaml");
    {
        std::ofstream out(path);
        out << "listen:\n  proxy: 127.0.0.1:0\nlimits:\n  idle_timeout: 5x\n";
    }
    auto bad = load_config_file(path.string());
    ASSERT_FALSE(bad.ok());
    EXPECT_EQ(bad.error(),
              "limits.idle_timeout: bad duration '5x' (expected e.g. 500ms, 10s, "
              "2m, 1h)");
    {
        std::ofstream out(path);
        out << "listen:\n  proxy: 127.0.0.1:0\n";
    }
    auto good = load_config_file(path.string());
    std::filesystem::remove(path);
    ASSERT_TRUE(good.ok()) << good.error();
    EXPECT_EQ(good->source, path.string());
    EXPECT_EQ(good->proxy.port, 0);
}

TEST(ExampleConfigs, QuickstartParses) {
    auto path = source_root() / "configs" / "quickstart.yaml";
    auto r = load_config_file(path.string());
    ASSERT_TRUE(r.ok()) << r.error();
    EXPECT_EQ(r->proxy.to_string(), "127.0.0.1:3128");
    EXPECT_EQ(r->admin.to_string(), "127.0.0.1:9901");
    EXPECT_EQ(r->audit.path, "var/audit.jsonl");
    EXPECT_EQ(r->policy.unpinned, policy::Unpinned::Tunnel);
    ASSERT_EQ(r->policy.allow_hosts.size(), 2u);
    EXPECT_EQ(r->policy.allow_hosts[0].text(), "pypi.org");
    EXPECT_EQ(r->policy.allow_hosts[1].text(), "files.pythonhosted.org");
    ASSERT_EQ(r->runs.size(), 1u);
    const RunConfig& run = r->runs[0];
    EXPECT_EQ(run.id, "quickstart");
    EXPECT_FALSE(run.token_file.has_value());
    EXPECT_EQ(run.ca_cert_out, "var/quickstart-ca.pem");
    EXPECT_EQ(run.ca_bundle_out, "var/quickstart-bundle.pem");
    ASSERT_EQ(run.pins.size(), 1u);
    EXPECT_EQ(run.pins[0].host.text(), "api.github.com");
    EXPECT_EQ(run.pins[0].secret_file, "var/github.token");
    EXPECT_EQ(run.pins[0].inject.type, policy::InjectType::Bearer);
}

TEST(ExampleConfigs, FleetAdvertisesTheService) {
    // A fleet binds 0.0.0.0: without listen.advertise every run's proxy_url would name
    // 127.0.0.1, the sandbox itself.
    auto r = load_config_file((source_root() / "configs" / "fleet.yaml").string());
    ASSERT_TRUE(r.ok()) << r.error();
    EXPECT_EQ(r->proxy.to_string(), "0.0.0.0:3128");
    ASSERT_TRUE(r->advertise.has_value());
    EXPECT_EQ(*r->advertise, "egressd-gateway.default.svc.cluster.local:3128");
}

TEST(ExampleConfigs, SidecarParses) {
    auto path = source_root() / "configs" / "sidecar.yaml";
    auto r = load_config_file(path.string());
    ASSERT_TRUE(r.ok()) << r.error();
    EXPECT_EQ(r->proxy.to_string(), "127.0.0.1:3128");
    EXPECT_EQ(r->admin.to_string(), "0.0.0.0:9901");
    ASSERT_EQ(r->runs.size(), 1u);
    const RunConfig& run = r->runs[0];
    EXPECT_EQ(run.id, "app");
    EXPECT_FALSE(run.token_file.has_value());
    EXPECT_EQ(run.ca_cert_out, "/run/egress/ca.pem");
    ASSERT_EQ(run.pins.size(), 1u);
    EXPECT_EQ(run.pins[0].host.text(), "api.github.com");
    EXPECT_EQ(run.pins[0].secret_file, "/var/run/secrets/github/token");
    EXPECT_EQ(run.pins[0].inject.type, policy::InjectType::Bearer);
    EXPECT_TRUE(run.pins[0].methods.empty());
    EXPECT_TRUE(run.pins[0].path_prefixes.empty());
}

}  // namespace
}  // namespace egress::proxy
