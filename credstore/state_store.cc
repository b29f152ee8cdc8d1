#include "credstore/state_store.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <boost/json.hpp>
#include <cctype>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>

namespace egress::credstore {

namespace json = boost::json;

namespace {

constexpr int64_t kFormat = 1;
constexpr const char* kStateFile = "state.json";
constexpr const char* kTempFile = "state.json.tmp";

std::string errno_text() {
    return std::strerror(errno);
}

// ---- serialization -------------------------------------------------------------------------

json::object scope_to_json(const Scope& s) {
    json::object o;
    o["org"] = s.org;
    if (!s.project.empty()) {
        o["project"] = s.project;
    }
    if (!s.user.empty()) {
        o["user"] = s.user;
    }
    if (!s.workflow.empty()) {
        o["workflow"] = s.workflow;
    }
    return o;
}

json::array strings_to_json(const std::vector<std::string>& v) {
    json::array a;
    for (const std::string& s : v) {
        a.emplace_back(s);
    }
    return a;
}

json::object sealed_to_json(const SealedSecret& s) {
    json::object o;
    o["name"] = s.name;
    o["scope"] = scope_to_json(s.scope);
    o["version"] = s.version;
    o["created_at"] = s.created_at;
    o["kek_id"] = s.kek_id;
    o["wrapped_dek"] = s.wrapped_dek;
    o["nonce"] = s.nonce;
    o["ciphertext"] = s.ciphertext;
    return o;
}

// PinRecord::extra_headers is being added alongside the admin API; persist it when present.
template <class Pin>
void extra_headers_to_json(const Pin& p, json::object& o) {
    if constexpr (requires { p.extra_headers; }) {
        json::array headers;
        for (const auto& [name, value] : p.extra_headers) {
            headers.emplace_back(json::object{{"name", name}, {"value", value}});
        }
        o["extra_headers"] = std::move(headers);
    }
}

json::object pin_to_json(const PinRecord& p) {
    json::object inject;
    inject["type"] = p.inject.type;
    inject["username"] = p.inject.username;
    inject["name"] = p.inject.name;
    inject["value_template"] = p.inject.value_template;
    if (p.inject.type == "aws-sigv4") {  // absent otherwise: older readers see no change
        inject["access_key_id"] = p.inject.access_key_id;
        inject["region"] = p.inject.region;
        inject["service"] = p.inject.service;
    }
    json::object o;
    o["id"] = p.id;
    o["host"] = p.host;
    o["secret"] = p.secret;
    o["inject"] = std::move(inject);
    o["path_prefixes"] = strings_to_json(p.path_prefixes);
    o["methods"] = strings_to_json(p.methods);
    extra_headers_to_json(p, o);
    o["expires_at"] = p.expires_at;
    return o;
}

json::object run_to_json(const RunRecord& r) {
    json::object o;
    o["id"] = r.id;
    o["scope"] = scope_to_json(r.scope);
    o["token_sha256"] = r.token_sha256;
    o["created_at"] = r.created_at;
    o["expires_at"] = r.expires_at;
    o["revoked"] = r.revoked;
    o["allow_hosts"] = strings_to_json(r.allow_hosts);
    o["source_cidrs"] = strings_to_json(r.source_cidrs);
    json::array pins;
    for (const PinRecord& p : r.pins) {
        pins.emplace_back(pin_to_json(p));
    }
    o["pins"] = std::move(pins);
    o["ca_cert_pem"] = r.ca_cert_pem;
    if (!r.ca_key.name.empty()) {
        o["ca_key"] = sealed_to_json(r.ca_key);
    }
    if (!r.mac.empty()) {
        o["mac"] = r.mac;
    }
    return o;
}

// ---- parsing -------------------------------------------------------------------------------

// Reads typed fields; the first problem is kept as "<path>.<key>: <what>".
class Reader {
public:
    const std::string& error() const { return error_; }

    bool fail(const std::string& path, const std::string& what) {
        if (error_.empty()) {
            error_ = path + ": " + what;
        }
        return false;
    }

