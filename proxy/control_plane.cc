#include "proxy/control_plane.h"

#include "common/burn_stack.h"

#include <fcntl.h>
#include <openssl/err.h>
#include <openssl/rand.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <limits>
#include <optional>
#include <map>
#include <set>
#include <unordered_map>
#include <fstream>

#include <boost/json.hpp>
#include <boost/json/basic_parser_impl.hpp>
#include <boost/url/parse.hpp>
#include <boost/url/params_view.hpp>
#include <boost/url/url_view.hpp>
#include <spdlog/spdlog.h>

#include "common/hex.h"
#include "common/secure_zero.h"
#include "common/wiping_json.h"
#include "policy/header_rules.h"
#include "credstore/run_mac.h"
#include "proxy/etcd_store.h"
#include "tls/run_ca.h"

namespace egress::proxy {

namespace json = boost::json;
using credstore::Scope;

namespace {

constexpr int64_t kDefaultRunTtl = 1800;
constexpr int64_t kMaxRunTtl = 7 * 24 * 3600;
// The records one `keys rotate` transaction writes to etcd, in bytes: below etcd's default
// --max-request-bytes (1.5 MiB), with room for the transaction's compares and framing.
constexpr size_t kRotateTxnBytes = 1 << 20;

int64_t unix_now() {
    return std::chrono::duration_cast<std::chrono::seconds>(
               std::chrono::system_clock::now().time_since_epoch())
        .count();
}

std::string rfc3339(int64_t t) {
    std::time_t tt = t;
    std::tm tm{};
    gmtime_r(&tt, &tm);
    char buf[32];
    std::strftime(buf, sizeof buf, "%Y-%m-%dT%H:%M:%SZ", &tm);
    return buf;
}

/// Run and pin ids, proxy tokens and the admin token. Fails closed: when OpenSSL's CSPRNG
/// fails, what the buffer holds is not random and a token made of it could be guessed, so the
/// process stops with a message instead of handing one out.
std::string random_hex(size_t bytes) {
    std::string raw(bytes, '\0');
    if (RAND_bytes(reinterpret_cast<unsigned char*>(raw.data()), static_cast<int>(bytes)) != 1) {
        char why[256] = "no OpenSSL error";
        if (const unsigned long e = ERR_get_error(); e != 0) {
            ERR_error_string_n(e, why, sizeof why);
        }
        spdlog::critical("RAND_bytes failed ({}): cannot make an unpredictable id or token; "
                         "stopping rather than hand out a guessable one",
                         why);
        spdlog::default_logger()->flush();
        std::abort();
    }
    std::string out = egress::to_hex(raw);
    egress::secure_zero(raw.data(), raw.size());
    return out;
}

ApiResponse error(int status, std::string_view err, std::string_view detail) {
    json::object o;
    o["error"] = err;
    o["detail"] = detail;
    return {status, json::serialize(o), {}};
}

ApiResponse ok(int status, const json::value& v) { return {status, json::serialize(v), {}}; }

/// A failed store write, by the prefix its error starts with: "not_found" 404, "conflict"
/// 409 (a concurrent change won), "etcd unreachable" 503 (retry later), anything else 500.
ApiResponse store_error(const std::string& e) {
    auto starts = [&](std::string_view p) { return e.rfind(p, 0) == 0; };
    if (starts("not_found")) return error(404, "not_found", e);
    if (starts("conflict")) return error(409, "conflict", e);
    if (starts("etcd unreachable")) return error(503, "store_unavailable", e);
    return error(500, "store_failed", e);
}

json::value scope_json(const Scope& s) {
    json::object o;
    o["org"] = s.org;
    if (!s.project.empty()) o["project"] = s.project;
    if (!s.user.empty()) o["user"] = s.user;
    if (!s.workflow.empty()) o["workflow"] = s.workflow;
    return o;
}

/// What the API says about a secret: never its value.
json::value secret_meta_json(const credstore::SealedSecret& s) {
    json::object o;
    o["name"] = s.name;
    o["scope"] = scope_json(s.scope);
    o["version"] = s.version;
    o["created_at"] = s.created_at;
    return o;
}

/// Appends `field` with its length first, so that different field lists never make the same
/// bytes.
void append_field(std::string& out, std::string_view field) {
    out += std::to_string(field.size());
    out += ':';
    out += field;
}

/// What tells one sealing of a secret from every other: a digest of its nonce and ciphertext
/// (GCM tag included), both new for every POST and PUT, so a secret deleted and created again
/// with the same name, scope and version (1) is not taken for the one before. A KEK rotation
/// re-wraps the data key only and leaves it as it was (no rebuild of a dynamic run, no unwrap
/// per pin through keys.kms_command; a static run's fingerprint names the key id as well, so
/// its store pins are unsealed again). Public bytes only, never the value; 128 bits of SHA-256.
std::string sealing_id(const credstore::SealedSecret& s) {
    std::string in;
    in.reserve(s.nonce.size() + s.ciphertext.size() + 16);
    append_field(in, s.nonce);
    append_field(in, s.ciphertext);
    return credstore::sha256_hex(in).substr(0, 32);
}

/// sealing_id() once per sealed record of one build's snapshot (which outlives it, so the
/// addresses are stable): pins sharing a secret, the usual case, hash it once.
class SealingIds {
public:
    const std::string& of(const credstore::SealedSecret& s) {
        auto [it, added] = ids_.try_emplace(&s);
        if (added) {
            it->second = sealing_id(s);
        }
        return it->second;
    }

private:
    std::unordered_map<const credstore::SealedSecret*, std::string> ids_;
};

/// unseal_cached()'s key: a digest of every field of the sealed record, so two records share
/// a value only when they are the same record. (A prefix of the wrapped data key is not
/// enough: a KMS whose output begins with a fixed header gives every record the same one.)
std::string sealed_record_key(const credstore::SealedSecret& s) {
    std::string in;
    in.reserve(s.wrapped_dek.size() + s.nonce.size() + s.ciphertext.size() + s.name.size() +
               s.kek_id.size() + 128);
    append_field(in, s.name);
    append_field(in, s.scope.org);
    append_field(in, s.scope.project);
    append_field(in, s.scope.user);
    append_field(in, s.scope.workflow);
    append_field(in, std::to_string(s.version));
    append_field(in, s.created_at);
    append_field(in, s.kek_id);
    append_field(in, s.wrapped_dek);
    append_field(in, s.nonce);
    append_field(in, s.ciphertext);
    return credstore::sha256_hex(in);
}

/// Reads an optional string field; errors name it.
Result<std::string> get_string(const json::object& o, const char* key, const std::string& path,
                               bool required) {
    auto* v = o.if_contains(key);
    if (v == nullptr || v->is_null()) {
        if (required) {
            return make_error(path + key + ": required");
        }
        return std::string();
    }
    if (!v->is_string()) {
        return make_error(path + key + ": must be a string");
    }
    return std::string(v->as_string());
}

Result<std::vector<std::string>> get_strings(const json::object& o, const char* key,
                                             const std::string& path) {
    std::vector<std::string> out;
    auto* v = o.if_contains(key);
    if (v == nullptr || v->is_null()) {
        return out;
    }
    if (!v->is_array()) {
        return make_error(path + key + ": must be an array of strings");
    }
    for (size_t i = 0; i < v->as_array().size(); ++i) {
        const auto& e = v->as_array()[i];
        if (!e.is_string()) {
            return make_error(path + key + "[" + std::to_string(i) + "]: must be a string");
        }
        out.emplace_back(e.as_string());
    }
    return out;
}

Result<Scope> get_scope(const json::object& o, const std::string& path) {
    auto* v = o.if_contains("scope");
    if (v == nullptr || !v->is_object()) {
        return make_error(path + "scope: required object {org, project?, user?, workflow?}");
    }
    Scope s;
    for (const auto& [k, val] : v->as_object()) {
        if (!val.is_string()) {
            return make_error(path + "scope." + std::string(k) + ": must be a string");
        }
        std::string sv(val.as_string());
        if (k == "org") s.org = sv;
        else if (k == "project") s.project = sv;
        else if (k == "user") s.user = sv;
        else if (k == "workflow") s.workflow = sv;
        else return make_error(path + "scope." + std::string(k) + ": unknown field");
    }
    if (auto valid = s.validate(); !valid) {
        return make_error(path + valid.error());
    }
    return s;
}

Result<int64_t> get_int(const json::object& o, const char* key, const std::string& path,
                        int64_t dflt, int64_t lo, int64_t hi) {
    auto* v = o.if_contains(key);
    if (v == nullptr || v->is_null()) {
        return dflt;
    }
    if (!v->is_int64() && !v->is_uint64()) {
        return make_error(path + key + ": must be an integer");
    }
    int64_t n = v->is_int64() ? v->as_int64() : static_cast<int64_t>(v->as_uint64());
    if (n < lo || n > hi) {
        return make_error(path + key + ": must be between " + std::to_string(lo) + " and " +
                          std::to_string(hi));
    }
    return n;
}

/// A pass over a body that builds nothing and finds the first key given twice in one object,
/// by its path ("scope.org"). boost::json keeps the last silently; a proxy or audit tool in
/// front of the API that reads the first would see another request than egressd acts on.
class DuplicateKeyFinder {
public:
    static constexpr size_t max_object_size = static_cast<size_t>(-1);
    static constexpr size_t max_array_size = static_cast<size_t>(-1);
    static constexpr size_t max_key_size = static_cast<size_t>(-1);
    static constexpr size_t max_string_size = static_cast<size_t>(-1);

    explicit DuplicateKeyFinder(std::string root) : root_(std::move(root)) {}
    const std::string& duplicate() const { return duplicate_; }

