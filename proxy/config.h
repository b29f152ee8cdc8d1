#pragma once
// Configuration in two layers (STYLE.md 15): YAML → validated, immutable Config.
// No Asio here; loading does no network I/O. Errors are collected, each naming its YAML path
// ("runs[0].pins[1].inject.type: unknown value 'token' (expected bearer, basic or header)").
#include <chrono>
#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "common/result.h"
#include "credstore/scope.h"
#include "policy/address.h"
#include "policy/host.h"
#include "policy/run_policy.h"

namespace egress::proxy {

struct ListenAddress {
    std::string host;       // "127.0.0.1", "::1", "0.0.0.0" (IP literal only)
    uint16_t port = 0;      // 0 = pick any free port
    std::string unix_path;  // set for "unix:/path.sock" (admin only)
    bool is_unix() const { return !unix_path.empty(); }
    std::string to_string() const;
};

struct Limits {
    size_t max_header_bytes = 65536;
    size_t max_unidentified_connections = 1024;  // not yet identified by a head, all workers
    size_t max_header_fields = 100;  // HTTP/1.1 request head (and trailer) fields; over: 431
    std::chrono::milliseconds header_timeout{10'000};
    std::chrono::milliseconds idle_timeout{60'000};
    std::chrono::milliseconds connect_timeout{5'000};
    // Addresses one upstream dial tries, each for connect_timeout at most: a name with dozens
    // of answers holds its client's connection slot for this many connect_timeouts at most.
    size_t max_dial_addresses = 8;
    std::chrono::milliseconds tls_timeout{5'000};
    std::chrono::milliseconds dns_timeout{5'000};
    std::chrono::milliseconds drain_timeout{30'000};
    // A request whose body was not taken to its end (an early answer: a refusal, or an
    // upstream that answered an upload before taking all of it, 413/401, and closed):
    // how long egressd waits for such an upstream answer, and how long it keeps reading and
    // discarding the client's bytes after the answer before the close, so the client reads
    // the answer instead of a reset (a close with unread bytes resets the connection).
    std::chrono::milliseconds linger_timeout{2'000};
    // egressd's own answer on an HTTP/1.1 connection (a refusal: 403, 407, 421, 429, 502...)
    // must be written within this, or the connection is closed: a client that sends requests
    // it never reads the answers of holds a connection slot no longer than this per answer.
    std::chrono::milliseconds refusal_timeout{5'000};
    // An upstream connection kept for reuse (a pooled HTTP/1.1 connection, an HTTP/2 session
    // with no open stream) is closed after this long unused: below common servers' own idle
    // closes (nginx 75 s), so a reused connection is rarely one the server is closing.
    std::chrono::milliseconds upstream_idle_timeout{30'000};
    // The response scrubber holds back the last (longest needle - 1) bytes of every body
    // piece; when the upstream sends nothing more for this long, they go out as they are (a
    // paused stream does not keep its tail until its next event). 0: held until the next
    // piece or the end.
    std::chrono::milliseconds scrub_hold_timeout{200};
    size_t connections_per_run = 512;
    size_t h2_max_concurrent_streams = 100;
    // HTTP/2 defences (both legs use the same values where they apply).
    size_t h2_max_header_list_bytes = 65536;  // decoded header block, per stream
    size_t h2_max_header_fields = 100;        // fields per header block
    size_t h2_max_continuations = 8;          // CONTINUATION frames after one HEADERS
    size_t h2_stream_reset_burst = 200;       // client RST_STREAM token bucket: burst
    size_t h2_stream_reset_rate = 33;         //   and tokens regained per second
    size_t h2_max_premature_resets = 100;     // streams reset before a response; over it
                                              // and half the streams: GOAWAY ENHANCE_YOUR_CALM
    size_t h2_control_frame_burst = 1000;     // PING/SETTINGS/PRIORITY/empty DATA bucket
                                              // (regains burst/10 per second)
    size_t h2_max_outbound_ack = 100;         // queued SETTINGS/PING ACKs
    size_t h2_max_settings = 32;              // entries per SETTINGS frame
    size_t h2_stream_window = 262144;         // per-stream window = per-stream buffer bound
    // Per connection, both legs: the receive window and, on the client leg, the response bytes
    // queued for the client (what an h2 upstream's streams hold, each within its stream
    // window, comes on top). 0: 4 × h2_stream_window (connection_window()).
    size_t h2_connection_window = 0;
    size_t connection_window() const {
        return h2_connection_window != 0 ? h2_connection_window : h2_stream_window * 4;
    }
    std::chrono::milliseconds h2_settings_timeout{10'000};
    // The CA of a static run with ttl: null (a run as long as the process; runs with a ttl
    // get a CA valid for the ttl). Long on purpose: the CA key never leaves this process's
    // memory, so the CA dies with the process whatever its dates; a short validity only made
    // a long-lived sidecar fail every pinned host when it ran out (it was 24 h). A warning is
    // logged before it ends (runtime.h ca_expiry); a restart, or a reload that changes this
    // key, makes a new CA and rewrites ca_cert_out.
    std::chrono::milliseconds static_ca_validity{std::chrono::hours(24 * 365)};
    size_t leaf_cache_size = 1024;     // per run
    size_t leaf_mints_per_minute = 600;  // per run (token bucket); 0 = unlimited
    size_t max_upstream_idle_per_host = 32;
    // A request body up to this size, sent to an HTTP/2 upstream, is kept until its answer
    // comes, so that a stream the upstream refuses unprocessed (REFUSED_STREAM, or above a
    // GOAWAY's last stream) can be sent again with it: a body read from the client cannot be
    // read twice. Memory held per request in flight; 0: no body is kept (such a request is
    // 502 upstream_refused_stream).
    size_t retry_body_bytes = 65536;
    // An aws-sigv4 request to a service that signs its payload's hash (any but S3), from a
    // client that declared no x-amz-content-sha256, is read whole before it is signed and
    // sent: at most this much (larger: 413 body_too_large_to_sign). Memory held per such
    // request in flight.
    size_t sign_body_bytes = 1 << 20;
    // A POST with a form, multipart or JSON body to a pin limited to methods is read whole
    // before it is sent, to check a `_method` field in it (policy::body_method_matches): at
    // most this much (larger: 413 body_too_large_to_check). Memory held per such request.
    size_t method_body_bytes = 1 << 20;
    size_t upstream_tls_sessions = 1024;  // resumable upstream sessions kept per worker; 0 = none
    size_t worker_threads = 0;  // event loops; 0 = one per CPU this process may use (cpus.h)
};

struct PinConfig {
    policy::HostPattern host;
    std::string secret_file;  // exactly one of secret_file / secret is set
    std::string secret;       // name in the store, found by the run's scope (control plane)
    policy::InjectSpec inject;
    std::vector<std::string> path_prefixes;
    std::vector<std::string> methods;  // uppercased
    // Static headers set with the credential (lowercase names; validate_extra_headers).
    std::vector<policy::Header> extra_headers;
    std::string yaml_path;             // "runs[0].pins[1]" for error messages
};

struct RunConfig {
    std::string id;
    std::optional<std::string> token_file;
    std::optional<std::chrono::seconds> ttl;
    std::string ca_cert_out;
    /// The system roots (upstream.ca_file's) followed by the run CA, for clients whose trust
    /// store a variable replaces (SSL_CERT_FILE …); empty = not written.
    std::string ca_bundle_out;
    std::vector<policy::Cidr> sources;
    std::vector<policy::HostPattern> allow_hosts;
    std::vector<PinConfig> pins;
    /// Who the run is, for store secrets (`secret: NAME` pins): the most specific secret of
    /// that name whose scope contains this one, as for a run made through the admin API.
    /// Required when a pin names a store secret.
    std::optional<credstore::Scope> scope;
    std::string yaml_path;  // "runs[0]"
};

/// The admin API's own bounds (requests come from the control plane, not from sandboxes, but
/// a stuck or hostile caller on the admin port must not hold a connection or memory forever).
struct AdminLimits {
    size_t max_body_bytes = 1 << 20;      // a request body (a secret put, a run); over it: 413
    size_t max_header_bytes = 16 * 1024;  // a request head; over it: 431
    // A whole request (head and body) must arrive within this; an idle keep-alive connection
    // is closed after it.
    std::chrono::milliseconds read_timeout{30'000};
    std::chrono::milliseconds write_timeout{5'000};  // an answer must be written within this
    // Open admin connections (AdminConnections in proxy/worker.h): over it, the least recently
    // active one not inside an authorized API call is closed; one fewer calls at once (503).
    size_t max_connections = 128;
    // The store's bounds: every run (with its CA) and pin is in each replica's memory and in
    // every runtime rebuild, so a runaway caller must not grow them without end.
    size_t max_runs = 10'000;         // runs in the store (revoked ones until they expire): 409
    size_t max_pins_per_run = 1'000;  // pins of one run: 400 at creation, 409 when added
};

struct AuditConfig {
    std::string path = "var/audit.jsonl";  // "-" = standard output
    bool durable = false;
};

/// state.etcd: the fleet's etcd (state.backend: etcd; proxy/etcd_store.h takes it as is).
struct EtcdConfig {
    std::vector<std::string> endpoints{"http://127.0.0.1:2379"};  // http(s)://host:port, in order
    std::string prefix = "/egressd/";
    // How long one call to etcd may take (connect, answer), and so how long a write waits
    // for an etcd that stalls before it answers 503, and for its own change to come back
    // through the watch.
    std::chrono::milliseconds timeout{5000};
    // How long a run's etcd lease outlives the run: its keys stay that long after expiry,
    // so replicas whose clocks are a little behind still see it expire, not vanish.
    std::chrono::seconds lease_grace{60};
    // Records one transaction may write; keep it at etcd's --max-txn-ops (default 128): a
    // larger change (a key rotation of a large state) is refused before it is sent.
    size_t max_txn_ops = 128;
    // How long a replica may go without confirming its state holds all of etcd's before
    // /readyz answers 503 (null: never; the data path keeps serving what it last saw).
    std::optional<std::chrono::milliseconds> max_staleness;
    // https:// endpoints: the CAs that verify etcd's certificate ("system": the system
    // store), and a client certificate for an etcd with --client-cert-auth (both or neither).
    std::string ca_file = "system";
    std::optional<std::string> cert_file;
    std::optional<std::string> key_file;

    bool operator==(const EtcdConfig&) const = default;
};

/// Whether any of state.etcd.endpoints is https:// (TLS to etcd).
inline bool has_https_endpoint(const std::vector<std::string>& endpoints) {
    for (const auto& e : endpoints) {
        if (e.rfind("https://", 0) == 0) {
            return true;
        }
    }
    return false;
}

struct Config {
    ListenAddress proxy{"127.0.0.1", 3128, {}};
    ListenAddress admin{"127.0.0.1", 9901, {}};
    std::optional<ListenAddress> transparent;
    /// listen.advertise: the "host:port" put into a new run's proxy_url (POST /v1/runs), as
    /// sandboxes reach the proxy listener (a Service name, a load balancer's address); host is
    /// a DNS name or an IP literal (an IPv6 one bracketed here). Unset: the listener's own
    /// address, loopback for an unspecified bind (proxy_authority()).
    std::optional<std::string> advertise;
    std::string admin_token_file = "var/admin.token";
    AdminLimits admin_limits;
    std::string state_backend = "file";
    std::string state_path = "var/state";
    EtcdConfig etcd;  // state.etcd (state.backend: etcd)
    std::string master_key_file = "var/master.key";
    std::optional<std::string> kms_command;
    std::string upstream_ca_file = "system";
    std::map<std::string, std::vector<policy::IpAddress>> resolver_overrides;  // normalized host
    std::vector<std::string> resolver_servers;  // "127.0.0.1:5353"; empty = system resolv.conf
    policy::GlobalPolicy policy;                // unpinned, allow_hosts, allowed_ports
    std::vector<policy::Cidr> allow_networks;
    Limits limits;
    AuditConfig audit;
    std::string log_level = "info";   // trace|debug|info|warn|error|off
    std::string log_format = "text";  // text | json (one object per line)
    std::vector<RunConfig> runs;
    std::string source;               // file path, for messages
};

/// The files `c` would write that are a file it reads (a key, token, secret, CA bundle or the
/// config), inside its file state, or written by two keys: one "key: problem" line each
/// (parse_config refuses them; a reload checks them again once the restart-only keys are back
/// at the values in effect).
std::vector<std::string> written_file_clashes(const Config& c);

/// Parses and validates YAML text. Unknown keys, wrong types and bad values are errors; all
/// of them are collected and returned joined by '\n', each "path: problem".
Result<Config> parse_config(const std::string& yaml_text, const std::string& source_name);
/// Reads the file, then parse_config. A missing or unreadable file is an error naming it.
Result<Config> load_config_file(const std::string& path);

/// The authority ("host:port") a new run's proxy_url names: `advertise` when set, else the
/// proxy listener's address `host` (an IP literal) and bound `port`, with loopback in place of
/// an unspecified address (127.0.0.1 for 0.0.0.0, ::1 for ::) and brackets around IPv6.
std::string proxy_authority(const std::optional<std::string>& advertise,
                            const std::string& host, uint16_t port);

/// "10s", "500ms", "2m", "1h", or a bare integer of seconds.
Result<std::chrono::milliseconds> parse_duration(const std::string& text);

}  // namespace egress::proxy