    const json::object* object(const json::value& v, const std::string& path) {
        if (!v.is_object()) {
            fail(path, "expected an object");
            return nullptr;
        }
        return &v.get_object();
    }

    bool str(const json::object& o, const char* key, const std::string& path, std::string& out,
             bool required = false) {
        const json::value* v = o.if_contains(key);
        if (v == nullptr) {
            return !required || fail(path + "." + key, "required");
        }
        if (!v->is_string()) {
            return fail(path + "." + key, "expected a string");
        }
        out = std::string(v->get_string());
        return true;
    }

    template <class T>
    bool num(const json::object& o, const char* key, const std::string& path, T& out,
             bool required = false) {
        const json::value* v = o.if_contains(key);
        if (v == nullptr) {
            return !required || fail(path + "." + key, "required");
        }
        boost::system::error_code ec;
        const T n = v->is_number() ? v->to_number<T>(ec) : T{};
        if (!v->is_number() || ec) {
            return fail(path + "." + key, "expected an integer in range");
        }
        out = n;
        return true;
    }

    bool boolean(const json::object& o, const char* key, const std::string& path, bool& out) {
        const json::value* v = o.if_contains(key);
        if (v == nullptr) {
            return true;
        }
        if (!v->is_bool()) {
            return fail(path + "." + key, "expected true or false");
        }
        out = v->get_bool();
        return true;
    }

    bool strings(const json::object& o, const char* key, const std::string& path,
                 std::vector<std::string>& out) {
        const json::value* v = o.if_contains(key);
        if (v == nullptr) {
            return true;
        }
        if (!v->is_array()) {
            return fail(path + "." + key, "expected an array of strings");
        }
        for (const json::value& item : v->get_array()) {
            if (!item.is_string()) {
                return fail(path + "." + key, "expected an array of strings");
            }
            out.emplace_back(item.get_string());
        }
        return true;
    }

    bool scope(const json::object& o, const std::string& path, Scope& out) {
        const json::value* v = o.if_contains("scope");
        if (v == nullptr) {
            return fail(path + ".scope", "required");
        }
        const json::object* so = object(*v, path + ".scope");
        const std::string p = path + ".scope";
        return so != nullptr && str(*so, "org", p, out.org, true) &&
               str(*so, "project", p, out.project) && str(*so, "user", p, out.user) &&
               str(*so, "workflow", p, out.workflow);
    }

    bool sealed(const json::value& v, const std::string& path, SealedSecret& out) {
        const json::object* o = object(v, path);
        return o != nullptr && str(*o, "name", path, out.name, true) &&
               scope(*o, path, out.scope) && num(*o, "version", path, out.version, true) &&
               str(*o, "created_at", path, out.created_at) && str(*o, "kek_id", path, out.kek_id) &&
               str(*o, "wrapped_dek", path, out.wrapped_dek, true) &&
               str(*o, "nonce", path, out.nonce, true) &&
               str(*o, "ciphertext", path, out.ciphertext, true);
    }

    template <class Pin>
    bool extra_headers(const json::object& o, const std::string& path, Pin& out) {
        if constexpr (requires { out.extra_headers; }) {
            const json::value* v = o.if_contains("extra_headers");
            if (v == nullptr) {
                return true;
            }
            if (!v->is_array()) {
                return fail(path + ".extra_headers", "expected an array");
            }
            for (const json::value& item : v->get_array()) {
                const std::string p =
                    path + ".extra_headers[" + std::to_string(out.extra_headers.size()) + "]";
                const json::object* h = object(item, p);
                std::string name;
                std::string value;
                if (h == nullptr || !str(*h, "name", p, name, true) ||
                    !str(*h, "value", p, value)) {
                    return false;
                }
                out.extra_headers.emplace_back(std::move(name), std::move(value));
            }
        }
        return true;
    }