    bool on_document_begin(boost::system::error_code&) { return true; }
    bool on_document_end(boost::system::error_code&) { return true; }
    bool on_object_begin(boost::system::error_code&) { return open(false); }
    bool on_object_end(size_t, boost::system::error_code&) { return close(); }
    bool on_array_begin(boost::system::error_code&) { return open(true); }
    bool on_array_end(size_t, boost::system::error_code&) { return close(); }
    bool on_key_part(std::string_view s, size_t, boost::system::error_code&) {
        key_.append(s);
        return true;
    }
    bool on_key(std::string_view s, size_t, boost::system::error_code& ec) {
        key_.append(s);
        Frame& f = frames_.back();
        if (!f.keys.insert(key_).second) {
            duplicate_ = f.path.empty() ? key_ : f.path + "." + key_;
            ec = boost::system::errc::make_error_code(boost::system::errc::invalid_argument);
            return false;
        }
        f.key = std::move(key_);
        key_.clear();
        return true;
    }
    bool on_string_part(std::string_view, size_t, boost::system::error_code&) { return true; }
    bool on_string(std::string_view, size_t, boost::system::error_code&) { return scalar(); }
    bool on_number_part(std::string_view, boost::system::error_code&) { return true; }
    bool on_int64(int64_t, std::string_view, boost::system::error_code&) { return scalar(); }
    bool on_uint64(uint64_t, std::string_view, boost::system::error_code&) { return scalar(); }
    bool on_double(double, std::string_view, boost::system::error_code&) { return scalar(); }
    bool on_bool(bool, boost::system::error_code&) { return scalar(); }
    bool on_null(boost::system::error_code&) { return scalar(); }
    bool on_comment_part(std::string_view, boost::system::error_code&) { return true; }
    bool on_comment(std::string_view, boost::system::error_code&) { return true; }

private:
    struct Frame {
        std::string path;
        bool array = false;
        size_t index = 0;            // arrays: the next element's
        std::string key;             // objects: the current member's
        std::set<std::string> keys;  // objects: every key so far
    };

    /// The path of the value that starts now (and counts it, inside an array).
    std::string value_path() {
        if (frames_.empty()) {
            return root_;
        }
        Frame& f = frames_.back();
        if (f.array) {
            return f.path + "[" + std::to_string(f.index++) + "]";
        }
        return f.path.empty() ? f.key : f.path + "." + f.key;
    }
    bool open(bool array) {
        Frame f;
        f.path = value_path();
        f.array = array;
        frames_.push_back(std::move(f));
        return true;
    }
    bool close() {
        frames_.pop_back();
        return true;
    }
    bool scalar() {
        (void)value_path();
        return true;
    }

