#include "policy/pipeline.h"

#include <cassert>

#include "policy/aws_sigv4.h"
#include "policy/header_rules.h"

namespace egress::policy {

namespace {

Decision refuse(int status, std::string reason) {
    Decision d;
    d.status = status;
    d.reason = std::move(reason);
    return d;
}

uint16_t default_port(const RequestHead& head, const RequestContext& ctx) {
    if (iequals(head.scheme, "https")) {
        return 443;
    }
    if (iequals(head.scheme, "http")) {
        return 80;
    }
    return ctx.tls ? 443 : 80;
}

// Step 1: the authority, the CONNECT target and the SNI name one destination.
std::optional<Decision> check_host_agreement(RequestHead& head, const RequestContext& ctx) {
    if (head.authority.empty()) {
        return refuse(400, "missing_host");
    }
    const uint16_t port = default_port(head, ctx);
    if (!spells_target(head.authority, ctx.target, port)) {
        Result<HostPort> authority = parse_authority(head.authority, port);
        if (!authority) {
            return refuse(400, "bad_host");
        }
        if (*authority != ctx.target) {
            return refuse(421, "host_mismatch");
        }
    }
    // The head never carries a Host header beside its authority; a codec that let one through
    // must not produce two different hosts on the wire.
    for (const Header& h : head.headers) {
        if (iequals(h.name, "host") && h.value != head.authority) {
            return refuse(421, "host_mismatch");
        }
    }
    head.remove("host");
    if (ctx.sni && *ctx.sni != ctx.target.host) {  // equal: normalize_host is idempotent
        Result<std::string> sni = normalize_host(*ctx.sni);
        if (!sni || *sni != ctx.target.host) {
            return refuse(421, "sni_mismatch");
        }
    }
    return std::nullopt;
}

// Step 2: hop-by-hop and proxy headers go; the proxy's namespace and broken fields are refused.
std::optional<Decision> check_hygiene(RequestHead& head, const RequestContext& ctx) {
    // Before stripping: a forged header named in Connection would otherwise be dropped
    // silently instead of refused and counted.
    for (const Header& h : head.headers) {
        if (is_egress_namespace(h.name)) {
            return refuse(403, "forged_egress_header");
        }
    }
    strip_hop_by_hop(head, ctx.upstream_h2);
    for (const Header& h : head.headers) {
        if (!valid_header_name(h.name) || !valid_header_value(h.value)) {
            return refuse(400, "bad_header");
        }
    }
    return std::nullopt;
}

void inject(RequestHead& head, const Pin& pin, const RequestContext& ctx, Decision& d) {
    std::shared_ptr<const Injection> made;  // only for a pin without prepare_injection()
    const Injection& inj =
        pin.injection ? *pin.injection : *(made = make_injection(pin.inject, *pin.secret));
    const bool aws = pin.inject.type == InjectType::AwsSigV4;
    AwsPayload payload;
    if (aws) {
        if (!inj.aws) {
            d = refuse(503, "aws_credentials_invalid");  // fail closed, never forward bare
            return;
        }
        payload = aws_payload(head, pin.inject, ctx.body_empty);
        if (payload.kind == AwsPayload::Kind::Refuse) {
            d = refuse(400, payload.reason);
            return;
        }
        head.remove("authorization");  // the sandbox's own signature, and its session
        head.remove("x-amz-security-token");
        // Signed as it is sent: the agreed destination in its one spelling, not the client's
        // (host agreement admits "S3.TEST", "s3.test." and an explicit default port), or
        // the upstream computes another canonical request and refuses the signature.
        head.authority = ctx.target.host_header(ctx.tls);
    } else {
        head.set(inj.header, std::string(inj.value->reveal()));  // replaces, never merges
        head.never_index = inj.header;
    }
    if (!aws) {
        // The scrubber finds an echoed credential only in a body it reads whole, as it was
        // sent: in the identity coding, and never a byte range of it (two ranges, or the
        // parts of one multipart/byteranges answer, would each hold a piece of the echo).
        // The upstream then answers 200 with the whole body, as RFC 9110 14.2 lets it.
        head.set("accept-encoding", "identity");
        head.remove("range");
        head.remove("if-range");
    }
    d.secret_sent = !aws;
    if (!head.upgrade.empty()) {
        // No WebSocket extension: permessage-deflate would carry an echoed credential past
        // the frame scrubber (policy/ws_frames.h), as a gzip body would past the body's.
        head.remove("sec-websocket-extensions");
    }
    for (const auto& h : pin.extra_headers) {  // validated at load: never transport headers
        head.set(h.name, h.value);
    }
    if (aws) {
        // Signed last, over the head as it leaves (extra x-amz-* headers included); a body
        // whose hash is needed is signed when the exchange has read it (sign_with_body).
        if (payload.kind == AwsPayload::Kind::NeedBody) {
            d.sign_body = true;
            d.aws = inj.aws;
        } else {
            if (payload.add_header) {
                head.set("x-amz-content-sha256", payload.hash);
            }
            AwsSignature seed = aws_sign(head, pin.inject, *inj.aws, payload.hash, ctx.now);
            if (payload.chunked) {
                d.aws_chunks = std::make_shared<AwsChunkSigner>(inj.aws, pin.inject,
                                                                std::move(seed));
            }
        }
    }
    d.pin = &pin;
    d.injected_header = inj.header;
    // A prepared injection lives as long as the pin (which the Decision already points to, and
    // which the caller's run keeps): the plan is then borrowed, not shared. Taking a reference
    // on the plan wrote, per request, a control block every worker's requests write.
    d.scrub = made ? inj.scrub
                   : std::shared_ptr<const ScrubPlan>(std::shared_ptr<const ScrubPlan>(),
                                                      inj.scrub.get());
    d.reason = "injected";
}

}  // namespace

Decision RequestPipeline::run(RequestHead& head, const RequestContext& ctx) const {
    assert(ctx.run != nullptr);
    if (ctx.run == nullptr) {
        return refuse(403, "no_run");
    }
    static const GlobalPolicy kDefaultGlobal;
    const GlobalPolicy& global = ctx.global != nullptr ? *ctx.global : kDefaultGlobal;
    const RunPolicy& run = *ctx.run;

    // Expiry comes first: an expired or revoked run gets nothing, not even a 421.
    if (run.revoked) {
        return refuse(403, "run_revoked");
    }
    if (run.expires_at <= ctx.now) {
        return refuse(403, "run_expired");
    }
    if (std::optional<Decision> d = check_host_agreement(head, ctx)) {
        return std::move(*d);
    }
    if (std::optional<Decision> d = check_hygiene(head, ctx)) {
        return std::move(*d);
    }
    // The destination is checked again here, so a request can never reach a host the
    // CONNECT-time decision would have refused.
    const DestinationDecision dest = decide_destination(global, run, ctx.target, ctx.now);
    if (dest.carry == Carry::Deny) {
        return refuse(403, dest.reason);
    }
    if (!head.upgrade.empty() && !global.websocket) {
        return refuse(403, "websocket_denied");
    }

    Decision d;
    const Pin* pin = match_pin(global, run, ctx.target, head.method, head.path, ctx.now, &head);
    if (!ctx.tls) {
        if (pin != nullptr || host_pinned(global, run, ctx.target, ctx.now)) {
            d.reason = "cleartext_no_credential";
        } else {
            d.reason = "allowed";
        }
        return d;
    }
    if (pin != nullptr) {
        if (!pin->secret) {
            return refuse(503, "secret_unavailable");  // fail closed, never forward bare
        }
        inject(head, *pin, ctx, d);
        // An aws-chunked body is S3's framing: no server that reads `_method` takes it.
        d.check_body_method = d.forward() && !ctx.body_empty && !d.aws_chunks &&
                              body_may_override_method(*pin, head);
        return d;
    }
    if (host_pinned(global, run, ctx.target, ctx.now)) {
        if (!host_allowed(global, run, ctx.target)) {
            return refuse(403, "no_matching_pin");
        }
        d.reason = "no_matching_pin_allowed";
        return d;
    }
    d.reason = "allowed";
    return d;
}

void sign_with_body(RequestHead& head, const Decision& d, std::string_view body, TimePoint now) {
    assert(d.sign_body && d.pin != nullptr && d.aws);
    aws_sign(head, d.pin->inject, *d.aws, aws_payload_hash(body), now);
}

}  // namespace egress::policy
