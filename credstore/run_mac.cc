#include "credstore/run_mac.h"

#include "common/hex.h"
#include "credstore/envelope.h"

namespace egress::credstore {

namespace {

void field(std::string& out, std::string_view f) {
    out += std::to_string(f.size());
    out += ':';
    out += f;
}

void number(std::string& out, int64_t n) { field(out, std::to_string(n)); }

void list(std::string& out, const std::vector<std::string>& items) {
    number(out, static_cast<int64_t>(items.size()));
    for (const auto& i : items) {
        field(out, i);
    }
}

void scope(std::string& out, const Scope& s) {
    field(out, s.org);
    field(out, s.project);
    field(out, s.user);
    field(out, s.workflow);
}

}  // namespace

// WARNING: a field added to RunRecord, PinRecord or InjectRecord must be added here (or a
// record could be changed in that field without its MAC noticing), and, since records written
// before carry MACs without it, under a new version label.
std::string run_mac_input(const RunRecord& r) {
    std::string in = "egressd run record v1";
    field(in, r.id);
    scope(in, r.scope);
    field(in, r.token_sha256);
    number(in, r.created_at);
    number(in, r.expires_at);
    field(in, r.revoked ? "revoked" : "live");
    list(in, r.allow_hosts);
    list(in, r.source_cidrs);
    number(in, static_cast<int64_t>(r.pins.size()));
    for (const PinRecord& p : r.pins) {
        field(in, p.id);
        field(in, p.host);
        field(in, p.secret);
        field(in, p.inject.type);
        field(in, p.inject.username);
        field(in, p.inject.name);
        field(in, p.inject.value_template);
        // Stored only for an aws-sigv4 pin (state_store.cc), so covered only there: the
        // record read back must give the same input.
        const bool aws = p.inject.type == "aws-sigv4";
        field(in, aws ? p.inject.access_key_id : "");
        field(in, aws ? p.inject.region : "");
        field(in, aws ? p.inject.service : "");
        list(in, p.path_prefixes);
        list(in, p.methods);
        number(in, static_cast<int64_t>(p.extra_headers.size()));
        for (const auto& [name, value] : p.extra_headers) {
            field(in, name);
            field(in, value);
        }
        number(in, p.expires_at);
    }
    field(in, r.ca_cert_pem);
    field(in, r.ca_key.name);
    scope(in, r.ca_key.scope);
    field(in, std::to_string(r.ca_key.version));
    field(in, r.ca_key.created_at);
    field(in, r.ca_key.nonce);
    field(in, r.ca_key.ciphertext);
    return in;
}

std::string run_mac(const RunRecord& r, const SecretValue& key) {
    return egress::to_hex(hmac_sha256(key.reveal(), run_mac_input(r)));
}

void sign_run(RunRecord& r, const SecretValue& key) { r.mac = run_mac(r, key); }

bool run_mac_valid(const RunRecord& r, const SecretValue& key) {
    if (r.mac.size() != 64) {
        return false;
    }
    return constant_time_equals(run_mac(r, key), r.mac);
}

}  // namespace egress::credstore