    std::string root_;  // the body's own path ("pin")
    std::vector<Frame> frames_;
    std::string key_;
    std::string duplicate_;
};

/// Parses a request body that may hold a secret value: a key given twice is refused ("name:
/// given more than once", its path under `root`), and every block the parse frees is zeroed
/// (WipingJsonResource), the parser's own stack included.
Result<json::value> parse_json(std::string_view body, const std::string& root = "") {
    {
        json::basic_parser<DuplicateKeyFinder> finder(json::parse_options{}, root);
        boost::system::error_code ec;
        finder.write_some(false, body.data(), body.size(), ec);
        if (!finder.handler().duplicate().empty()) {
            return make_error(finder.handler().duplicate() + ": given more than once");
        }
        // Syntax errors are reported by the parse below.
    }
    json::storage_ptr wiping = json::make_shared_resource<WipingJsonResource>();
    unsigned char temp[BOOST_JSON_STACK_BUFFER_SIZE];
    boost::system::error_code ec;
    json::value v(wiping);  // same resource: assigning the result moves it, never copies
    {
        json::parser p(wiping, json::parse_options{}, temp, sizeof temp);
        p.reset(wiping);
        p.write(body.data(), body.size(), ec);
        if (!ec) {
            v = p.release();
        }
    }
    egress::secure_zero(temp, sizeof temp);
    if (ec) {
        return make_error("body: invalid JSON: " + ec.message());
    }
    return v;
}

Result<json::object> parse_body(std::string_view body) {
    auto v = parse_json(body);
    if (!v) {
        return make_error(v.error());
    }
    if (!v->is_object()) {
        return make_error("body: must be a JSON object");
    }
    return std::move(v->as_object());  // moved, not copied: one copy of a secret value to wipe
}

/// Wipes a parsed secret value in place when the request is done (admin.cc wipes the raw body).
struct WipeField {
    json::object& object;
    const char* key;
    ~WipeField() {
        if (auto* v = object.if_contains(key); v != nullptr && v->is_string()) {
            auto& str = v->as_string();
            egress::secure_zero(str.data(), str.size());
        }
    }
};

policy::InjectType inject_type(const std::string& t) {
    return t == "basic"       ? policy::InjectType::Basic
           : t == "header"    ? policy::InjectType::Header
           : t == "aws-sigv4" ? policy::InjectType::AwsSigV4
                              : policy::InjectType::Bearer;
}

policy::InjectSpec to_spec(const credstore::InjectRecord& r) {
    policy::InjectSpec s;
    s.type = inject_type(r.type);
    s.username = r.username;
    s.header_name = r.name;
    s.value_template = r.value_template.empty() ? "{secret}" : r.value_template;
    s.access_key_id = r.access_key_id;
    s.region = r.region;
    s.service = r.service;
    return s;
}

/// The key ids the state's sealed records name ("file:1a2b3c4d", "kms:k1"), comma-separated,
/// or "" when it holds no sealed record.
std::string sealed_kek_ids(const credstore::StateSnapshot& snap) {
    std::set<std::string> ids;
    for (const auto& [k, sec] : snap.secrets) {
        ids.insert(sec.kek_id);
    }
    for (const auto& [k, run] : snap.runs) {
        ids.insert(run.ca_key.kek_id);
    }
    std::string out;
    for (const auto& id : ids) {
        out += (out.empty() ? "" : ", ") + id;
    }
    return out;
}

/// A route's query parameters, percent-decoded, by name. Refused (the error names the
/// parameter): a name not in `allowed`, a name given twice, a query that does not parse. A
/// misspelled `scope` on DELETE /v1/secrets/{name} had deleted the secret in every scope.
Result<std::map<std::string, std::string, std::less<>>> query_params(
    std::string_view query, std::initializer_list<std::string_view> allowed) {
    std::map<std::string, std::string, std::less<>> out;
    if (query.empty()) {
        return out;
    }
    std::string origin = "/?" + std::string(query);
    auto u = boost::urls::parse_origin_form(origin);
    if (!u) {
        return make_error("query: not a valid query string");
    }
    for (auto p : u->params()) {  // percent-decoded
        if (std::find(allowed.begin(), allowed.end(), p.key) == allowed.end()) {
            return make_error("query: unknown parameter '" + p.key + "'");
        }
        if (!out.emplace(p.key, p.value).second) {
            return make_error("query: parameter '" + p.key + "' given twice");
        }
    }
    return out;
}

json::value pin_json(const credstore::PinRecord& p) {
    json::object o;
    o["id"] = p.id;
    o["host"] = p.host;
    o["secret"] = p.secret;
    json::object inj;
    inj["type"] = p.inject.type;
    if (!p.inject.username.empty()) inj["username"] = p.inject.username;
    if (!p.inject.name.empty()) inj["name"] = p.inject.name;
    if (p.inject.type == "header") inj["template"] = p.inject.value_template;
    if (p.inject.type == "aws-sigv4") {  // names what it signs for; the key stays a secret
        if (!p.inject.access_key_id.empty()) inj["access_key_id"] = p.inject.access_key_id;
        inj["region"] = p.inject.region;
        inj["service"] = p.inject.service;
    }
    o["inject"] = inj;
    o["path_prefixes"] = json::value_from(p.path_prefixes);
    o["methods"] = json::value_from(p.methods);
    json::array hdrs;
    for (const auto& h : p.extra_headers) {
        hdrs.push_back(json::value(h.first));  // names only; values may be sensitive
    }
    o["headers"] = hdrs;
    o["expires_at"] = rfc3339(p.expires_at);
    return o;
}

/// A static run's pin as a record, for pin_json: what the config made of it.
credstore::PinRecord pin_record(const policy::Pin& p) {
    credstore::PinRecord r;
    r.id = p.id;
    r.host = p.host.text();
    r.secret = p.secret_name;
    r.inject.type = p.inject.type == policy::InjectType::Bearer     ? "bearer"
                    : p.inject.type == policy::InjectType::Basic    ? "basic"
                    : p.inject.type == policy::InjectType::AwsSigV4 ? "aws-sigv4"
                                                                    : "header";
    r.inject.username = p.inject.username;
    r.inject.name = p.inject.header_name;
    r.inject.value_template = p.inject.value_template;
    r.inject.access_key_id = p.inject.access_key_id;
    r.inject.region = p.inject.region;
    r.inject.service = p.inject.service;
    r.path_prefixes = p.path_prefixes;
    r.methods = p.methods;
    for (const auto& h : p.extra_headers) r.extra_headers.emplace_back(h.name, h.value);
    r.expires_at = p.expires_at == policy::TimePoint::max()
                       ? 0
                       : std::chrono::duration_cast<std::chrono::seconds>(
                             p.expires_at.time_since_epoch())
                             .count();
    return r;
}

/// GET /v1/runs/{id} of a static run (config `runs`): read-only, "static": true; no
/// created_at, and expires_at null for a run as long as the process.
json::object static_run_json(const Run& r) {
    json::object out;
    out["id"] = r.policy.id;
    out["static"] = true;
    out["scope"] = scope_json(r.scope);
    const bool forever = r.policy.expires_at == policy::TimePoint::max();
    const int64_t expires =
        forever ? 0
                : std::chrono::duration_cast<std::chrono::seconds>(
                      r.policy.expires_at.time_since_epoch())
                      .count();
    out["expires_at"] = forever ? json::value(nullptr) : json::value(rfc3339(expires));
    out["revoked"] = false;
    out["expired"] = !forever && expires <= unix_now();
    json::array allow;
    for (const auto& h : r.policy.allow_hosts) allow.push_back(json::value(h.text()));
    out["allow_hosts"] = allow;
    json::array sources;
    for (const auto& c : r.sources) sources.push_back(json::value(c.to_string()));
    out["source_cidrs"] = sources;
    json::array pins;
    auto add = [&pins](const policy::Pin& p) {
        json::value j = pin_json(pin_record(p));
        if (p.expires_at == policy::TimePoint::max()) j.as_object()["expires_at"] = nullptr;
        pins.push_back(std::move(j));
    };
    for (const auto& p : r.policy.pins) add(p);
    for (const auto& sp : r.store_pins) add(sp.pin);  // `secret: NAME` pins, by the run's scope
    out["pins"] = pins;
    out["ca_pem"] = r.ca ? r.ca->cert_pem() : std::string();
    return out;
}

}  // namespace

void KeyRing::add(std::unique_ptr<credstore::KeyProvider> p, bool primary) {
    auto id = p->key_id();
    auto* raw = p.get();
    providers_[id] = std::move(p);
    if (primary || primary_ == nullptr) {
        primary_ = raw;
    }
}

credstore::KeyProvider* KeyRing::find(const std::string& key_id) {
    auto it = providers_.find(key_id);
    if (it != providers_.end()) {
        return it->second.get();
    }
    // A KMS plugin's key id moves with its key version (Kubernetes KMS v2 plugins report a
    // new one after the KMS rotated), and the plugin still unwraps what an earlier version
    // wrapped (its ciphertext names the version): a record sealed under an earlier "kms:" id
    // goes to the KMS, and `keys rotate` rewraps it under the current id. A KMS that cannot
    // unwrap it says so in the unwrap error.
    if (key_id.starts_with("kms:")) {
        for (auto& [id, p] : providers_) {
            if (id.starts_with("kms:")) {
                return p.get();
            }
        }
    }
    return nullptr;
}

Result<std::unique_ptr<ControlPlane>> ControlPlane::open(std::shared_ptr<const Runtime> statics) {
    std::unique_ptr<ControlPlane> cp(new ControlPlane());
    cp->statics_ = statics;
    cp->config_ = statics->config;
    const Config& cfg = *cp->config_;

    // Admin token: created 0600 on first start.
    std::error_code fec;
    auto tpath = std::filesystem::path(cfg.admin_token_file);
    if (!tpath.parent_path().empty()) {
        std::filesystem::create_directories(tpath.parent_path(), fec);
    }
    if (!std::filesystem::exists(tpath, fec)) {
        std::string tok = random_hex(32) + "\n";
        auto created = credstore::create_secret_file(cfg.admin_token_file, tok);
        egress::secure_zero(tok.data(), tok.size());
        if (!created) {
            return make_error("admin.token_file: " + created.error());
        }
    }
    auto tok = credstore::load_owner_only_secret_file("admin.token_file", cfg.admin_token_file);
    if (!tok) {
        return make_error(tok.error());
    }
    cp->admin_token_ = *tok;

    // The state first: whether a missing master key file may be created depends on it.
    if (cfg.state_backend == "etcd") {
        auto store = open_etcd_store(cfg.etcd, cfg.resolver_servers, cfg.resolver_overrides);
        if (!store) {
            return make_error(store.error());  // names the state.etcd key to fix
        }
        cp->store_ = std::move(*store);
    } else {
        auto store = credstore::FileStateStore::open(cfg.state_path);
        if (!store) {
            return make_error("state.path: " + store.error());
        }
        cp->store_ = std::move(*store);
    }
    // Master key (KEK).
    if (cfg.kms_command) {
        auto p = credstore::make_kms_command_provider(*cfg.kms_command);
        if (!p) {
            return make_error("keys.kms_command: " + p.error());
        }
        cp->keys_.add(std::move(*p), true);
    } else {
        // A key file is made only for a state that holds nothing sealed: a missing file with
        // sealed records is a volume not mounted or a wrong path, and a new key would have
        // left every record unreadable and sealed new ones under a second key.
        bool create = !std::filesystem::exists(cfg.master_key_file, fec);
        if (create) {
            if (auto sealed = sealed_kek_ids(*cp->store_->snapshot()); !sealed.empty()) {
                const bool kms_only = sealed.find("file:") == std::string::npos;
                return make_error(
                    "keys.master_key_file: " + cfg.master_key_file +
                    " does not exist, but the state holds records sealed under " + sealed +
                    (kms_only ? ": set keys.kms_command to the KMS that sealed them"
                              : ": restore that key file, or point keys.master_key_file at it") +
                    " (a new key would unseal none of them)");
            }
        }
        auto p = credstore::open_master_key_file(cfg.master_key_file, create);
        if (!p) {
            return make_error(p.error());
        }
        cp->keys_.add(std::move(*p), true);
        std::string next = cfg.master_key_file + ".next";
        if (std::filesystem::exists(next, fec)) {
            // A rotation was interrupted: the state may use either key. Load both; the next
            // rotation (or this start, below) finishes the move to the new key.
            auto n = credstore::open_master_key_file(next, false);
            if (!n) {
                return make_error(n.error());
            }
            cp->keys_.add(std::move(*n), false);
        }
    }

    if (std::filesystem::exists(cfg.master_key_file + ".next", fec)) {
        // Records no key unwraps are skipped (named in a warning), so this completes unless
        // the new key or the store fails. Then egressd still starts, with both keys loaded
        // (the state may use either): refusing would keep it down until the state is mended.
        auto r = cp->rotate_keys();
        if (r.status >= 300) {
            const std::string loaded =
                cfg.kms_command ? ""
                                : " with both " + cfg.master_key_file + " and its .next loaded";
            spdlog::warn("keys.master_key_file: finishing the rotation interrupted at {}.next "
                         "failed ({}); starting{}: fix the cause, then run `egressctl keys "
                         "rotate` again",
                         cfg.master_key_file, r.body, loaded);
        }
    }
    return cp;
}

bool ControlPlane::authorized(std::string_view h) const {
    constexpr std::string_view kBearer = "Bearer ";  // the scheme is case-insensitive
    if (h.size() <= kBearer.size() || !policy::iequals(h.substr(0, kBearer.size()), kBearer)) {
        return false;
    }
    credstore::SecretPtr token;
    {
        std::lock_guard lock(token_mu_);
        token = admin_token_;
    }
    return credstore::constant_time_equals(h.substr(kBearer.size()), token->reveal());
}

void ControlPlane::set_admin_token(credstore::SecretPtr token) {
    std::lock_guard lock(token_mu_);
    admin_token_ = std::move(token);
}

void ControlPlane::on_change(std::function<void()> cb) {
    store_->on_change([cb = std::move(cb)](auto) { cb(); });
}

void ControlPlane::stop_store() { store_->stop(); }

ApiResponse ControlPlane::handle(std::string_view method, std::string_view target,
                                 std::string_view body) {
    auto url = boost::urls::parse_origin_form(target);
    if (!url) {
        return error(400, "bad_request", "target does not parse");
    }
    std::vector<std::string> seg;
    for (auto s : url->segments()) {
        seg.emplace_back(s);
    }
    std::string_view query =
        url->has_query() ? std::string_view(url->encoded_query()) : std::string_view();
    // The route first, then the method: a known path with another method is 405 with the
    // methods it takes, not 404.
    const size_t n = seg.size();
    const bool v1 = n >= 2 && seg[0] == "v1";
    const bool secrets = v1 && seg[1] == "secrets";
    const bool runs = v1 && seg[1] == "runs";
    const char* allow = nullptr;
    if (secrets && n == 2) {
        if (method == "POST") return create_secret(body);
        if (method == "GET") return list_secrets();
        allow = "GET, POST";
    } else if (secrets && n == 3) {
        if (method == "PUT") return rotate_secret(seg[2], body);
        if (method == "DELETE") return delete_secret(seg[2], query);
        allow = "PUT, DELETE";
    } else if (runs && n == 2) {
        if (method == "POST") return create_run(body);
        allow = "POST";
    } else if (runs && n == 3) {
        if (method == "GET") return show_run(seg[2]);
        if (method == "DELETE") return revoke_run(seg[2]);
        allow = "GET, DELETE";
    } else if (runs && n == 4 && seg[3] == "pins") {
        if (method == "POST") return add_pin(seg[2], body);
        allow = "POST";
    } else if (runs && n == 4 && seg[3] == "explain") {
        if (method == "GET") return explain(seg[2], query);
        allow = "GET";
    } else if (v1 && n == 3 && seg[1] == "keys" && seg[2] == "rotate") {
        if (method == "POST") {
            ApiResponse r = rotate_keys();
            egress::burn_stack();  // the retired and the new key went through its callees
            return r;
        }
        allow = "POST";
    }
    const std::string route = std::string(method) + " " + std::string(url->encoded_path());
    if (allow == nullptr) {
        return error(404, "not_found", "no such route: " + route);
    }
    ApiResponse r = error(405, "method_not_allowed",
                          "no such route: " + route + " (allowed: " + allow + ")");
    r.allow = allow;
    return r;
}

Result<credstore::SecretPtr> ControlPlane::unseal_cached(const credstore::SealedSecret& s) {
    const std::string key = sealed_record_key(s);
    if (auto it = unsealed_.find(key); it != unsealed_.end()) {
        return it->second;
    }
    auto* kp = keys_.find(s.kek_id);
    if (kp == nullptr) {
        return make_error("no key '" + s.kek_id + "' to unwrap " + s.name);
    }
    auto v = credstore::unseal(*kp, s);
    if (!v) {
        return make_error(v.error());
    }
    unsealed_[key] = *v;
    return *v;
}

Result<credstore::SecretPtr> ControlPlane::verified_run_mac_key(const credstore::RunRecord& r,
                                                                credstore::SecretPtr* ca_key_out) {
    if (r.mac.empty()) {
        return make_error("its record has no MAC (written by an egressd from before run "
                          "records were authenticated)");
    }
    if (r.ca_key.name != "ca:" + r.id) {
        return make_error("its record's CA key belongs to '" + r.ca_key.name + "'");
    }
    const std::string sealing = r.ca_key.nonce + "|" + r.ca_key.ciphertext;
    credstore::SecretPtr key;
    {
        std::lock_guard mac_lock(mac_mu_);
        auto it = run_mac_keys_.find(r.id);
        if (it != run_mac_keys_.end() && it->second.sealing == sealing) {
            key = it->second.key;
        }
    }
    if (!key) {
        auto* kp = keys_.find(r.ca_key.kek_id);
        if (kp == nullptr) {
            return make_error("no key '" + r.ca_key.kek_id + "' unwraps its CA key");
        }
        auto ca_key = credstore::unseal(*kp, r.ca_key, &key);
        if (!ca_key) {
            return make_error("its CA key: " + ca_key.error());
        }
        if (ca_key_out != nullptr) {
            *ca_key_out = *ca_key;  // the caller loads the CA from it: one unwrap, not two
        }
        std::lock_guard mac_lock(mac_mu_);
        run_mac_keys_[r.id] = {sealing, key};
    }
    if (!credstore::run_mac_valid(r, *key)) {
        return make_error("its record does not verify (changed outside egressd)");
    }
    return key;
}

ApiResponse ControlPlane::create_secret(std::string_view body) {
    auto o = parse_body(body);
    if (!o) return error(400, "invalid_request", o.error());
    WipeField wipe{*o, "value"};
    auto name = get_string(*o, "name", "", true);
    if (!name) return error(400, "invalid_request", name.error());
    if (!credstore::valid_secret_name(*name)) {
        return error(400, "invalid_request", std::string("name: ") + credstore::kSecretNameRule);
    }
    auto scope = get_scope(*o, "");
    if (!scope) return error(400, "invalid_request", scope.error());
    auto value = get_string(*o, "value", "", true);
    if (!value) return error(400, "invalid_request", value.error());
    for (const auto& [k, v] : *o) {
        if (k != "name" && k != "scope" && k != "value") {
            egress::secure_zero(value->data(), value->size());
            return error(400, "invalid_request", std::string(k) + ": unknown field");
        }
    }
    std::lock_guard lock(mu_);
    auto snap = store_->snapshot();
    if (snap->secrets.count(credstore::secret_key(*name, *scope)) != 0) {
        egress::secure_zero(value->data(), value->size());
        return error(409, "conflict", "secret '" + *name + "' already exists in scope " +
                                          scope->to_string() + "; use PUT to rotate it");
    }
    return store_secret(*name, *scope, 1, *value, 201);
}

ApiResponse ControlPlane::rotate_secret(const std::string& name, std::string_view body) {
    auto o = parse_body(body);
    if (!o) return error(400, "invalid_request", o.error());
    WipeField wipe{*o, "value"};
    auto scope = get_scope(*o, "");
    if (!scope) return error(400, "invalid_request", scope.error());
    auto value = get_string(*o, "value", "", true);
    if (!value) return error(400, "invalid_request", value.error());
    for (const auto& [k, v] : *o) {
        if (k != "scope" && k != "value") {
            egress::secure_zero(value->data(), value->size());
            return error(400, "invalid_request", std::string(k) + ": unknown field");
        }
    }
    std::lock_guard lock(mu_);
    auto snap = store_->snapshot();
    auto it = snap->secrets.find(credstore::secret_key(name, *scope));
    if (it == snap->secrets.end()) {
        egress::secure_zero(value->data(), value->size());
        return error(404, "not_found", "no secret '" + name + "' in scope " + scope->to_string());
    }
    return store_secret(name, *scope, it->second.version + 1, *value, 200);
}

ApiResponse ControlPlane::store_secret(const std::string& name, const Scope& scope,
                                       uint64_t version, std::string& value, int status) {
    auto sealed = credstore::seal(keys_.primary(), name, scope, version, value);
    egress::secure_zero(value.data(), value.size());
    if (!sealed) return error(400, "invalid_request", "value: " + sealed.error());
    credstore::Mutation m;
    m.kind = credstore::Mutation::Kind::PutSecret;
    m.secret = *sealed;
    // Versions are consecutive: another replica that rotated meanwhile makes this a 409
    // instead of two values under one version.
    m.expect_version = version - 1;
    if (auto r = store_->apply({m}); !r) return store_error(r.error());
    return ok(status, secret_meta_json(*sealed));
}

ApiResponse ControlPlane::list_secrets() {
    auto snap = store_->snapshot();
    json::array arr;
    for (const auto& [k, s] : snap->secrets) {
        arr.push_back(secret_meta_json(s));
    }
    json::object out;
    out["secrets"] = arr;
    return ok(200, out);
}

ApiResponse ControlPlane::delete_secret(const std::string& name, std::string_view query) {
    credstore::Mutation m;
    m.kind = credstore::Mutation::Kind::DeleteSecret;
    m.name = name;
    auto params = query_params(query, {"scope"});
    if (!params) return error(400, "invalid_request", params.error());
    if (auto it = params->find("scope"); it != params->end()) {
        // Without the parameter the secret goes in every scope; an empty one is a mistake,
        // not that.
        if (it->second.empty()) {
            return error(400, "invalid_request",
                         "scope: empty (omit the parameter to delete the secret in every scope)");
        }
        auto sc = credstore::parse_scope(it->second);
        if (!sc) return error(400, "invalid_request", sc.error());
        m.scope = *sc;
    }
    std::lock_guard lock(mu_);
    if (auto r = store_->apply({m}); !r) return store_error(r.error());
    return {204, "", {}};
}

namespace {

Result<credstore::PinRecord> parse_pin(const json::value& v, const std::string& path,
                                       const Scope& run_scope, const credstore::StateSnapshot& snap,
                                       int64_t run_expires, int64_t now) {
    if (!v.is_object()) {
        return make_error(path + ": must be an object");
    }
    const auto& o = v.as_object();
    static const std::set<std::string_view> kKeys{"host",    "secret",        "inject",
                                                  "methods", "path_prefixes", "ttl_seconds",
                                                  "headers"};
    for (const auto& [k, _] : o) {
        if (kKeys.count(k) == 0) {
            return make_error(path + "." + std::string(k) + ": unknown field");
        }
    }
    credstore::PinRecord p;
    p.id = "pin_" + random_hex(8);
    auto host = get_string(o, "host", path + ".", true);
    if (!host) return make_error(host.error());
    auto pattern = policy::HostPattern::parse(*host);
    if (!pattern) return make_error(path + ".host: " + pattern.error());
    p.host = pattern->text();
    auto secret = get_string(o, "secret", path + ".", true);
    if (!secret) return make_error(secret.error());
    if (!credstore::valid_secret_name(*secret)) {
        return make_error(path + ".secret: " + credstore::kSecretNameRule);
    }
    if (credstore::resolve_secret(snap, *secret, run_scope) == nullptr) {
        return make_error(path + ".secret: unknown secret '" + *secret + "' for scope " +
                          run_scope.to_string());
    }
    p.secret = *secret;
    auto* inj = o.if_contains("inject");
    if (inj == nullptr || !inj->is_object()) {
        return make_error(path +
                          ".inject: required object {type: bearer|basic|header|aws-sigv4, ...}");
    }
    const auto& io = inj->as_object();
    auto type = get_string(io, "type", path + ".inject.", true);
    if (!type) return make_error(type.error());
    if (*type != "bearer" && *type != "basic" && *type != "header" && *type != "aws-sigv4") {
        return make_error(path + ".inject.type: unknown value '" + *type +
                          "' (expected bearer, basic, header or aws-sigv4)");
    }
    p.inject.type = *type;
    // Each type takes only its own options (as in the config), so a misspelled or misplaced
    // option is refused instead of silently changing what is injected.
    for (const auto& [k, _] : io) {
        const bool aws = k == "access_key_id" || k == "region" || k == "service";
        const bool known =
            k == "type" || k == "username" || k == "name" || k == "template" || aws;
        if (!known) {
            return make_error(path + ".inject." + std::string(k) + ": unknown field");
        }
        const char* owner = k == "username" ? "basic"
                            : k == "type"   ? nullptr
                            : aws           ? "aws-sigv4"
                                            : "header";
        if (owner != nullptr && *type != owner) {
            return make_error(path + ".inject." + std::string(k) + ": only valid with type " +
                              owner);
        }
    }
    auto user = get_string(io, "username", path + ".inject.", *type == "basic");
    if (!user) return make_error(user.error());
    auto name = get_string(io, "name", path + ".inject.", *type == "header");
    if (!name) return make_error(name.error());
    auto tmpl = get_string(io, "template", path + ".inject.", false);
    if (!tmpl) return make_error(tmpl.error());
    p.inject.username = *user;
    p.inject.name = *name;
    p.inject.value_template = tmpl->empty() ? "{secret}" : *tmpl;
    // access_key_id may be left out: the secret is then a credentials document.
    for (auto [key, out] : {std::pair{"access_key_id", &p.inject.access_key_id},
                            std::pair{"region", &p.inject.region},
                            std::pair{"service", &p.inject.service}}) {
        const bool required = *type == "aws-sigv4" && std::string_view(key) != "access_key_id";
        auto v = get_string(io, key, path + ".inject.", required);
        if (!v) return make_error(v.error());
        *out = *v;
    }
    auto spec = policy::validate_injection(to_spec(p.inject));
    if (!spec) return make_error(path + "." + spec.error());
    p.inject.name = spec->header_name;
    auto prefixes = get_strings(o, "path_prefixes", path + ".");
    if (!prefixes) return make_error(prefixes.error());
    for (size_t j = 0; j < prefixes->size(); ++j) {
        if (auto why = policy::path_prefix_problem((*prefixes)[j])) {
            return make_error(path + ".path_prefixes[" + std::to_string(j) + "]: " + *why);
        }
    }
    p.path_prefixes = *prefixes;
    auto methods = get_strings(o, "methods", path + ".");
    if (!methods) return make_error(methods.error());
    for (auto& m : *methods) {
        m = policy::ascii_lower(m);
        std::transform(m.begin(), m.end(), m.begin(), ::toupper);
        if (!policy::valid_header_name(m)) {
            return make_error(path + ".methods: '" + m + "' is not a method");
        }
    }
    p.methods = *methods;
    std::vector<policy::Header> extra;
    if (auto* h = o.if_contains("headers"); h != nullptr && !h->is_null()) {
        if (!h->is_object()) {
            return make_error(path + ".headers: must be an object {name: value}");
        }
        for (const auto& [k, val] : h->as_object()) {
            if (!val.is_string()) {
                return make_error(path + ".headers." + std::string(k) + ": must be a string");
            }
            extra.push_back({std::string(k), std::string(val.as_string())});
        }
    }
    auto checked = policy::validate_extra_headers(extra, *spec);
    if (!checked) return make_error(path + "." + checked.error());
    for (const auto& h : *checked) {
        p.extra_headers.emplace_back(h.name, h.value);
    }
    auto ttl = get_int(o, "ttl_seconds", path + ".", run_expires - now, 1, kMaxRunTtl);
    if (!ttl) return make_error(ttl.error());
    p.expires_at = std::min(run_expires, now + *ttl);  // never later than the run
    return p;
}

/// The X.509 name-constraint form of a host pattern: "api.test", ".s3.test" for "*.s3.test",
/// or an IP literal; the port is dropped.
std::string constraint_name(const std::string& pattern_text) {
    auto pat = policy::HostPattern::parse(pattern_text);
    if (!pat) {
        return {};
    }
    std::string t = pat->text();
    if (pat->port()) {
        t = t.substr(0, t.rfind(':'));
    }
    if (!t.empty() && t.front() == '[') {
        t = t.substr(1, t.size() - 2);
    }
    if (pat->wildcard()) {
        t = t.substr(1);  // "*.a.test" -> ".a.test": subdomains only
    }
    return t;
}

bool ends_with(std::string_view s, std::string_view suffix) {
    return s.size() >= suffix.size() && s.substr(s.size() - suffix.size()) == suffix;
}

/// Whether the name constraint `n` permits every name the constraint-form `p` stands for.
bool constraint_covers(const std::string& n, const std::string& p) {
    bool n_sub = !n.empty() && n.front() == '.';
    if (!p.empty() && p.front() == '.') {
        std::string base = p.substr(1);
        return n_sub ? (p == n || ends_with(base, n)) : (base == n || ends_with(base, "." + n));
    }
    return n_sub ? ends_with(p, n) : (p == n || ends_with(p, "." + n));
}

/// The names a run's CA may certify: its pins, its allow list, and (when allowed unpinned
/// hosts are intercepted) the global allow list.
std::vector<std::string> run_constraints(const credstore::RunRecord& run, const Config& cfg) {
    std::vector<std::string> out;
    std::set<std::string> seen;  // not a scan of `out` per name: quadratic in the run's hosts
    auto add = [&](const std::string& text) {
        auto n = constraint_name(text);
        if (!n.empty() && seen.insert(n).second) {
            out.push_back(n);
        }
    };
    for (const auto& p : run.pins) add(p.host);
    for (const auto& h : run.allow_hosts) add(h);
    if (cfg.policy.unpinned == policy::Unpinned::Intercept) {
        for (const auto& h : cfg.policy.allow_hosts) add(h.text());
    }
    return out;
}

}  // namespace

ApiResponse ControlPlane::create_run(std::string_view body) {
    auto o = parse_body(body);
    if (!o) return error(400, "invalid_request", o.error());
    static const std::set<std::string_view> kKeys{"scope", "ttl_seconds", "allow_hosts",
                                                  "source_cidrs", "pins"};
    for (const auto& [k, _] : *o) {
        if (kKeys.count(k) == 0) {
            return error(400, "invalid_request", std::string(k) + ": unknown field");
        }
    }
    auto scope = get_scope(*o, "");
    if (!scope) return error(400, "invalid_request", scope.error());
    auto ttl = get_int(*o, "ttl_seconds", "", kDefaultRunTtl, 1, kMaxRunTtl);
    if (!ttl) return error(400, "invalid_request", ttl.error());
    auto allow = get_strings(*o, "allow_hosts", "");
    if (!allow) return error(400, "invalid_request", allow.error());
    auto cidrs = get_strings(*o, "source_cidrs", "");
    if (!cidrs) return error(400, "invalid_request", cidrs.error());
    // The run's lists are bounded as its pins are: each entry is a name constraint of its
    // CA, or a range every transparent connection's lookup goes through.
    const size_t most = current_config()->admin_limits.max_pins_per_run;
    for (const auto& [name, list] : {std::pair{"allow_hosts", &*allow},
                                     std::pair{"source_cidrs", &*cidrs}}) {
        if (list->size() > most) {
            return error(400, "invalid_request",
                         std::string(name) + ": more than admin.max_pins_per_run (" +
                             std::to_string(most) + ")");
        }
    }
    for (size_t i = 0; i < allow->size(); ++i) {
        auto pat = policy::HostPattern::parse((*allow)[i]);
        if (!pat) {
            return error(400, "invalid_request",
                         "allow_hosts[" + std::to_string(i) + "]: " + pat.error());
        }
        (*allow)[i] = pat->text();
    }
    for (size_t i = 0; i < cidrs->size(); ++i) {
        auto c = policy::Cidr::parse((*cidrs)[i]);
        if (!c) {
            return error(400, "invalid_request",
                         "source_cidrs[" + std::to_string(i) + "]: " + c.error());
        }
    }
    const int64_t now = unix_now();
    credstore::RunRecord run;
    run.id = "run_" + random_hex(8);
    run.scope = *scope;
    run.created_at = now;
    run.expires_at = now + *ttl;
    run.allow_hosts = *allow;
    run.source_cidrs = *cidrs;

    const AdminLimits limits = current_config()->admin_limits;
    std::lock_guard lock(mu_);
    auto snap = store_->snapshot();
    if (snap->runs.size() >= limits.max_runs) {
        return error(409, "conflict",
                     std::to_string(snap->runs.size()) + " runs exist, admin.max_runs (" +
                         std::to_string(limits.max_runs) +
                         "); revoked runs count until they expire");
    }
    if (auto* pins = o->if_contains("pins"); pins != nullptr && !pins->is_null()) {
        if (!pins->is_array()) return error(400, "invalid_request", "pins: must be an array");
        if (pins->as_array().size() > limits.max_pins_per_run) {
            return error(400, "invalid_request",
                         "pins: more than admin.max_pins_per_run (" +
                             std::to_string(limits.max_pins_per_run) + ")");
        }
        for (size_t i = 0; i < pins->as_array().size(); ++i) {
            auto p = parse_pin(pins->as_array()[i], "pins[" + std::to_string(i) + "]", *scope,
                               *snap, run.expires_at, now);
            if (!p) return error(400, "invalid_request", p.error());
            run.pins.push_back(std::move(*p));
        }
    }
    // When the run's host set is known at creation, its CA may certify only those names, so
    // even a leaked run CA can forge nothing else (X.509 name constraints). A run created
    // without hosts (pins to be added later) gets an unconstrained CA.
    auto permitted = run_constraints(run, *current_config());
    auto ca = tls::RunCa::create(run.id, std::chrono::seconds(*ttl), permitted);
    if (!ca) return error(500, "ca_failed", ca.error());
    run.ca_cert_pem = (*ca)->cert_pem();
    std::string key = (*ca)->key_pem();
    credstore::SecretPtr mac_key;
    auto sealed_key =
        credstore::seal(keys_.primary(), "ca:" + run.id, *scope, 1, key, &mac_key);
    egress::secure_zero(key.data(), key.size());
    if (!sealed_key) return error(500, "ca_failed", sealed_key.error());
    run.ca_key = *sealed_key;
    std::string token = random_hex(24);
    run.token_sha256 = sha256_hex(token);
    credstore::sign_run(run, *mac_key);
    {
        std::lock_guard mac_lock(mac_mu_);
        run_mac_keys_[run.id] = {run.ca_key.nonce + "|" + run.ca_key.ciphertext, mac_key};
    }
    credstore::Mutation m;
    m.kind = credstore::Mutation::Kind::PutRun;
    m.run = run;
    if (auto r = store_->apply({m}); !r) return store_error(r.error());

    // The answer holds the token (in proxy_url): every block it passes through is zeroed
    // when freed (the JSON in a WipingJsonResource, the URL and the serialized text in wiping
    // strings), and the body the admin listener writes is zeroed after the write (secret).
    using WipingString = std::basic_string<char, std::char_traits<char>,
                                           egress::WipingAllocator<char>>;
    json::object out(json::make_shared_resource<WipingJsonResource>());
    out["id"] = run.id;
    {
        WipingString url;
        url.reserve(7 + run.id.size() + 1 + token.size() + 1 + proxy_authority_.size());
        url.append("http://").append(run.id).append(":").append(token).append("@").append(
            proxy_authority_);
        out["proxy_url"] = json::string_view(url.data(), url.size());
    }
    egress::secure_zero(token.data(), token.size());
    out["ca_pem"] = run.ca_cert_pem;
    out["expires_at"] = rfc3339(run.expires_at);
    out["scope"] = scope_json(run.scope);
    json::array pins;
    for (const auto& p : run.pins) pins.push_back(pin_json(p));
    out["pins"] = pins;
    WipingString text;
    {
        json::serializer sr;
        sr.reset(&out);
        char piece[4096];
        while (!sr.done()) {
            text.append(sr.read(piece, sizeof piece));
        }
        egress::secure_zero(piece, sizeof piece);
    }
    ApiResponse r{201, std::string(text.data(), text.size()), {}};
    r.secret = true;
    return r;
}

std::shared_ptr<Run> ControlPlane::static_run(const std::string& id) {
    std::shared_ptr<const Runtime> statics;
    {
        std::lock_guard lock(build_mu_);
        statics = statics_;
    }
    return statics ? statics->find(id) : nullptr;
}

ApiResponse ControlPlane::static_run_refusal(const std::string& id) const {
    return error(409, "conflict",
                 "run '" + id + "' is a static run (the config's runs): change it there and "
                 "reload (SIGHUP)");
}

ApiResponse ControlPlane::show_run(const std::string& id) {
    auto snap = store_->snapshot();
    auto it = snap->runs.find(id);
    if (it == snap->runs.end()) {
        if (auto r = static_run(id)) return ok(200, static_run_json(*r));
        return error(404, "not_found", "no run '" + id + "'");
    }
    const auto& r = it->second;
    json::object out;
    out["id"] = r.id;
    out["static"] = false;
    out["scope"] = scope_json(r.scope);
    out["created_at"] = rfc3339(r.created_at);
    out["expires_at"] = rfc3339(r.expires_at);
    out["revoked"] = r.revoked;
    out["expired"] = r.expires_at <= unix_now();
    out["allow_hosts"] = json::value_from(r.allow_hosts);
    out["source_cidrs"] = json::value_from(r.source_cidrs);
    json::array pins;
    for (const auto& p : r.pins) pins.push_back(pin_json(p));
    out["pins"] = pins;
    out["ca_pem"] = r.ca_cert_pem;
    return ok(200, out);
}

ApiResponse ControlPlane::add_pin(const std::string& id, std::string_view body) {
    std::lock_guard lock(mu_);
    auto snap = store_->snapshot();
    auto it = snap->runs.find(id);
    if (it == snap->runs.end()) {
        if (static_run(id)) return static_run_refusal(id);
        return error(404, "not_found", "no run '" + id + "'");
    }
    auto run = it->second;
    const int64_t now = unix_now();
    if (run.revoked || run.expires_at <= now) {
        return error(409, "conflict", "run '" + id + "' is revoked or expired");
    }
    // The pin is added to the record as it is, and the result signed: a record changed
    // outside egressd would come out of it signed, so it must verify first.
    auto mac_key = verified_run_mac_key(run);
    if (!mac_key) {
        return error(409, "conflict", "run '" + id + "' is not served: " + mac_key.error() +
                                          "; create a new run");
    }
    if (const size_t most = current_config()->admin_limits.max_pins_per_run;
        run.pins.size() >= most) {
        return error(409, "conflict", "run '" + id + "' has " + std::to_string(run.pins.size()) +
                                          " pins, admin.max_pins_per_run (" +
                                          std::to_string(most) + ")");
    }
    auto v = parse_json(body, "pin");
    if (!v) return error(400, "invalid_request", v.error());
    auto p = parse_pin(*v, "pin", run.scope, *snap, run.expires_at, now);
    if (!p) return error(400, "invalid_request", p.error());
    // What the CA itself permits, read from it: the config the run was created under may
    // have changed since (unpinned: intercept adds the global allow list).
    const auto permitted = tls::RunCa::permitted_names(run.ca_cert_pem);
    const auto wanted = constraint_name(p->host);
    const bool covered =
        !permitted || std::any_of(permitted->begin(), permitted->end(), [&](const std::string& n) {
            return constraint_covers(n, wanted);
        });
    if (!covered) {
        return error(409, "conflict",
                     "pin.host: " + p->host + " is outside the names this run's CA may certify "
                     "(name constraints are fixed at creation); create a new run");
    }
    run.pins.push_back(*p);
    credstore::sign_run(run, **mac_key);
    credstore::Mutation m;
    m.kind = credstore::Mutation::Kind::PutRun;
    m.run = run;
    m.expect_run = it->second;  // a revoke or pin elsewhere meanwhile is not overwritten
    if (auto r = store_->apply({m}); !r) return store_error(r.error());
    return ok(201, pin_json(*p));
}

ApiResponse ControlPlane::revoke_run(const std::string& id) {
    std::lock_guard lock(mu_);
    // A revoke must not be lost to, nor undo, a concurrent change of the run on another
    // replica (a pin added from the record before the revoke): guarded by the record it
    // was made from, and made again from the newer record when one won.
    for (int attempt = 0;; ++attempt) {
        auto snap = store_->snapshot();
        auto it = snap->runs.find(id);
        if (it == snap->runs.end()) {
            if (static_run(id)) return static_run_refusal(id);
            return error(404, "not_found", "no run '" + id + "'");
        }
        credstore::Mutation m;
        m.kind = credstore::Mutation::Kind::PutRun;
        m.run = it->second;
        m.run.revoked = true;
        // Signed again only if it verified: a record changed outside egressd is revoked all
        // the same (refused as revoked), and keeps a MAC that does not verify.
        if (auto mac_key = verified_run_mac_key(it->second)) {
            credstore::sign_run(m.run, **mac_key);
        }
        m.expect_run = it->second;
        auto r = store_->apply({m});
        if (r) {
            break;
        }
        if (attempt >= 4 || r.error().rfind("conflict", 0) != 0) {
            return store_error(r.error());
        }
    }
    json::object out;
    out["id"] = id;
    out["revoked"] = true;
    return ok(200, out);
}

void KeyRing::set_primary(const std::string& key_id) {
    if (auto* p = find(key_id)) {
        primary_ = p;
    }
}

void KeyRing::retire_all_but(const std::string& key_id) {
    set_primary(key_id);
    std::erase_if(providers_, [&](const auto& entry) { return entry.first != key_id; });
}

ApiResponse ControlPlane::explain(const std::string& id, std::string_view query) {
    auto params = query_params(query, {"url", "method"});
    if (!params) return error(400, "invalid_request", params.error());
    std::string url_text = (*params)["url"];
    std::string method = "GET";
    if (auto it = params->find("method"); it != params->end()) {
        if (it->second.empty()) {
            return error(400, "invalid_request", "method: empty (omit it for GET)");
        }
        method = it->second;
    }
    std::transform(method.begin(), method.end(), method.begin(), ::toupper);
    auto url = boost::urls::parse_absolute_uri(url_text);
    if (url_text.empty() || !url) {
        return error(400, "invalid_request", "url: required absolute http(s) URL");
    }
    bool https = url->scheme_id() == boost::urls::scheme::https;
    if (!https && url->scheme_id() != boost::urls::scheme::http) {
        return error(400, "invalid_request", "url: scheme must be http or https");
    }
    auto dest = policy::parse_authority(url->encoded_authority(), https ? 443 : 80);
    if (!dest) return error(400, "invalid_request", "url: " + dest.error());
    std::string path = std::string(url->encoded_path());
    if (path.empty()) path = "/";

    auto snap = store_->snapshot();
    std::shared_ptr<const Runtime> statics;
    std::shared_ptr<const Config> config;
    {
        std::lock_guard lock(build_mu_);
        statics = statics_;
        config = config_;
    }
    std::shared_ptr<Run> run = statics->find(id);
    const std::shared_ptr<Run> static_run = run;
    const credstore::RunRecord* rec = nullptr;
    if (run && !run->store_pins.empty()) {
        std::lock_guard lock(build_mu_);  // the served copy, its store secrets resolved
        if (auto b = static_built_.find(id); b != static_built_.end() && b->second.statics == run) {
            run = b->second.served;
        }
    }
    if (!run) {
        auto it = snap->runs.find(id);
        if (it == snap->runs.end()) return error(404, "not_found", "no run '" + id + "'");
        rec = &it->second;
        std::lock_guard lock(build_mu_);
        if (auto b = built_.find(id); b != built_.end()) run = b->second;
    }
    json::object out;
    out["run"] = id;
    out["url"] = url_text;
    out["method"] = method;
    out["host"] = dest->host;
    out["port"] = dest->port;
    out["pin"] = nullptr;
    out["secret"] = nullptr;
    auto now = policy::Clock::now();
    if (rec != nullptr && (rec->revoked || rec->expires_at <= unix_now()) ) {
        out["decision"] = "deny";
        out["reason"] = rec->revoked ? "run_revoked" : "run_expired";
        return ok(200, out);
    }
    if (!run) return error(503, "not_ready", "run not loaded yet");
    // The secret a pin uses, and where it is found: a store secret by the dynamic run's scope
    // or a static run's `scope` (its `secret: NAME` pins, with the scope chain); other static
    // pins read a secret_file.
    auto describe_secret = [&](const std::string& pin_id, const std::string& name,
                               const std::string& file) {
        json::object sj;
        sj["name"] = name;
        const credstore::Scope* scope = rec != nullptr ? &rec->scope : nullptr;
        if (static_run) {
            scope = nullptr;
            for (const auto& sp : static_run->store_pins) {
                if (sp.pin.id == pin_id) scope = &static_run->scope;
            }
        }
        if (scope == nullptr) {
            sj["source"] = "secret_file";
            if (!file.empty()) sj["file"] = file;
            out["secret"] = sj;
            return;
        }
        std::vector<credstore::ScopeCandidate> chain;
        const auto* chosen = credstore::resolve_secret(*snap, name, *scope, &chain);
        if (chosen != nullptr) {
            sj["scope"] = scope_json(chosen->scope);
            sj["version"] = chosen->version;
        }
        json::array ch;
        for (const auto& c : chain) {
            json::object co;
            co["scope"] = scope_json(c.scope);
            co["version"] = c.version;
            co["matches"] = c.matches;
            co["chosen"] = chosen != nullptr && chosen->scope == c.scope;
            ch.push_back(co);
        }
        out["chain"] = ch;
        out["secret"] = sj;
    };
    auto dd = policy::decide_destination(config->policy, run->policy, *dest, now);
    if (dd.carry == policy::Carry::Deny) {
        // The proxy's own reason for this refusal (destination_refusal_reason): a host whose
        // pin's secret is missing is secret_unavailable, naming that pin and its secret.
        out["decision"] = "deny";
        out["reason"] = destination_refusal_reason(*run, config->policy, *dest, dd.reason);
        if (dd.reason == "host_not_allowed") {
            if (const UnavailablePin* up = find_unavailable_pin(*run, config->policy, *dest)) {
                json::object pj;
                pj["id"] = up->pin_id;
                pj["host"] = up->host.text();
                out["pin"] = pj;
                describe_secret(up->pin_id, up->secret_name, up->secret_file);
            }
        }
        return ok(200, out);
    }
    if (dd.carry == policy::Carry::Tunnel) {
        out["decision"] = "tunnel";
        out["reason"] = "allowed_unpinned_tunnel";
        return ok(200, out);
    }
    const policy::Pin* pin = policy::match_pin(config->policy, run->policy, *dest, method, path, now);
    if (pin == nullptr) {
        bool allowed = policy::host_allowed(config->policy, run->policy, *dest);
        out["decision"] = allowed ? "forward" : "deny";
        out["reason"] = allowed ? "allowed_without_credential" : "no_matching_pin";
        return ok(200, out);
    }
    json::object pj;
    pj["id"] = pin->id;
    pj["host"] = pin->host.text();
    out["pin"] = pj;
    describe_secret(pin->id, pin->secret_name, {});
    out["decision"] = https ? "inject" : "forward";
    out["reason"] = https ? "injected" : "cleartext_no_credential";
    return ok(200, out);
}

ApiResponse ControlPlane::rotate_keys() {
    std::lock_guard lock(mu_);
    std::shared_ptr<const Config> cfg;
    {
        std::lock_guard build_lock(build_mu_);
        cfg = config_;
    }
    credstore::KeyProvider* target = &keys_.primary();
    const bool file_kek = !cfg->kms_command.has_value();
    if (file_kek && cfg->state_backend == "etcd") {
        // The new key would exist on this replica only: the others could no longer unseal
        // what it re-wraps. A fleet rotates through keys.kms_command (one KMS for all).
        return error(409, "conflict",
                     "key rotation with a master key file is not available with "
                     "state.backend etcd: every replica would need the new key first; use "
                     "keys.kms_command");
    }
    const std::string next_path = cfg->master_key_file + ".next";
    std::error_code fec;
    if (file_kek) {
        bool resuming = std::filesystem::exists(next_path, fec);
        auto next = credstore::open_master_key_file(next_path, !resuming);
        if (!next) return error(500, "kek_failed", next.error());
        std::string next_id = (*next)->key_id();
        std::lock_guard build_lock(build_mu_);  // a concurrent build unseals with keys_
        if (keys_.find(next_id) == nullptr) {
            keys_.add(std::move(*next), false);
        }
        target = keys_.find(next_id);
    }
    auto snap = store_->snapshot();
    // The writes, in batches. The file backend writes all of them at once (one file). etcd
    // takes them in transactions of at most state.etcd.max_txn_ops records and
    // kRotateTxnBytes of them: one transaction of the whole state exceeds etcd's
    // --max-request-bytes (1.5 MiB by default) or --max-txn-ops as soon as the state is large.
    // Several transactions are safe: every key that wraps a stored record stays loaded until
    // the last one went through (etcd rotates through keys.kms_command, whose KMS unwraps
    // under either id; a master key file is refused above), so each record is served whichever
    // key wraps it, and a rotation that stops half way is finished by the next.
    const bool etcd_backend = cfg->state_backend == "etcd";
    const size_t max_ops = etcd_backend ? std::max<size_t>(1, cfg->etcd.max_txn_ops)
                                        : std::numeric_limits<size_t>::max();
    const size_t max_bytes = etcd_backend ? kRotateTxnBytes : std::numeric_limits<size_t>::max();
    std::vector<std::vector<credstore::Mutation>> batches(1);
    size_t batch_ops = 0;
    size_t batch_bytes = 0;
    auto room_for = [&](size_t record_bytes) {  // one more record; a new batch if it is full
        if (batch_ops > 0 && (batch_ops + 1 > max_ops || batch_bytes + record_bytes > max_bytes)) {
            batches.emplace_back();
            batch_ops = 0;
            batch_bytes = 0;
        }
        ++batch_ops;
        batch_bytes += record_bytes;
    };
    size_t count = 0;
    // A record that no loaded key unwraps (sealed under a key that is gone, or edited) is
    // left as it is and named in "skipped": it was not served before the rotation and is not
    // after it, and it must not hold every other record (and, at start, egressd) back on
    // the old key. Only the new key failing to wrap fails the rotation, before any write.
    json::array skipped;
    std::string skipped_text;  // the same, for the log line
    auto skip = [&](json::object who, const std::string& text, const std::string& reason) {
        skipped_text += (skipped_text.empty() ? "" : "; ") + text + ": " + reason;
        who["reason"] = reason;
        skipped.push_back(std::move(who));
    };
    // Each old key is first tried on a data key of its own (wrap, then unwrap): one that
    // fails so (a KMS down, throttled or timing out) fails the rotation before any write,
    // as the new key failing does. Only a record the working key cannot unwrap is the
    // record's fault, and skipped: a KMS outage must not pass for "every record skipped".
    std::map<std::string, std::string> key_checked;  // key id -> "" works, else why not
    auto key_works = [&](credstore::KeyProvider& k) -> const std::string& {
        auto [it, fresh] = key_checked.try_emplace(k.key_id());
        if (fresh) {
            std::string probe = random_hex(16);  // 32 bytes, a data key's size
            auto wrapped = k.wrap(probe);
            auto back = wrapped ? k.unwrap(*wrapped) : Result<std::string>(make_error(wrapped.error()));
            if (!back) {
                it->second = "key " + k.key_id() + " does not work: " + back.error();
            } else if (*back != probe) {
                it->second = "key " + k.key_id() + " does not give back what it wrapped";
            }
            if (back) egress::secure_zero(back->data(), back->size());
        }
        return it->second;
    };
    // The record under the new key; nullopt when it is skipped; an error when a key that
    // should work does not.
    using Rewrapped = std::optional<credstore::SealedSecret>;
    auto rewrap_one = [&](const credstore::SealedSecret& s, json::object who,
                          const std::string& text) -> Result<Rewrapped> {
        auto* from = keys_.find(s.kek_id);
        if (from == nullptr) {
            skip(std::move(who), text, "no loaded key has id '" + s.kek_id + "'");
            return Rewrapped();
        }
        if (const std::string& why = key_works(*from); !why.empty()) {
            return make_error(why);
        }
        bool record_failed = false;
        auto r = credstore::rewrap(*from, *target, s, &record_failed);
        if (!r) {
            if (!record_failed) return make_error(r.error());
            skip(std::move(who), text, r.error());
            return Rewrapped();
        }
        ++count;
        return Rewrapped(std::move(*r));
    };
    for (const auto& [k, s] : snap->secrets) {
        json::object who;
        who["kind"] = "secret";
        who["name"] = s.name;
        who["scope"] = scope_json(s.scope);
        auto r = rewrap_one(s, std::move(who),
                            "secret " + s.name + " (" + s.scope.to_string() + ")");
        if (!r) return error(500, "kek_failed", r.error());
        if (!r->has_value()) continue;  // skipped: it stays as it was
        const size_t size = credstore::secret_record_to_json(**r).size() + k.size();
        room_for(size);
        auto& b = batches.back();
        if (b.empty()) {
            b.push_back({});
            b.back().kind = credstore::Mutation::Kind::ReplaceSecrets;
        }
        b.front().secrets.push_back(std::move(**r));
    }
    for (const auto& [id, run] : snap->runs) {
        json::object who;
        who["kind"] = "run";
        who["name"] = id;
        auto r = rewrap_one(run.ca_key, std::move(who), "run " + id);
        if (!r) return error(500, "kek_failed", r.error());
        if (!r->has_value()) continue;
        credstore::Mutation m;
        m.kind = credstore::Mutation::Kind::PutRun;
        m.run = run;
        m.run.ca_key = **r;
        m.expect_run = run;  // a run revoked elsewhere meanwhile is not un-revoked
        room_for(credstore::run_record_to_json(m.run).size() + id.size());
        batches.back().push_back(std::move(m));
    }
    size_t written = 0;  // records in the transactions that went through
    for (const auto& b : batches) {
        if (b.empty()) continue;
        if (auto r = store_->apply(b); !r) {
            std::string e = r.error();
            if (e.find("larger than max") != std::string::npos ||
                e.find("request is too large") != std::string::npos) {
                e += " (etcd's --max-request-bytes bounds one transaction; egressd sends at most " +
                     std::to_string(kRotateTxnBytes) + " bytes of records in each)";
            }
            if (written > 0) {
                e += "; " + std::to_string(written) + " of " + std::to_string(count) +
                     " records were rewrapped before it: both keys stay loaded, so every "
                     "record is still served; run `egressctl keys rotate` again to finish";
            }
            return store_error(e);
        }
        for (const auto& m : b) {
            written += m.kind == credstore::Mutation::Kind::ReplaceSecrets ? m.secrets.size() : 1;
        }
    }
    if (file_kek) {
        // Only now that every data key is wrapped by the new KEK does it replace the old one.
        std::filesystem::rename(next_path, cfg->master_key_file, fec);
        if (fec) return error(500, "kek_failed", "rename " + next_path + ": " + fec.message());
        auto dir = std::filesystem::path(cfg->master_key_file).parent_path();
        int dfd = ::open(dir.empty() ? "." : dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
        if (dfd >= 0) {
            ::fsync(dfd);
            ::close(dfd);
        }
    }
    {
        // Every data key is wrapped by the new KEK now (and the file holds it): the old one
        // unwraps nothing that is stored (a skipped record did not unwrap with it either),
        // so it leaves memory.
        std::lock_guard build_lock(build_mu_);
        keys_.retire_all_but(target->key_id());
    }
    if (!skipped.empty()) {
        spdlog::warn("keys rotate: {} record(s) no loaded key unwraps were left as they were "
                     "(not served, not rewrapped to {}): {}",
                     skipped.size(), target->key_id(), skipped_text);
    }
    json::object out;
    out["kek_id"] = target->key_id();
    out["rewrapped"] = count;
    out["skipped"] = std::move(skipped);
    return ok(200, out);
}

std::shared_ptr<const Config> ControlPlane::current_config() {
    std::lock_guard lock(build_mu_);
    return config_;
}

void ControlPlane::set_statics(std::shared_ptr<const Runtime> statics) {
    std::lock_guard lock(build_mu_);
    statics_ = statics;
    config_ = statics->config;
}

Result<size_t> ControlPlane::sweep_expired() {
    std::lock_guard lock(mu_);
    auto snap = store_->snapshot();
    const int64_t now = unix_now();
    // One delete per run, so at most max_txn_ops runs per etcd transaction: a larger batch
    // is refused whole, and was, every second, while more runs expired behind it.
    const auto cfg = current_config();
    const size_t batch = cfg->state_backend == "etcd" ? std::max<size_t>(1, cfg->etcd.max_txn_ops)
                                                      : std::numeric_limits<size_t>::max();
    std::vector<credstore::Mutation> muts;
    size_t swept = 0;
    auto write = [&]() -> Result<bool> {
        while (!muts.empty()) {
            auto r = store_->apply(muts);
            if (r) {
                swept += muts.size();
                break;
            }
            // Another replica swept some of these first (its deletion had not reached this
            // one's view yet): they are swept. The store's view has them gone now (a write
            // that lost reads the state again): the rest are written without them.
            if (r.error().rfind("not_found: run ", 0) != 0) {
                return make_error(r.error());
            }
            const auto now_held = store_->snapshot();
            const size_t before = muts.size();
            std::erase_if(muts, [&](const credstore::Mutation& m) {
                return now_held->runs.count(m.run_id) == 0;
            });
            if (muts.size() == before) {
                return make_error(r.error());
            }
        }
        muts.clear();
        return true;
    };
    for (const auto& [id, run] : snap->runs) {
        if (run.expires_at <= now) {
            credstore::Mutation m;
            m.kind = credstore::Mutation::Kind::DeleteRun;
            m.run_id = id;
            muts.push_back(m);
            {
                std::lock_guard build_lock(build_mu_);
                remember_swept(
                    id, {run.token_sha256, run.source_cidrs, run.expires_at, run.created_at});
            }
            if (muts.size() == batch) {
                if (auto w = write(); !w) return make_error(w.error());
            }
        }
    }
    if (auto w = write(); !w) return make_error(w.error());
    return swept;
}

void ControlPlane::resolve_static_store_pins(const credstore::StateSnapshot& snap, Runtime& rt,
                                             BuildWarnings* warnings) {
    std::map<std::string, StaticBuild> next;
    SealingIds sealing_ids;
    for (auto& [id, run] : rt.runs) {
        if (run->store_pins.empty()) {
            continue;
        }
        const std::shared_ptr<Run> statics = run;
        // What the served copy is built from: the static run and the sealings of its secrets
        // (not only their versions: a secret deleted and put again is version 1 again).
        std::vector<const credstore::SealedSecret*> sealed;
        std::string fp;
        for (const auto& sp : statics->store_pins) {
            const auto* s = credstore::resolve_secret(snap, sp.pin.secret_name, statics->scope);
            sealed.push_back(s);
            fp += "|" + (s ? credstore::secret_key(s->name, s->scope) + "v" +
                                 std::to_string(s->version) + "#" + s->kek_id + "#" +
                                 sealing_ids.of(*s)
                           : std::string("missing"));
        }
        auto prev = static_built_.find(id);
        std::shared_ptr<Run> served;
        if (prev != static_built_.end() && prev->second.statics == statics &&
            prev->second.fingerprint == fp) {
            served = prev->second.served;
        } else {
            std::vector<credstore::SecretPtr> values;
            for (size_t i = 0; i < sealed.size(); ++i) {
                const auto& sp = statics->store_pins[i];
                credstore::SecretPtr value;
                std::string problem;
                if (sealed[i] == nullptr) {
                    problem = "no secret '" + sp.pin.secret_name + "' for scope " +
                              statics->scope.to_string() + " in the store";
                } else if (auto v = unseal_cached(*sealed[i]); !v) {
                    problem = v.error();
                } else {
                    value = *v;
                }
                if (!value && warnings != nullptr) {
                    warnings->lines.push_back(sp.yaml_path + ".secret: " + problem + "; pin for " +
                                              sp.pin.host.text() +
                                              " disabled until the secret is put");
                }
                values.push_back(std::move(value));
            }
            // Pins of the build before on the same secret keep their injection (as dynamic
            // runs' do): a rebuild for another run's change costs no mlock here.
            policy::InjectionCache injections;
            if (prev != static_built_.end()) {
                for (const auto& old : prev->second.served->policy.pins) injections.remember(old);
            }
            served = with_store_secrets(*statics, values, injections);
            for (size_t i = 0; warnings != nullptr && i < values.size(); ++i) {
                const auto& sp = statics->store_pins[i];
                for (const policy::Pin& p : served->policy.pins) {
                    auto w = p.id == sp.pin.id ? aws_pin_warning(p, sp.yaml_path + ".secret",
                                                                 sp.pin.host.text())
                                               : std::string();
                    if (!w.empty()) {
                        warnings->lines.push_back(std::move(w));
                    }
                }
            }
        }
        next[id] = {statics, fp, served};
        if (rt.anonymous == statics) {
            rt.anonymous = served;
        }
        run = served;
    }
    static_built_ = std::move(next);
}

void ControlPlane::remember_swept(const std::string& id, RunTrace trace) {
    if (swept_.emplace(id, std::move(trace)).second) {
        swept_order_.push_back(id);
    }
    while (swept_order_.size() > 4096) {  // remember recent ones only
        swept_.erase(swept_order_.front());
        swept_order_.pop_front();
    }
}

Result<std::shared_ptr<const Runtime>> ControlPlane::build_runtime(BuildWarnings* warnings) {
    std::lock_guard lock(build_mu_);
    auto snap = store_->snapshot();
    built_revision_.store(snap->revision);
    {
        const int64_t now = unix_now();
        for (auto& [id, seen] : last_built_runs_) {
            if (snap->runs.count(id) == 0 && seen.expires_at <= now) {
                remember_swept(id, std::move(seen));
            }
        }
        last_built_runs_.clear();
        for (const auto& [id, rec] : snap->runs) {
            last_built_runs_[id] = {rec.token_sha256, rec.source_cidrs, rec.expires_at,
                                    rec.created_at};
        }
    }
    auto rt = std::make_shared<Runtime>();
    rt->config = statics_->config;
    rt->addresses = statics_->addresses;
    rt->runs = statics_->runs;
    rt->anonymous = statics_->anonymous;
    resolve_static_store_pins(*snap, *rt, warnings);
    const int64_t now = unix_now();
    std::map<std::string, std::shared_ptr<Run>> built;
    std::map<std::string, std::string> fps;
    SealingIds sealing_ids;
    auto cidrs = [](const std::vector<std::string>& texts) {
        std::vector<policy::Cidr> out;
        for (const auto& t : texts) {
            if (auto c = policy::Cidr::parse(t)) out.push_back(*c);
        }
        return out;
    };
    for (const auto& [id, trace] : swept_) {
        rt->ended[id] = {trace.token_sha256, "run_expired", cidrs(trace.sources),
                         trace.created_at};
    }
    for (const auto& [id, rec] : snap->runs) {
        if (rec.revoked || rec.expires_at <= now) {
            // An ended run's token hash and source ranges decide answers too (403 for its
            // token, a transparent connection's run by its most specific range): an edited
            // record must not refuse a live run's sandbox by claiming its range.
            if (auto verified = verified_run_mac_key(rec); !verified) {
                spdlog::warn("run {}: ended, and its record is not used: {}", id,
                             verified.error());
                continue;
            }
            rt->ended[id] = {rec.token_sha256, rec.revoked ? "run_revoked" : "run_expired",
                             cidrs(rec.source_cidrs), rec.created_at};
            continue;
        }
        if (rt->runs.count(id) != 0) {
            continue;
        }
        // What the Run is built from: the record and the sealings of the secrets it uses. A
        // version alone is not enough: a secret deleted and created again is version 1 again,
        // and a replica that never saw it missing (a watch resync, events in one batch) would
        // keep injecting the old value.
        // The MAC is part of it: a record that changes gets a new one, so it is verified
        // again; one changed outside egressd with its MAC kept is served as built before.
        std::string fp = rec.mac + "|" + rec.token_sha256 + "|" + std::to_string(rec.expires_at);
        for (const auto& h : rec.allow_hosts) fp += "|a:" + h;
        for (const auto& p : rec.pins) {
            const auto* s = credstore::resolve_secret(*snap, p.secret, rec.scope);
            fp += "|p:" + p.id + "@" + std::to_string(p.expires_at) + "#" +
                  (s ? credstore::secret_key(s->name, s->scope) + "v" +
                           std::to_string(s->version) + "#" + sealing_ids.of(*s)
                     : std::string("missing"));
        }
        auto prev = built_.find(id);
        if (prev != built_.end() && fingerprints_[id] == fp) {
            built[id] = prev->second;
            fps[id] = fp;
            rt->runs[id] = prev->second;
            continue;
        }
        // Nothing of a record is used until its MAC verified: its token hash, pins, scope
        // and expiry decide where a secret goes (credstore/run_mac.h).
        credstore::SecretPtr unsealed_ca_key;  // set when the check had to unwrap it
        if (auto verified = verified_run_mac_key(rec, &unsealed_ca_key); !verified) {
            spdlog::warn("run {}: not served: {}", id, verified.error());
            continue;
        }
        auto run = std::make_shared<Run>();
        run->dynamic = true;
        run->created_at = rec.created_at;
        run->policy.id = id;
        run->policy.expires_at = policy::Clock::from_time_t(rec.expires_at);
        run->token_sha256 = rec.token_sha256;
        for (const auto& h : rec.allow_hosts) {
            if (auto pat = policy::HostPattern::parse(h)) run->policy.allow_hosts.push_back(*pat);
        }
        for (const auto& c : rec.source_cidrs) {
            if (auto cidr = policy::Cidr::parse(c)) run->sources.push_back(*cidr);
        }
        if (prev != built_.end() && prev->second->ca) {
            run->ca = prev->second->ca;  // same run: keep its CA and warm leaf cache
            run->leaves = prev->second->leaves;
        } else {
            // A run whose CA cannot be loaded is not served (its clients get 407): said once
            // per build, naming the run and why, never silently.
            auto* kp = keys_.find(rec.ca_key.kek_id);
            if (kp == nullptr) {
                spdlog::warn("run {}: not served: no key '{}' unwraps its CA key", id,
                             rec.ca_key.kek_id);
                continue;
            }
            Result<credstore::SecretPtr> key = unsealed_ca_key;
            if (!unsealed_ca_key) {
                key = credstore::unseal(*kp, rec.ca_key);
            }
            if (!key) {
                spdlog::warn("run {}: not served: its CA key: {}", id, key.error());
                continue;
            }
            auto ca = tls::RunCa::load(rec.ca_cert_pem, (*key)->reveal());
            if (!ca) {
                spdlog::warn("run {}: not served: its CA: {}", id, ca.error());
                continue;
            }
            run->ca = std::shared_ptr<tls::RunCa>(std::move(*ca));
            run->leaves = make_leaf_cache(run->ca, config_->limits);
        }
        // Pins on one secret share an injection, and an unchanged pin keeps the build
        // before's (its secret is the same object: unseal_cached) instead of making it again:
        // ~4-6 µs and two mlocks each (BM_MakeInjection), for thousands of pins a rebuild.
        policy::InjectionCache injections;
        if (prev != built_.end()) {
            for (const policy::Pin& old : prev->second->policy.pins) injections.remember(old);
        }
        for (const auto& p : rec.pins) {
            auto pat = policy::HostPattern::parse(p.host);
            if (!pat || p.expires_at <= now) continue;
            const auto* sealed = credstore::resolve_secret(*snap, p.secret, rec.scope);
            credstore::SecretPtr value;
            if (sealed != nullptr) {
                auto v = unseal_cached(*sealed);
                if (v) value = *v;
            }
            if (!value) {
                run->unavailable_pins.push_back({*pat, p.id, p.secret, {}});
                continue;
            }
            policy::Pin pin;
            pin.id = p.id;
            pin.host = *pat;
            pin.path_prefixes = p.path_prefixes;
            pin.methods = p.methods;
            pin.secret_name = p.secret;
            pin.inject = to_spec(p.inject);
            for (const auto& [n, v] : p.extra_headers) pin.extra_headers.push_back({n, v});
            pin.secret = value;
            pin.expires_at = policy::Clock::from_time_t(p.expires_at);
            injections.prepare(pin);
            if (auto w = aws_pin_warning(pin, "run " + id + " pin " + pin.id + " (secret '" +
                                                   pin.secret_name + "')",
                                         p.host);
                !w.empty() && warnings != nullptr) {
                warnings->lines.push_back(std::move(w));
            }
            run->policy.pins.push_back(std::move(pin));
        }
        policy::index_pins(run->policy);
        built[id] = run;
        fps[id] = fp;
        rt->runs[id] = run;
    }
    built_ = std::move(built);
    fingerprints_ = std::move(fps);
    {
        std::lock_guard mac_lock(mac_mu_);
        std::erase_if(run_mac_keys_,
                      [&](const auto& entry) { return snap->runs.count(entry.first) == 0; });
    }
    // Keep only the values a built run still uses: a deleted or rotated secret (or the copy
    // unsealed under a retired KEK) then leaves memory, wiped, once the last runtime holding
    // it is dropped, and the cache stays as small as the live pins.
    std::set<const credstore::SecretValue*> in_use;
    for (const auto& [id, run] : built_) {
        for (const policy::Pin& pin : run->policy.pins) {
            in_use.insert(pin.secret.get());
        }
    }
    for (const auto& [id, b] : static_built_) {
        for (const policy::Pin& pin : b.served->policy.pins) {
            in_use.insert(pin.secret.get());
        }
    }
    std::erase_if(unsealed_, [&](const auto& entry) { return in_use.count(entry.second.get()) == 0; });
    return std::shared_ptr<const Runtime>(rt);
}

}  // namespace egress::proxy
