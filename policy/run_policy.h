#pragma once
// What one run may reach and which credential applies: destination policy and pin matching.
#include <chrono>
#include <cstdint>
#include <string>
#include <memory>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "common/result.h"
#include "credstore/secret.h"
#include "policy/host.h"
#include "policy/request_head.h"
#include "policy/scrubber.h"

namespace egress::policy {

using Clock = std::chrono::system_clock;
using TimePoint = Clock::time_point;

enum class Unpinned : uint8_t { Tunnel, Intercept };

enum class InjectType : uint8_t { Bearer, Basic, Header, AwsSigV4 };

struct InjectSpec {
    InjectType type = InjectType::Bearer;
    std::string username;                  // basic
    std::string header_name;               // header (lowercase after validation)
    std::string value_template = "{secret}";  // header: must contain "{secret}" once
    // aws-sigv4 (policy/aws_sigv4.h): the secret is the secret access key; these three are
    // not secret and name what it signs for ("AKIA...", "us-east-1", "s3").
    std::string access_key_id;
    std::string region;
    std::string service;

    bool operator==(const InjectSpec&) const = default;
};

/// Validates an injection: header names must be valid tokens and not transport headers
/// (is_transport_header) nor x-egress-*; the template has exactly one "{secret}" and no
/// CR/LF/NUL; a basic username has no ':' nor CR/LF/NUL. Returns the spec with the header
/// name lowercased. Errors name the field ("inject.name: ...").
Result<InjectSpec> validate_injection(InjectSpec spec);

/// What is wrong with a pin's path prefix ("must start with '/'", "must be a plain path ..."),
/// or nothing: a prefix with a query, fragment, space or control character never matches a
/// request's path, so a pin holding one would never inject. Config and API share it.
std::optional<std::string> path_prefix_problem(std::string_view prefix);

/// The header name an injection writes ("authorization" for bearer, basic and aws-sigv4).
std::string injected_header_name(const InjectSpec& spec);
/// The header value for a secret: "Bearer S", "Basic b64(user:S)", or the template filled;
/// "" for aws-sigv4 (a signature per request, aws_sign()).
/// WARNING: the result contains the secret; never log it.
std::string injected_header_value(const InjectSpec& spec, std::string_view secret);

inline constexpr size_t kMaxExtraHeaders = 20;

/// Validates configured extra headers: at most kMaxExtraHeaders, valid names that are not
/// transport headers, x-egress-* or the injected header, values without CR/LF/NUL. Returns
/// them with lowercase names; errors name the header ("headers.content-length: ...").
Result<std::vector<Header>> validate_extra_headers(const std::vector<Header>& headers,
                                                   const InjectSpec& inject);

struct AwsCredentials;  // policy/aws_sigv4.h
class AwsChunkSigner;   // policy/aws_sigv4.h

/// What injecting one pin's credential writes, and what its responses are scrubbed of. Made
/// once when the pin is built (prepare_injection), so a request copies the value into its
/// head and shares the plan: building both per request was ~3 k instructions and about
/// five allocations. WARNING: holds secret bytes (in mlock'ed buffers, wiped when dropped).
struct Injection {
    std::string header;                      // lowercase name ("authorization", ...)
    credstore::SecretPtr value;              // the header value: "Bearer S", ... ("" for aws)
    std::shared_ptr<const ScrubPlan> scrub;  // the secret, the value, a basic blob
    // aws-sigv4: what it signs with (null if the secret is not a valid credentials document:
    // `aws_error` says why, without a value).
    std::shared_ptr<AwsCredentials> aws;
    std::string aws_error;
};

/// The injection of `secret` by `spec` (injected_header_name, injected_header_value).
std::shared_ptr<const Injection> make_injection(const InjectSpec& spec,
                                                const credstore::SecretValue& secret);

struct Pin {
    std::string id;
    HostPattern host;
    std::vector<std::string> path_prefixes;  // empty: any path
    std::vector<std::string> methods;        // uppercase; empty: any method
    std::string secret_name;                 // for audit and explain; never the value
    InjectSpec inject;
    /// Static headers set along with the credential (at most kMaxExtraHeaders, never
    /// transport headers; checked by validate_extra_headers).
    std::vector<Header> extra_headers;
    credstore::SecretPtr secret;             // resolved value
    /// From inject and secret, by prepare_injection(); a pin without it (made by hand, as in
    /// tests) gets one made per request.
    std::shared_ptr<const Injection> injection;
    TimePoint expires_at = TimePoint::max();
};

/// Sets pin.injection from pin.inject and pin.secret (clears it without a secret). Call once
/// a pin's secret and injection are final.
void prepare_injection(Pin& pin);

/// prepare_injection() for the pins of one build, sharing: pins that inject the same secret
/// object the same way get one injection (and one pair of mlock'ed buffers, not one per pin:
/// a run of thousands of pins on one credential would otherwise lock thousands of pages), and
/// what remember() was given from the build before is kept rather than made again (a rebuild
/// costs no mlock and no planning for unchanged pins). Lives for one build.
class InjectionCache {
public:
    void remember(const Pin& pin);  // offers pin.injection, if any, for reuse
    void prepare(Pin& pin);         // sets pin.injection, reusing an equal one

private:
    struct Entry {
        credstore::SecretPtr secret;  // held, so the key's address cannot be reused meanwhile
        InjectSpec spec;
        std::shared_ptr<const Injection> injection;
    };
    /// The injection kept for pin's secret object and spec, or null.
    const std::shared_ptr<const Injection>* find(const Pin& pin) const;
    void add(const Pin& pin) {
        by_secret_[pin.secret.get()].push_back({pin.secret, pin.inject, pin.injection});
    }

