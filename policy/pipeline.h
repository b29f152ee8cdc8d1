#pragma once
// The request pipeline: runs exactly once per request on the protocol-neutral head, for
// HTTP/1.1 and HTTP/2 alike. Serializers after it never decide policy.
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "policy/host.h"
#include "policy/request_head.h"
#include "policy/run_policy.h"

namespace egress::policy {

struct RequestContext {
    const GlobalPolicy* global = nullptr;
    const RunPolicy* run = nullptr;
    HostPort target;                 // CONNECT target, or the absolute-form URI's authority
    std::optional<std::string> sni;  // normalized TLS SNI on the intercepted leg, if any
    bool tls = false;                // request arrived inside an intercepted TLS session
    bool upstream_h2 = false;        // keep "te: trailers" for an HTTP/2 upstream
    bool body_empty = false;         // the request has no body (or content-length 0)
    TimePoint now{};
};

/// What the pipeline decided. status == 0 means forward.
struct Decision {
    int status = 0;
    std::string reason;              // machine-readable, e.g. "host_mismatch"
    const Pin* pin = nullptr;        // the pin whose credential was injected, if any
    std::string injected_header;     // lowercase header name, if injected
    /// What must not reach the sandbox in the response (the secret and the injected header
    /// value), the pin's shared plan; null when nothing was injected. Like `pin`, valid while
    /// the run policy it was decided with lives (a pin's prepared plan is borrowed, not
    /// owned). WARNING: secret bytes; feed to a Scrubber only.
    std::shared_ptr<const ScrubPlan> scrub;
    /// aws-sigv4 for a service that signs its payload's hash, and the client declared none:
    /// the head is not signed yet. The caller reads the body whole (bounded by
    /// limits.sign_body_bytes), then calls sign_with_body() before the head leaves.
    bool sign_body = false;
    /// Whether the credential itself went upstream (bearer, basic, header). aws-sigv4 sends a
    /// signature: an upstream cannot echo a key it never got, so the response need not be
    /// readable for the scrubber (accept-encoding is left as the client sent it, and an
    /// encoded answer passes); its session token, if any, signs nothing without the key.
    bool secret_sent = true;
    std::shared_ptr<AwsCredentials> aws;  // with sign_body: what signs it
    /// aws-sigv4 for a chunk-signed upload: the body's chunks are signed again as they pass
    /// (the exchange feeds it every piece of the body; policy/aws_sigv4.h).
    std::shared_ptr<AwsChunkSigner> aws_chunks;
    /// A POST whose body may name another method (`_method`) to a pin limited to methods
    /// (body_may_override_method): the caller reads the body whole (bounded by
    /// limits.method_body_bytes) and refuses it 403 "no_matching_pin", as match_pin does a
    /// `_method` query parameter, unless body_method_matches.
    bool check_body_method = false;

    bool forward() const { return status == 0; }
};

/// Signs a head the pipeline left unsigned (d.sign_body) with the hash of its whole `body`.
void sign_with_body(RequestHead& head, const Decision& d, std::string_view body, TimePoint now);

/// The fixed filter chain:
///  1. host agreement: the head's authority (Host / :authority; missing → 400
///     "missing_host", unparsable → 400 "bad_host") must equal ctx.target (host and port,
///     default port from the scheme), and ctx.sni, when set, must equal ctx.target.host;
///     else 421 "host_mismatch" / "sni_mismatch".
///  2. hygiene: any x-egress-* header from the sandbox → 403 "forged_egress_header" (checked
///     before stripping, so naming it in Connection does not hide it); strip hop-by-hop and
///     proxy-* headers; a name or value with CR/LF/NUL → 400 "bad_header".
///  3. pin match (only when ctx.tls; ports under decide_destination's rule): the matching
///     pin's credential replaces every value the client sent for that header, and
///     accept-encoding is set to "identity" so the scrubber can see the body. No pin matches
///     but the host has pins → forwarded without a credential if the host is also allowed,
///     else 403 "no_matching_pin". Over cleartext nothing is injected (reason
///     "cleartext_no_credential" is recorded while forwarding).
///     An aws-sigv4 pin signs the request instead (policy/aws_sigv4.h): a chunk-signed
///     upload other than STREAMING-AWS4-HMAC-SHA256-PAYLOAD, a presigned query or a malformed
///     x-amz-content-sha256 → 400 "aws_chunk_signing" / "aws_presigned_query" /
///     "bad_aws_payload_hash"; a secret that is no valid credentials
///     document → 503 "aws_credentials_invalid".
///  4. expiry: an expired or revoked run → 403 "run_expired" / "run_revoked".
class RequestPipeline {
public:
    Decision run(RequestHead& head, const RequestContext& ctx) const;
};

}  // namespace egress::policy
