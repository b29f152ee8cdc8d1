#include "proxy/runtime.h"

#include <openssl/evp.h>
#include <sys/stat.h>

#include <algorithm>
#include <filesystem>
#include <fstream>

#include "common/secure_zero.h"
#include "common/staged_file.h"
#include "common/trust_roots.h"
#include "credstore/envelope.h"

namespace egress::proxy {

namespace {

/// Writes `content` to a new file beside `path` (its folder created if missing); the caller
/// renames it into place (common/staged_file.h).
Result<std::string> stage_file(const std::string& path, const std::string& content,
                               mode_t mode) {
    std::error_code ec;
    auto parent = std::filesystem::path(path).parent_path();
    if (!parent.empty()) {
        std::filesystem::create_directories(parent, ec);
    }
    return stage_file_beside(path, content, mode);
}

/// Every error of a build, one per line, as start and reload print them.
std::string one_per_line(const std::vector<std::string>& errors) {
    std::string msg;
    for (const auto& e : errors) {
        msg += (msg.empty() ? "" : "\n") + e;
    }
    return msg;
}

}  // namespace

const UnavailablePin* find_unavailable_pin(const Run& run, const policy::GlobalPolicy& global,
                                           const policy::HostPort& dest) {
    for (const auto& p : run.unavailable_pins) {
        if (p.matches(dest, global)) {
            return &p;
        }
    }
    return nullptr;
}

std::string_view destination_refusal_reason(const Run& run, const policy::GlobalPolicy& global,
                                            const policy::HostPort& dest,
                                            std::string_view reason) {
    if (reason != "host_not_allowed") {
        return reason;
    }
    if (find_unavailable_pin(run, global, dest) != nullptr) {
        return "secret_unavailable";
    }
    // As decide_destination tells a wrong port apart from a host nobody named.
    const bool named = std::any_of(
        run.unavailable_pins.begin(), run.unavailable_pins.end(),
        [&](const UnavailablePin& p) { return p.host.matches_host(dest.host); });
    return named ? "port_not_allowed" : reason;
}

std::shared_ptr<Run> Runtime::find(const std::string& id) const {
    const std::shared_ptr<Run>* run = lookup(id);
    return run != nullptr ? *run : nullptr;
}

const std::shared_ptr<Run>* Runtime::lookup(const std::string& id) const {
    auto it = runs.find(id);
    return it == runs.end() ? nullptr : &it->second;
}

Runtime::SourceMatch Runtime::find_by_source(const policy::IpAddress& client) const {
    // The live run with the longest range holding `client` among those `eligible` admits; a
    // tie on the longest: none (ambiguous).
    auto best_live = [&](auto eligible) -> std::pair<std::shared_ptr<Run>, int> {
        std::shared_ptr<Run> best;
        int best_prefix = -1;
        bool tied = false;
        for (const auto& [id, run] : runs) {
            if (!eligible(*run)) {
                continue;
            }
            for (const auto& c : run->sources) {
                if (!c.contains(client)) {
                    continue;
                }
                if (c.prefix > best_prefix) {
                    best = run;
                    best_prefix = c.prefix;
                    tied = false;
                } else if (c.prefix == best_prefix && best != run) {
                    tied = true;
                }
            }
        }
        return {tied ? nullptr : best, best_prefix};
    };
    auto [best, best_prefix] = best_live([](const Run&) { return true; });
    // An ended run's range decides where it is longer than every live run's: its address is
    // not handed to a broader run that was there before (nor to the sidecar's). Only a run
    // created after it may take the address over, whatever its range.
    const Ended* ended_best = nullptr;
    int ended_prefix = -1;
    for (const auto& [id, e] : ended) {
        for (const auto& c : e.sources) {
            if (c.prefix > ended_prefix && c.contains(client)) {
                ended_best = &e;
                ended_prefix = c.prefix;
            }
        }
    }
    if (ended_best != nullptr && ended_prefix > best_prefix) {
        const int64_t after = ended_best->created_at;
        auto [newer, newer_prefix] =
            best_live([after](const Run& r) { return r.dynamic && r.created_at > after; });
        if (newer_prefix < 0) {
            return {nullptr, ended_best->reason};
        }
        return {newer, {}};
    }
    if (best) {
        return {best, {}};
    }
    if (best_prefix >= 0) {
        return {};  // tied
    }
    // The sidecar's single run serves any source, unless it is bound to some.
    if (anonymous && anonymous->sources.empty()) {
        return {anonymous, {}};
    }
    return {};
}

Result<std::shared_ptr<Runtime>> build_runtime(std::shared_ptr<const Config> config,
                                               BuildWarnings& warnings, const Runtime* previous) {
    auto rt = std::make_shared<Runtime>();
    rt->config = config;
    rt->addresses = policy::AddressPolicy(config->allow_networks);
    std::vector<std::string> errors;
    auto now = policy::Clock::now();

    for (const auto& rc : config->runs) {
        auto run = std::make_shared<Run>();
        run->policy.id = rc.id;
        run->policy.allow_hosts = rc.allow_hosts;
        run->sources = rc.sources;
        // A run with a ttl ends with its CA. A run with ttl: null lives as long as the process,
        // and its CA gets limits.static_ca_validity (see Limits): long, because the CA key
        // exists only in this process's memory and dies with it.
        const auto validity =
            rc.ttl ? *rc.ttl
                   : std::chrono::duration_cast<std::chrono::seconds>(
                         config->limits.static_ca_validity);
        if (rc.ttl) {
            run->policy.expires_at = now + *rc.ttl;
        }
        if (rc.token_file) {
            auto tok = credstore::load_secret_file(*rc.token_file);
            if (!tok) {
                errors.push_back(rc.yaml_path + ".token_file: " + tok.error());
                continue;
            }
            run->token = *tok;
        }
        for (size_t i = 0; i < rc.pins.size(); ++i) {
            const auto& pc = rc.pins[i];
            policy::Pin pin;
            pin.id = rc.id + "-pin-" + std::to_string(i);
            pin.host = pc.host;
            pin.path_prefixes = pc.path_prefixes;
            pin.methods = pc.methods;
            pin.inject = pc.inject;
            pin.extra_headers = pc.extra_headers;
            pin.expires_at = run->policy.expires_at;
            if (!pc.secret_file.empty()) {
                pin.secret_name = std::filesystem::path(pc.secret_file).filename().string();
                std::error_code ec;
                const bool there = std::filesystem::exists(pc.secret_file, ec);
                if (ec) {
                    // Not "missing": unreadable (a folder without x for this user, a
                    // non-root pod's mount), a symlink loop. Said as it is, not as absent.
                    errors.push_back(pc.yaml_path + ".secret_file: " + pc.secret_file + ": " +
                                     ec.message());
                    continue;
                }
                if (!there) {
                    warnings.lines.push_back(pc.yaml_path + ".secret_file: " + pc.secret_file +
                                             " does not exist; pin for " + pc.host.text() +
                                             " disabled until it does (then reload)");
                    run->unavailable_pins.push_back(
                        {pc.host, pin.id, pin.secret_name, pc.secret_file});
                    continue;
                }
                auto s = credstore::load_secret_file(pc.secret_file);
                if (!s) {
                    errors.push_back(pc.yaml_path + ".secret_file: " + s.error());
                    continue;
                }
                pin.secret = *s;
                policy::prepare_injection(pin);
                if (auto w = aws_pin_warning(pin, pc.yaml_path + ".secret_file", pc.host.text());
                    !w.empty()) {
                    warnings.lines.push_back(std::move(w));
                }
            } else {
                // A store secret: resolved by the control plane, which reads the store
                // (ControlPlane::build_runtime); until then the pin is off.
                pin.secret_name = pc.secret;
                run->store_pins.push_back({std::move(pin), run->policy.pins.size(), pc.yaml_path});
                continue;
            }
            run->policy.pins.push_back(std::move(pin));
        }
        for (const auto& sp : run->store_pins) {
            run->unavailable_pins.push_back({sp.pin.host, sp.pin.id, sp.pin.secret_name, {}});
        }
        if (rc.scope) {
            run->scope = *rc.scope;
        }
        run->static_ttl = rc.ttl;
        run->ca_validity = validity;
        std::shared_ptr<Run> old = previous != nullptr ? previous->find(rc.id) : nullptr;
        if (old && !old->dynamic && old->static_ttl == rc.ttl && old->ca_validity == validity &&
            old->ca) {
            run->ca = old->ca;
            run->leaves = old->leaves;
            run->policy.expires_at = old->policy.expires_at;
            for (auto& p : run->policy.pins) {
                p.expires_at = std::min(p.expires_at, run->policy.expires_at);
            }
            for (auto& sp : run->store_pins) {
                sp.pin.expires_at = std::min(sp.pin.expires_at, run->policy.expires_at);
            }
        } else {
            auto ca = tls::RunCa::create(rc.id, validity);
            if (!ca) {
                errors.push_back(rc.yaml_path + ": cannot create run CA: " + ca.error());
                continue;
            }
            run->ca = std::shared_ptr<tls::RunCa>(std::move(*ca));
            run->leaves = make_leaf_cache(run->ca, config->limits);
        }
        if (!run->token) {
            run->anonymous = true;
            rt->anonymous = run;
        }
        policy::index_pins(run->policy);
        rt->runs[rc.id] = std::move(run);
    }
    if (!errors.empty()) {
        return make_error(one_per_line(errors));
    }
    return rt;
}

std::shared_ptr<Run> with_store_secrets(const Run& statics,
                                        const std::vector<credstore::SecretPtr>& values,
                                        policy::InjectionCache& injections) {
    auto run = std::make_shared<Run>();
    run->policy.id = statics.policy.id;
    run->policy.allow_hosts = statics.policy.allow_hosts;
    run->policy.expires_at = statics.policy.expires_at;
    run->policy.revoked = statics.policy.revoked;
    run->static_ttl = statics.static_ttl;
    run->ca_validity = statics.ca_validity;
    run->token = statics.token;
    run->anonymous = statics.anonymous;
    run->ca = statics.ca;
    run->leaves = statics.leaves;
    run->sources = statics.sources;
    run->scope = statics.scope;
    // The file pins' unavailable hosts; the store pins' follow, for those left unresolved.
    const size_t file_unavailable =
        statics.unavailable_pins.size() - std::min(statics.unavailable_pins.size(),
                                                   statics.store_pins.size());
    run->unavailable_pins.assign(statics.unavailable_pins.begin(),
                                 statics.unavailable_pins.begin() +
                                     static_cast<std::ptrdiff_t>(file_unavailable));
    const auto& file_pins = statics.policy.pins;
    size_t next_file = 0;
    for (size_t i = 0; i < statics.store_pins.size(); ++i) {
        const Run::StorePin& sp = statics.store_pins[i];
        while (next_file < sp.after) {
            run->policy.pins.push_back(file_pins[next_file++]);
        }
        if (i >= values.size() || !values[i]) {
            run->unavailable_pins.push_back({sp.pin.host, sp.pin.id, sp.pin.secret_name, {}});
            continue;
        }
        policy::Pin pin = sp.pin;
        pin.secret = values[i];
        injections.prepare(pin);
        run->policy.pins.push_back(std::move(pin));
    }
    while (next_file < file_pins.size()) {
        run->policy.pins.push_back(file_pins[next_file++]);
    }
    policy::index_pins(run->policy);
    return run;
}

namespace {

/// The roots a run's ca_bundle_out starts from: those egressd trusts upstream
/// (upstream.ca_file), for "system" OpenSSL's default file (common/trust_roots.h). Empty, with
/// a warning, when the system has none.
Result<std::string> bundle_roots(const Config& config, BuildWarnings* warnings) {
    std::optional<std::string> path;
    if (config.upstream_ca_file == "system") {
        path = find_default_root_file();
        if (!path) {
            if (warnings != nullptr) {
                warnings->lines.push_back(
                    "no system trust store found (" + default_root_files()[0] +
                    "): ca_bundle_out files hold the run CA only, so hosts tunnelled blind fail "
                    "verification in clients that use them");
            }
            return std::string();
        }
    } else {
        path = config.upstream_ca_file;
    }
    auto text = read_root_file(*path);
    if (!text) {
        return make_error("cannot read " + *path + " (upstream.ca_file) for the CA bundle: " +
                          text.error());
    }
    return text;
}

/// Whether `path` is a regular file holding exactly `content` (a bundle that would not change
/// is not rewritten). Anything else (missing, a folder, a FIFO, unreadable) reads as "no".
bool holds(const std::string& path, const std::string& content) {
    const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
    if (fd < 0) {
        return false;
    }
    struct stat st {};
    bool same = ::fstat(fd, &st) == 0 && S_ISREG(st.st_mode) &&
                static_cast<uint64_t>(st.st_size) == content.size();
    size_t at = 0;
    char buf[16384];
    while (same && at < content.size()) {
        const ssize_t n = ::read(fd, buf, sizeof buf);
        if (n < 0 && errno == EINTR) {
            continue;
        }
        if (n <= 0 || content.compare(at, static_cast<size_t>(n), buf, static_cast<size_t>(n))) {
            same = false;
            break;
        }
        at += static_cast<size_t>(n);
    }
    ::close(fd);
    return same && at == content.size();
}

}  // namespace

/// A CA file's target must be absent, a regular file or a symlink (replaced by the rename):
/// a folder there failed only at the rename, after other runs' files were already in place.
std::string unfit_ca_target(const std::string& path) {
    struct stat st {};
    if (::lstat(path.c_str(), &st) != 0) {
        return errno == ENOENT ? std::string() : path + ": " + std::strerror(errno);
    }
    if (S_ISREG(st.st_mode) || S_ISLNK(st.st_mode)) {
        return {};
    }
    return path + (S_ISDIR(st.st_mode) ? " is a folder" : " is not a regular file");
}

Result<bool> write_ca_files(const Runtime& next, const Runtime* previous,
                            BuildWarnings* warnings) {
    struct Staged {
        const RunConfig* rc;
        const char* key;          // "ca_cert_out" or "ca_bundle_out"
        const std::string* path;  // rc's value of that key
        std::string tmp;
    };
    std::vector<Staged> staged;
    std::vector<std::string> errors;
    std::optional<std::string> roots;  // read once, for the first run that wants a bundle
    auto stage = [&](const RunConfig& rc, const char* key, const std::string& path,
                     const std::string& content) {
        if (auto why = unfit_ca_target(path); !why.empty()) {
            errors.push_back(rc.yaml_path + "." + key + ": " + why);
            return;
        }
        auto w = stage_file(path, content, 0644);
        if (!w) {
            errors.push_back(rc.yaml_path + "." + key + ": " + w.error());
            return;
        }
        staged.push_back({&rc, key, &path, std::move(*w)});
    };
    for (const auto& rc : next.config->runs) {
        auto run = next.find(rc.id);
        if (!run || !run->ca) {
            continue;
        }
        if (!rc.ca_bundle_out.empty()) {
            // Rebuilt at every start and reload (the system's roots change with its packages),
            // written only when it differs from what the file holds.
            if (!roots) {
                auto r = bundle_roots(*next.config, warnings);
                if (!r) {
                    errors.push_back(rc.yaml_path + ".ca_bundle_out: " + r.error());
                    roots.emplace();
                } else {
                    roots = std::move(*r);
                }
            }
            std::string bundle = *roots + run->ca->cert_pem();
            if (!bundle.empty() && bundle.back() != '\n') {
                bundle += '\n';
            }
            if (!holds(rc.ca_bundle_out, bundle)) {
                stage(rc, "ca_bundle_out", rc.ca_bundle_out, bundle);
            }
        }
        if (rc.ca_cert_out.empty()) {
            continue;
        }
        if (previous != nullptr) {
            auto old = previous->find(rc.id);
            const auto& old_runs = previous->config->runs;
            auto old_rc = std::find_if(old_runs.begin(), old_runs.end(),
                                       [&](const RunConfig& o) { return o.id == rc.id; });
            if (old && old->ca == run->ca && old_rc != old_runs.end() &&
                old_rc->ca_cert_out == rc.ca_cert_out) {
                continue;  // the kept CA, already in that file
            }
        }
        stage(rc, "ca_cert_out", rc.ca_cert_out, run->ca->cert_pem());
    }
    // Only when every file is staged does any reach its place: a refused start or reload
    // leaves each ca_cert_out (and ca_bundle_out) holding the CA that (still) serves.
    for (const auto& s : staged) {
        std::error_code ec;
        if (!errors.empty()) {
            std::filesystem::remove(s.tmp, ec);
            continue;
        }
        std::filesystem::rename(s.tmp, *s.path, ec);
        if (ec) {
            errors.push_back(s.rc->yaml_path + "." + s.key + ": cannot rename " + s.tmp + ": " +
                             ec.message());
        }
    }
    if (!errors.empty()) {
        return make_error(one_per_line(errors));
    }
    return true;
}

CaExpiry ca_expiry(std::chrono::system_clock::time_point not_after,
                   std::chrono::seconds validity, std::chrono::system_clock::time_point now) {
    if (now >= not_after) {
        return CaExpiry::Expired;
    }
    const auto notice = std::min<std::chrono::system_clock::duration>(validity / 10, kCaNotice);
    return not_after - now <= notice ? CaExpiry::Soon : CaExpiry::Fine;
}

std::shared_ptr<tls::LeafCache> make_leaf_cache(std::shared_ptr<tls::RunCa> ca,
                                                const Limits& limits) {
    auto* cache = new tls::LeafCache(*ca, limits.leaf_cache_size);
    cache->set_mint_rate(limits.leaf_mints_per_minute);
    return std::shared_ptr<tls::LeafCache>(cache, [ca](tls::LeafCache* p) { delete p; });
}

std::string sha256_hex(std::string_view bytes) {
    return credstore::sha256_hex(bytes);
}

std::string aws_pin_warning(const policy::Pin& pin, const std::string& where,
                            const std::string& host) {
    if (!pin.injection || pin.injection->aws_error.empty()) {
        return {};
    }
    return where + ": " + pin.injection->aws_error + "; requests for " + host +
           " are refused (503 aws_credentials_invalid)";
}

bool token_matches(const Run& run, std::string_view token) {
    if (run.token) {
        return credstore::constant_time_equals(token, run.token->reveal());
    }
    if (!run.token_sha256.empty()) {
        return credstore::constant_time_equals(sha256_hex(token), run.token_sha256);
    }
    return run.anonymous;
}

bool same_admission(const Run& before, const Run& after) {
    if (before.anonymous != after.anonymous || before.token_sha256 != after.token_sha256 ||
        (before.token == nullptr) != (after.token == nullptr) ||
        (before.token && !credstore::constant_time_equals(before.token->reveal(),
                                                          after.token->reveal()))) {
        return false;
    }
    return std::equal(before.sources.begin(), before.sources.end(), after.sources.begin(),
                      after.sources.end(), [](const policy::Cidr& a, const policy::Cidr& b) {
                          return a.prefix == b.prefix && a.to_string() == b.to_string();
                      });
}

bool parse_proxy_basic(std::string_view v, std::string& user, std::string& pass) {
    constexpr std::string_view kBasic = "basic ";
    if (v.size() <= kBasic.size()) {
        return false;
    }
    for (size_t i = 0; i < kBasic.size(); ++i) {
        if (std::tolower(static_cast<unsigned char>(v[i])) != kBasic[i]) {
            return false;
        }
    }
    v.remove_prefix(kBasic.size());
    while (!v.empty() && v.front() == ' ') {
        v.remove_prefix(1);
    }
    while (!v.empty() && v.back() == ' ') {
        v.remove_suffix(1);
    }
    if (v.empty() || v.size() % 4 != 0 || v.size() > 4096) {
        return false;
    }
    std::string out(v.size() / 4 * 3, '\0');
    int n = EVP_DecodeBlock(reinterpret_cast<unsigned char*>(out.data()),
                            reinterpret_cast<const unsigned char*>(v.data()),
                            static_cast<int>(v.size()));
    if (n < 0) {
        return false;
    }
    size_t pad = (v.back() == '=') + (v.size() > 1 && v[v.size() - 2] == '=');
    out.resize(static_cast<size_t>(n) - pad);
    auto colon = out.find(':');
    if (colon == std::string::npos) {
        return false;
    }
    user = out.substr(0, colon);
    pass = out.substr(colon + 1);
    egress::secure_zero(out.data(), out.size());
    return true;
}

}  // namespace egress::proxy