    std::unordered_map<const credstore::SecretValue*, std::vector<Entry>> by_secret_;
};

/// Pins by host, so a run with thousands of pins matches a request in O(1) instead of
/// scanning them all: exact hosts, and wildcard pins by the parent they stand under.
struct PinIndex {
    std::unordered_map<std::string, std::vector<uint32_t>> exact;
    std::unordered_map<std::string, std::vector<uint32_t>> wildcard_parent;
    size_t pin_count = 0;  // the index is ignored unless it was built for exactly these pins
};

struct RunPolicy {
    std::string id;
    std::vector<HostPattern> allow_hosts;
    std::vector<Pin> pins;
    std::shared_ptr<const PinIndex> pin_index;  // optional; see index_pins()
    TimePoint expires_at = TimePoint::max();
    bool revoked = false;
};

struct GlobalPolicy {
    Unpinned unpinned = Unpinned::Tunnel;
    std::vector<HostPattern> allow_hosts;
    std::vector<uint16_t> allowed_ports{443};
    /// Hosts no run may reach, whatever its pins and allow lists say (policy.deny_hosts): a
    /// pattern without a port denies every port, one with a port only that port.
    std::vector<HostPattern> deny_hosts;
    /// Whether a request may switch its connection to a WebSocket (policy.websocket): false
    /// refuses every upgrade request (403 websocket_denied).
    bool websocket = true;
};

enum class Carry : uint8_t { Deny, Tunnel, Intercept };

struct DestinationDecision {
    Carry carry = Carry::Deny;
    /// Deny reasons: "run_expired", "run_revoked", "host_denied", "host_not_allowed",
    /// "port_not_allowed".
    std::string reason;
    bool pinned = false;  // some live pin of the run matches host (and port)
};

/// Builds run.pin_index for the current pins. Matching gives the same answers with or
/// without it (first matching pin in order); it only stops the scan over every pin.
void index_pins(RunPolicy& run);

/// Decides how a CONNECT (or absolute-form) destination is carried, before any byte leaves.
/// A host is pinned when a live pin matches it; allowed when the run's or the global allow
/// list matches it. Pinned → Intercept. Allowed, unpinned → global.unpinned. Otherwise Deny.
/// Port rule: a matching pattern that names its own port allows that port; a pattern without
/// a port allows `allowed_ports` only. Expired or revoked runs are denied, and so is a host
/// global.deny_hosts names, before any pin or allow list is looked at.
DestinationDecision decide_destination(const GlobalPolicy& global, const RunPolicy& run,
                                       const HostPort& dest, TimePoint now);

/// The port rule above for one pattern: its host matches, and its own port if it names one,
/// else one of `global.allowed_ports`.
bool pattern_allows(const HostPattern& p, const HostPort& dest, const GlobalPolicy& global);

/// True if any allow pattern (run or global) matches dest under the port rule above.
bool host_allowed(const GlobalPolicy& global, const RunPolicy& run, const HostPort& dest);

/// The first live pin matching host, port (under decide_destination's port rule), method
/// (exact, case-sensitive, uppercase) and path prefix. `path` is the origin-form path (query
/// ignored). Paths containing dot segments ("/./", "/../", trailing "/.." ), encoded dots or
/// slashes ("%2e", "%2f", case-insensitive) or backslashes never match a pin that has path
/// prefixes, so a prefix cannot be escaped. A prefix matches whole segments: "/repos/acme"
/// matches "/repos/acme" and "/repos/acme/x", not "/repos/acme-evil". With `head`, a pin
/// limited to methods or paths also requires what the request's override headers claim
/// (X-HTTP-Method-Override, X-HTTP-Method, X-Method-Override, a `_method` query parameter;
/// X-Original-URL, X-Rewrite-URL) to be among them; an aws-sigv4 S3 pin limited to paths or
/// to one bucket (a virtual-hosted name) also requires an x-amz-copy-source (the object a
/// copy reads) within them.
const Pin* match_pin(const GlobalPolicy& global, const RunPolicy& run, const HostPort& dest,
                     std::string_view method, std::string_view path, TimePoint now,
                     const RequestHead* head = nullptr);

/// Whether a decoded form key or multipart part name is `_method` to some server, ignoring
/// case (ASP.NET Core's forms do): as is, as PHP makes it a variable name (cut at a NUL,
/// leading spaces skipped, ' ', '.', '[' made '_'; also without the skip), or as Rack 2 reads
/// a plain key ("[_method]").
bool key_names_method(std::string_view key);

/// Whether every `_method` parameter of a query or form body ("a=1&_method=DELETE", keys as
/// PHP reads them) names a method `pin` allows, uppercased. Fails closed: a query that may
/// name `_method` and does not parse allows nothing.
bool form_method_matches(const Pin& pin, std::string_view query);

/// Whether a request's body may name another method to its server, which the methods of
/// `pin` (the pin match_pin chose) must then allow too: a POST, to a pin limited to methods,
/// with a form (application/x-www-form-urlencoded), multipart/form-data or JSON body (a
/// media type with "json"), from which Rails (Rack::MethodOverride), Laravel, Symfony,
/// Spring's HiddenHttpMethodFilter and ASP.NET Core take a `_method` field. The caller reads
/// such a body whole (bounded) and checks it with body_method_matches before it leaves.
bool body_may_override_method(const Pin& pin, const RequestHead& head);

/// Whether the `_method` fields of `body` name only methods `pin` allows (uppercased): a form's
/// `_method` keys (form_method_matches), the parts of a multipart body named `_method` (under
/// every boundary its content-type names), a JSON object's top-level "_method" (a value that
/// is not a string allows nothing). A body that is not what its type says carries none.
bool body_method_matches(const Pin& pin, const RequestHead& head, std::string_view body);

/// Whether `name` is a header match_pin reads as a method or path override, or an S3 copy
/// source (dropped from request trailers, where no pin match checks it).
bool is_override_header(std::string_view name);

/// True if a live pin matches host and port (port rule above; path and method ignored).
bool host_pinned(const GlobalPolicy& global, const RunPolicy& run, const HostPort& dest,
                 TimePoint now);

}  // namespace egress::policy