    bool pin(const json::value& v, const std::string& path, PinRecord& out) {
        const json::object* o = object(v, path);
        if (o == nullptr || !str(*o, "id", path, out.id, true) ||
            !str(*o, "host", path, out.host) || !str(*o, "secret", path, out.secret) ||
            !strings(*o, "path_prefixes", path, out.path_prefixes) ||
            !strings(*o, "methods", path, out.methods) ||
            !num(*o, "expires_at", path, out.expires_at) || !extra_headers(*o, path, out)) {
            return false;
        }
        const json::value* inject = o->if_contains("inject");
        if (inject == nullptr) {
            return true;
        }
        const std::string p = path + ".inject";
        const json::object* io = object(*inject, p);
        return io != nullptr && str(*io, "type", p, out.inject.type) &&
               str(*io, "username", p, out.inject.username) &&
               str(*io, "name", p, out.inject.name) &&
               str(*io, "value_template", p, out.inject.value_template) &&
               str(*io, "access_key_id", p, out.inject.access_key_id) &&
               str(*io, "region", p, out.inject.region) &&
               str(*io, "service", p, out.inject.service);
    }

    bool run(const json::value& v, const std::string& path, RunRecord& out) {
        const json::object* o = object(v, path);
        if (o == nullptr || !str(*o, "id", path, out.id, true) || !scope(*o, path, out.scope) ||
            !str(*o, "token_sha256", path, out.token_sha256) ||
            !num(*o, "created_at", path, out.created_at) ||
            !num(*o, "expires_at", path, out.expires_at) ||
            !boolean(*o, "revoked", path, out.revoked) ||
            !strings(*o, "allow_hosts", path, out.allow_hosts) ||
            !strings(*o, "source_cidrs", path, out.source_cidrs) ||
            !str(*o, "ca_cert_pem", path, out.ca_cert_pem) || !str(*o, "mac", path, out.mac)) {
            return false;
        }
        if (const json::value* pins = o->if_contains("pins"); pins != nullptr) {
            if (!pins->is_array()) {
                return fail(path + ".pins", "expected an array");
            }
            for (const json::value& item : pins->get_array()) {
                PinRecord pin_record;
                if (!pin(item, path + ".pins[" + std::to_string(out.pins.size()) + "]",
                         pin_record)) {
                    return false;
                }
                out.pins.push_back(std::move(pin_record));
            }
        }
        if (const json::value* key = o->if_contains("ca_key"); key != nullptr) {
            return sealed(*key, path + ".ca_key", out.ca_key);
        }
        return true;
    }

private:
    std::string error_;
};

// ---- files ---------------------------------------------------------------------------------

Result<bool> write_all(int fd, std::string_view data) {
    while (!data.empty()) {
        const ssize_t w = ::write(fd, data.data(), data.size());
        if (w < 0 && errno == EINTR) {
            continue;
        }
        if (w <= 0) {
            return make_error(errno_text());
        }
        data.remove_prefix(static_cast<size_t>(w));
    }
    return true;
}

Result<bool> fsync_dir(const std::string& dir) {
    const int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (fd < 0) {
        return make_error("cannot open folder " + dir + ": " + errno_text());
    }
    const bool ok = ::fsync(fd) == 0;
    const std::string why = errno_text();
    ::close(fd);
    if (!ok) {
        return make_error("fsync " + dir + ": " + why);
    }
    return true;
}

// Temp file, fsync, rename over the state file, fsync the folder: a crash leaves either the
// old or the new file, never a torn one.
Result<bool> write_state_file(const std::string& dir, const std::string& text) {
    const std::string tmp = dir + "/" + kTempFile;
    const std::string final_path = dir + "/" + kStateFile;
    const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
    if (fd < 0) {
        return make_error("state: cannot create " + tmp + ": " + errno_text());
    }
    // O_CREAT's mode applies only to a new file; a leftover temp file could have another one.
    const bool private_mode = ::fchmod(fd, 0600) == 0;
    Result<bool> written =
        private_mode ? write_all(fd, text) : Result<bool>(make_error(errno_text()));
    const bool synced = written.ok() && ::fsync(fd) == 0;
    const std::string why = written.ok() ? errno_text() : written.error();
    ::close(fd);
    if (!synced) {
        ::unlink(tmp.c_str());
        return make_error("state: cannot write " + tmp + ": " + why);
    }
    if (::rename(tmp.c_str(), final_path.c_str()) != 0) {
        const std::string rename_why = errno_text();
        ::unlink(tmp.c_str());
        return make_error("state: cannot rename " + tmp + " to " + final_path + ": " + rename_why);
    }
    Result<bool> dir_synced = fsync_dir(dir);
    if (!dir_synced) {
        return make_error("state: " + dir_synced.error());
    }
    return true;
}

std::string describe(const std::string& name, const Scope& scope) {
    return name + " (" + scope.to_string() + ")";
}

}  // namespace

std::string secret_key(const std::string& name, const Scope& scope) {
    return name + "@" + scope.to_string();
}

bool valid_secret_name(std::string_view name) {
    if (name.empty() || name.size() > 128) {
        return false;
    }
    for (char c : name) {
        if (!(std::isalnum(static_cast<unsigned char>(c)) || c == '_' || c == '-' || c == '.')) {
            return false;
        }
    }
    return true;
}

Result<StateSnapshot> apply_mutations(const StateSnapshot& base,
                                      const std::vector<Mutation>& mutations) {
    StateSnapshot next = base;
    for (const Mutation& m : mutations) {
        switch (m.kind) {
            case Mutation::Kind::PutSecret: {
                if (m.secret.name.empty()) {
                    return make_error("invalid: secret name is empty");
                }
                const std::string key = secret_key(m.secret.name, m.secret.scope);
                if (m.expect_version) {
                    auto it = next.secrets.find(key);
                    const uint64_t now = it == next.secrets.end() ? 0 : it->second.version;
                    if (now != *m.expect_version) {
                        return make_error(
                            "conflict: secret " + describe(m.secret.name, m.secret.scope) +
                            (now == 0 ? " was deleted"
                                      : (*m.expect_version == 0
                                             ? " already exists"
                                             : " changed (now version " + std::to_string(now) +
                                                   ")")) +
                            " meanwhile; try again");
                    }
                }
                next.secrets[key] = m.secret;
                break;
            }
            case Mutation::Kind::DeleteSecret: {
                if (m.scope) {
                    if (next.secrets.erase(secret_key(m.name, *m.scope)) == 0) {
                        return make_error("not_found: secret " + describe(m.name, *m.scope));
                    }
                    break;
                }
                size_t erased = 0;
                for (auto it = next.secrets.begin(); it != next.secrets.end();) {
                    if (it->second.name == m.name) {
                        it = next.secrets.erase(it);
                        ++erased;
                    } else {
                        ++it;
                    }
                }
                if (erased == 0) {
                    return make_error("not_found: secret " + m.name);
                }
                break;
            }
            case Mutation::Kind::PutRun: {
                if (m.run.id.empty()) {
                    return make_error("invalid: run id is empty");
                }
                if (m.expect_run) {
                    auto it = next.runs.find(m.run.id);
                    if (it == next.runs.end()) {
                        return make_error("not_found: run " + m.run.id);
                    }
                    if (run_to_json(it->second) != run_to_json(*m.expect_run)) {
                        return make_error("conflict: run " + m.run.id +
                                          " changed meanwhile; try again");
                    }
                }
                next.runs[m.run.id] = m.run;
                break;
            }
            case Mutation::Kind::DeleteRun:
                if (next.runs.erase(m.run_id) == 0) {
                    return make_error("not_found: run " + m.run_id);
                }
                break;
            case Mutation::Kind::ReplaceSecrets:
                // Each listed secret replaces the stored one with the same name, scope and version.
                // A secret deleted or rotated since it was read is not resurrected or rolled back.
                // A rewrap keeps the sealing's data (nonce, ciphertext, creation time): the stored
                // record must still be that sealing. A secret deleted and created again is
                // version 1 again, and another replica's rotation (keys rotate on etcd) would
                // otherwise have put its old value back over the new one.
                for (const SealedSecret& s : m.secrets) {
                    auto it = next.secrets.find(secret_key(s.name, s.scope));
                    if (it == next.secrets.end()) {
                        return make_error("not_found: secret " + describe(s.name, s.scope));
                    }
                    const SealedSecret& now = it->second;
                    if (now.version != s.version || now.nonce != s.nonce ||
                        now.ciphertext != s.ciphertext || now.created_at != s.created_at) {
                        return make_error("conflict: secret " + describe(s.name, s.scope) +
                                          " changed (now version " + std::to_string(now.version) +
                                          ")");
                    }
                    it->second = s;
                }
                break;
        }
    }
    return next;
}

std::string snapshot_to_json(const StateSnapshot& s) {
    json::object root;
    root["format"] = kFormat;
    root["revision"] = s.revision;
    json::array secrets;
    for (const auto& [key, sealed] : s.secrets) {
        secrets.emplace_back(sealed_to_json(sealed));
    }
    root["secrets"] = std::move(secrets);
    json::array runs;
    for (const auto& [id, run] : s.runs) {
        runs.emplace_back(run_to_json(run));
    }
    root["runs"] = std::move(runs);
    return json::serialize(root) + "\n";
}

Result<StateSnapshot> snapshot_from_json(const std::string& text) {
    boost::system::error_code ec;
    const json::value root = json::parse(text, ec);
    if (ec) {
        return make_error("invalid JSON: " + ec.message());
    }
    Reader reader;
    StateSnapshot snap;
    const json::object* o = reader.object(root, "state");
    int64_t format = 0;
    if (o == nullptr || !reader.num(*o, "format", "state", format, true) ||
        !reader.num(*o, "revision", "state", snap.revision, true)) {
        return make_error(reader.error());
    }
    if (format != kFormat) {
        return make_error("state.format: unsupported format " + std::to_string(format));
    }
    for (const char* key : {"secrets", "runs"}) {
        const json::value* list = o->if_contains(key);
        if (list != nullptr && !list->is_array()) {
            return make_error(std::string("state.") + key + ": expected an array");
        }
    }
    if (const json::value* list = o->if_contains("secrets"); list != nullptr) {
        for (const json::value& item : list->get_array()) {
            SealedSecret sealed;
            const std::string path = "state.secrets[" + std::to_string(snap.secrets.size()) + "]";
            if (!reader.sealed(item, path, sealed)) {
                return make_error(reader.error());
            }
            const std::string key = secret_key(sealed.name, sealed.scope);
            if (!snap.secrets.emplace(key, std::move(sealed)).second) {
                return make_error(path + ": duplicate secret " + key);
            }
        }
    }
    if (const json::value* list = o->if_contains("runs"); list != nullptr) {
        for (const json::value& item : list->get_array()) {
            RunRecord run;
            const std::string path = "state.runs[" + std::to_string(snap.runs.size()) + "]";
            if (!reader.run(item, path, run)) {
                return make_error(reader.error());
            }
            const std::string id = run.id;
            if (!snap.runs.emplace(id, std::move(run)).second) {
                return make_error(path + ": duplicate run " + id);
            }
        }
    }
    return snap;
}

std::string secret_record_to_json(const SealedSecret& s) {
    return json::serialize(sealed_to_json(s));
}

std::string run_record_to_json(const RunRecord& r) {
    return json::serialize(run_to_json(r));
}

namespace {

/// One record's JSON through the Reader member that reads it (`sealed` or `run`).
template <class T>
Result<T> record_from_json(std::string_view text, const char* path,
                           bool (Reader::*read)(const json::value&, const std::string&, T&)) {
    boost::system::error_code ec;
    const json::value v = json::parse(text, ec);
    if (ec) {
        return make_error("invalid JSON: " + ec.message());
    }
    Reader reader;
    T out;
    if (!(reader.*read)(v, path, out)) {
        return make_error(reader.error());
    }
    return out;
}

}  // namespace

Result<SealedSecret> secret_record_from_json(std::string_view text) {
    return record_from_json<SealedSecret>(text, "secret", &Reader::sealed);
}

Result<RunRecord> run_record_from_json(std::string_view text) {
    return record_from_json<RunRecord>(text, "run", &Reader::run);
}

// ---- FileStateStore ------------------------------------------------------------------------

Result<std::unique_ptr<FileStateStore>> FileStateStore::open(const std::string& dir) {
    std::error_code ec;
    if (!std::filesystem::exists(dir, ec)) {
        std::filesystem::create_directories(dir, ec);
        if (ec) {
            return make_error("state.path: cannot create " + dir + ": " + ec.message());
        }
        std::filesystem::permissions(dir, std::filesystem::perms::owner_all, ec);
    } else if (!std::filesystem::is_directory(dir, ec)) {
        return make_error("state.path: " + dir + " is not a folder");
    }
    // A temp file is what a crash left between write and rename; the state file is intact.
    const std::string tmp = dir + "/" + kTempFile;
    if (::unlink(tmp.c_str()) != 0 && errno != ENOENT) {
        return make_error("state.path: cannot remove stale " + tmp + ": " + errno_text());
    }
    auto snapshot = std::make_shared<StateSnapshot>();
    const std::string path = dir + "/" + kStateFile;
    std::ifstream in(path, std::ios::binary);
    if (in) {
        std::ostringstream text;
        text << in.rdbuf();
        if (in.bad()) {
            return make_error("state file " + path + ": read error");
        }
        Result<StateSnapshot> loaded = snapshot_from_json(text.str());
        if (!loaded) {
            return make_error("state file " + path + " is corrupt: " + loaded.error());
        }
        *snapshot = std::move(loaded).value();
    } else if (std::filesystem::exists(path, ec)) {
        return make_error("state file " + path + ": cannot open: " + errno_text());
    }
    std::unique_ptr<FileStateStore> store(new FileStateStore());
    store->dir_ = dir;
    store->current_.store(std::move(snapshot));
    return store;
}

std::shared_ptr<const StateSnapshot> FileStateStore::snapshot() const {
    return current_.load();
}

// WARNING: listeners run with write_mu_ held (so they see revisions in order); a listener
// must not call apply() or on_change().
Result<uint64_t> FileStateStore::apply(const std::vector<Mutation>& mutations) {
    std::lock_guard<std::mutex> lock(write_mu_);
    const std::shared_ptr<const StateSnapshot> base = current_.load();
    Result<StateSnapshot> next = apply_mutations(*base, mutations);
    if (!next) {
        return make_error(next.error());
    }
    next->revision = base->revision + 1;
    Result<bool> written = write_state_file(dir_, snapshot_to_json(*next));
    if (!written) {
        return make_error(written.error());
    }
    auto published = std::make_shared<const StateSnapshot>(std::move(next).value());
    current_.store(published);
    for (const auto& listener : listeners_) {
        listener(published);
    }
    return published->revision;
}

void FileStateStore::on_change(std::function<void(std::shared_ptr<const StateSnapshot>)> cb) {
    std::lock_guard<std::mutex> lock(write_mu_);
    listeners_.push_back(std::move(cb));
}

// ---- scope resolution ----------------------------------------------------------------------

const SealedSecret* resolve_secret(const StateSnapshot& s, const std::string& name,
                                   const Scope& run_scope, std::vector<ScopeCandidate>* chain) {
    // Every key of this name starts with "<name>@"; the map keeps them together.
    const std::string prefix = name + "@";
    std::vector<const SealedSecret*> candidates;
    for (auto it = s.secrets.lower_bound(prefix);
         it != s.secrets.end() && it->first.compare(0, prefix.size(), prefix) == 0; ++it) {
        if (it->second.name == name) {
            candidates.push_back(&it->second);
        }
    }
    std::stable_sort(candidates.begin(), candidates.end(),
                     [](const SealedSecret* a, const SealedSecret* b) {
                         return a->scope.specificity() > b->scope.specificity();
                     });
    const SealedSecret* best = nullptr;
    for (const SealedSecret* c : candidates) {
        const bool matches = c->scope.contains(run_scope);
        if (matches && best == nullptr) {
            best = c;
        }
        if (chain != nullptr) {
            chain->push_back(ScopeCandidate{c->scope, c->version, matches});
        }
    }
    return best;
}

}  // namespace egress::credstore
