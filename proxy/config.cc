// Config loading: YAML text → raw nodes → validated, immutable Config (STYLE.md 15).
//
// Every mapping is walked in document order through one helper (`Parser::fields`) that also
// rejects unknown, duplicate and non-string keys, so errors come out in the order a reader
// meets them in the file. Nothing here throws: yaml-cpp exceptions become error lines, and
// all problems are collected and returned together, each as "yaml.path: problem".
#include "proxy/config.h"

#include "common/regular_file.h"

#include <fcntl.h>
#include <unistd.h>
#include <yaml-cpp/eventhandler.h>
#include <yaml-cpp/yaml.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <charconv>
#include <cstring>
#include <filesystem>
#include <functional>
#include <limits>
#include <set>
#include <sstream>
#include <string_view>
#include <utility>

#include "common/trust_roots.h"
#include "credstore/state_store.h"

namespace egress::proxy {
namespace {

constexpr size_t kMaxEchoedValue = 64;  // longest value quoted back in a message
constexpr size_t kMaxConfigBytes = 16 * 1024 * 1024;
constexpr size_t kMaxUnixPath = 107;  // sizeof(sockaddr_un::sun_path) - 1
constexpr std::string_view kDurationHint = "(expected e.g. 500ms, 10s, 2m, 1h)";

std::string quote_value(std::string_view text) {
    std::string out = "'";
    if (text.size() > kMaxEchoedValue) {
        out.append(text.substr(0, kMaxEchoedValue)).append("...");
    } else {
        out.append(text);
    }
    return out + "'";
}

/// What a node is, for "expected X, got Y" messages.
std::string describe(const YAML::Node& node) {
    switch (node.Type()) {
        case YAML::NodeType::Null:
            return "null";
        case YAML::NodeType::Scalar:
            return quote_value(node.Scalar());
        case YAML::NodeType::Sequence:
            return "a list";
        case YAML::NodeType::Map:
            return "a mapping";
        case YAML::NodeType::Undefined:
            break;
    }
    return "nothing";
}

std::string join_path(const std::string& path, std::string_view key) {
    return path.empty() ? std::string(key) : path + "." + std::string(key);
}

std::string index_path(const std::string& path, size_t i) {
    return path + "[" + std::to_string(i) + "]";
}

/// "a, b or c"
std::string one_of(const std::vector<std::string_view>& names) {
    std::string out;
    for (size_t i = 0; i < names.size(); ++i) {
        if (i > 0) {
            out += (i + 1 == names.size()) ? " or " : ", ";
        }
        out += names[i];
    }
    return out;
}

bool is_tchar(char c) {
    return std::isalnum(static_cast<unsigned char>(c)) ||
           std::string_view("!#$%&'*+-.^_`|~").find(c) != std::string_view::npos;
}

bool valid_run_id(std::string_view id) {
    if (id.empty() || id.size() > 64) {
        return false;
    }
    return std::all_of(id.begin(), id.end(), [](char c) {
        return std::isalnum(static_cast<unsigned char>(c)) || c == '_' || c == '.' || c == '-';
    });
}

/// Decimal digits only (no sign, no spaces), at most `max_digits` of them.
std::optional<uint64_t> parse_digits(std::string_view text, size_t max_digits = 19) {
    if (text.empty() || text.size() > max_digits) {
        return std::nullopt;
    }
    uint64_t value = 0;
    auto [ptr, ec] = std::from_chars(text.data(), text.data() + text.size(), value);
    if (ec != std::errc() || ptr != text.data() + text.size()) {
        return std::nullopt;
    }
    return value;
}

std::optional<uint16_t> parse_port(std::string_view text) {
    auto v = parse_digits(text, 5);
    if (!v || *v > 65535) {
        return std::nullopt;
    }
    return static_cast<uint16_t>(*v);
}

/// "127.0.0.1:3128", "[::1]:3128", or "unix:/path.sock" when allowed. The host must be an IP
/// literal: a listener never resolves names.
Result<ListenAddress> parse_listen(std::string_view text, bool allow_unix) {
    constexpr std::string_view kUnix = "unix:";
    if (text.substr(0, kUnix.size()) == kUnix) {
        if (!allow_unix) {
            return make_error("unix sockets are only supported for listen.admin");
        }
        std::string_view path = text.substr(kUnix.size());
        if (path.empty()) {
            return make_error("expected unix:/path.sock, got " + quote_value(text));
        }
        if (path.size() > kMaxUnixPath) {
            return make_error("unix socket path too long (max " + std::to_string(kMaxUnixPath) +
                              " bytes)");
        }
        ListenAddress out;
        out.unix_path = std::string(path);
        return out;
    }
    const std::string expected = "expected host:port (e.g. 127.0.0.1:3128 or [::1]:3128";
    std::string_view host;
    std::string_view port;
    if (!text.empty() && text.front() == '[') {
        size_t close = text.find(']');
        if (close == std::string_view::npos || close + 1 >= text.size() || text[close + 1] != ':') {
            return make_error(expected + "), got " + quote_value(text));
        }
        host = text.substr(1, close - 1);
        port = text.substr(close + 2);
    } else {
        size_t colon = text.rfind(':');
        if (colon == std::string_view::npos) {
            return make_error(expected + "), got " + quote_value(text));
        }
        host = text.substr(0, colon);
        port = text.substr(colon + 1);
        if (host.find(':') != std::string_view::npos) {
            return make_error(expected + "; put an IPv6 address in brackets), got " + quote_value(text));
        }
    }
    if (host.empty()) {
        return make_error(expected + "), got " + quote_value(text));
    }
    auto ip = policy::IpAddress::parse(host);
    if (!ip) {
        return make_error("host must be an IP address (e.g. 127.0.0.1), got " + quote_value(host));
    }
    auto p = parse_port(port);
    if (!p) {
        return make_error("bad port " + quote_value(port) + " (expected 0..65535)");
    }
    ListenAddress out;
    out.host = ip->to_string();
    out.port = *p;
    return out;
}

/// listen.advertise: "host:port", host a DNS name or an IP literal ("[v6]:port"), port
/// 1..65535; returned as parse_authority normalizes it ("[::1]:3128"). An unspecified address
/// is refused: nobody can connect to it.
Result<std::string> parse_advertise(std::string_view text) {
    auto hp = policy::parse_authority(text, std::nullopt);
    if (!hp) {
        return make_error("expected host:port that sandboxes connect to (e.g. "
                          "egressd.egress.svc:3128, 10.0.0.5:3128 or [fd00::5]:3128), got " +
                          quote_value(text) + ": " + hp.error());
    }
    if (hp->host == "0.0.0.0" || hp->host == "::") {
        return make_error("unspecified address " + quote_value(hp->host) +
                          ": name an address sandboxes can connect to");
    }
    return hp->authority();
}

/// resolver.servers entry: "ip", "ip:port" or "[v6]:port"; port 1..65535.
Result<bool> check_dns_server(std::string_view text) {
    if (policy::IpAddress::parse(text)) {
        return true;  // bare address ("1.2.3.4", "::1", "[::1]"): port 53
    }
    std::string_view host;
    std::string_view port;
    if (!text.empty() && text.front() == '[') {
        size_t close = text.find("]:");
        if (close == std::string_view::npos) {
            return make_error("expected ip or ip:port, got " + quote_value(text));
        }
        host = text.substr(1, close - 1);
        port = text.substr(close + 2);
    } else {
        size_t colon = text.find(':');
        if (colon == std::string_view::npos || text.find(':', colon + 1) != text.npos) {
            return make_error("expected ip or ip:port, got " + quote_value(text));
        }
        host = text.substr(0, colon);
        port = text.substr(colon + 1);
    }
    if (!policy::IpAddress::parse(host)) {
        return make_error("bad IP address " + quote_value(host));
    }
    auto p = parse_port(port);
    if (!p || *p == 0) {
        return make_error("bad port " + quote_value(port) + " (expected 1..65535)");
    }
    return true;
}

/// `path` as egressd's file calls reach it, to compare two paths: absolute (against the
/// working directory), its folder's symlinks followed where they exist and "." and ".."
/// resolved as the kernel resolves them: after the link before them is followed
/// (`dir/link/..` is the folder holding the link's target, not `dir`; normalising the path
/// first took `keylink/../master.key` for a file beside the link). The last component is
/// followed with `follow_last` (a file opened, read or appended to: the link's target is
/// what is reached), not without (a rename or an unlink acts on a link itself).
std::filesystem::path file_identity(const std::string& path, bool follow_last = false) {
    namespace fs = std::filesystem;
    std::error_code ec;
    fs::path p = fs::absolute(path, ec);
    if (ec) {
        p = path;
    }
    if (!p.has_filename() && p.has_parent_path() && p != p.root_path()) {
        p = p.parent_path();  // "var/state/": the folder itself
    }
    const fs::path name = p.filename();
    if (follow_last || name == "." || name == "..") {  // ".": no link of its own to act on
        fs::path whole = fs::weakly_canonical(p, ec);
        if (!ec) {
            return whole.lexically_normal();
        }
        return p.lexically_normal();
    }
    fs::path dir = fs::weakly_canonical(p.parent_path(), ec);
    if (!ec) {
        return (dir / name).lexically_normal();
    }
    return p.lexically_normal();
}

/// Whether `inner` is `outer` or inside it (both from file_identity).
bool same_or_inside(const std::filesystem::path& inner, const std::filesystem::path& outer) {
    auto o = outer.begin();
    auto i = inner.begin();
    for (; o != outer.end(); ++o, ++i) {
        if (i == inner.end() || *i != *o) {
            return false;
        }
    }
    return true;
}

/// A file egressd writes (a run's CA files, the audit file, the admin socket) must not be
/// one it reads as a key, token, secret, CA bundle or state, nor one another key writes:
/// `ca_cert_out: var/master.key` replaced the master key with a certificate (every stored
/// secret lost), `listen.admin: unix:var/master.key` with a socket, and two runs sharing a
/// ca_cert_out overwrote each other's CA. Checked here, so --check, a start and a reload
/// all refuse it, naming the key.
template <class OnClash>
void for_each_written_file_clash(const Config& c, OnClash&& error) {
    // Each path by its name (a symlink at it not followed) and by what a symlink at it
    // reaches: files written by a rename (the CA files) or unlinked first (the socket) act on
    // the name, files opened (read, appended to: the audit file, the state) on what it
    // reaches. Two paths clash when any form of one is any form of the other: one symlink
    // named as both the master key and a CA file, or a link to the key named as the key and
    // the key as a CA file, are both refused.
    struct Named {
        std::string key;
        std::string path;
        std::filesystem::path name;
        std::filesystem::path reached;
    };
    auto forms = [](std::string key, const std::string& path) {
        return Named{std::move(key), path, file_identity(path), file_identity(path, true)};
    };
    auto same = [](const Named& a, const Named& b) {
        return a.name == b.name || a.name == b.reached || a.reached == b.name ||
               a.reached == b.reached;
    };
    auto inside = [](const Named& a, const Named& folder) {
        return same_or_inside(a.name, folder.name) || same_or_inside(a.name, folder.reached) ||
               same_or_inside(a.reached, folder.name) ||
               same_or_inside(a.reached, folder.reached);
    };
    std::vector<Named> written;
    if (c.admin.is_unix()) {
        written.push_back(forms("listen.admin", c.admin.unix_path));
    }
    if (c.audit.path != "-") {
        written.push_back(forms("audit.path", c.audit.path));
    }
    for (const auto& run : c.runs) {
        if (!run.ca_cert_out.empty()) {
            written.push_back(forms(run.yaml_path + ".ca_cert_out", run.ca_cert_out));
        }
        if (!run.ca_bundle_out.empty()) {
            written.push_back(forms(run.yaml_path + ".ca_bundle_out", run.ca_bundle_out));
        }
    }
    std::vector<Named> read;
    if (!c.source.empty()) {
        read.push_back(forms("the config file", c.source));
    }
    read.push_back(forms("admin.token_file", c.admin_token_file));
    read.push_back(forms("keys.master_key_file", c.master_key_file));
    // Where `egressctl keys rotate` puts the next key (control_plane.cc).
    read.push_back(forms("keys.master_key_file (its .next)", c.master_key_file + ".next"));
    if (c.upstream_ca_file != "system") {
        read.push_back(forms("upstream.ca_file", c.upstream_ca_file));
    } else {
        // A bundle written over the system roots it starts from would grow by a CA at each
        // start and reload.
        for (const auto& f : default_root_files()) {
            read.push_back(forms("the system trust store (upstream.ca_file: system)", f));
        }
    }
    if (c.etcd.ca_file != "system") {
        read.push_back(forms("state.etcd.ca_file", c.etcd.ca_file));
    }
    if (c.etcd.cert_file) {
        read.push_back(forms("state.etcd.cert_file", *c.etcd.cert_file));
    }
    if (c.etcd.key_file) {
        read.push_back(forms("state.etcd.key_file", *c.etcd.key_file));
    }
    for (const auto& run : c.runs) {
        if (run.token_file && !run.token_file->empty()) {
            read.push_back(forms(run.yaml_path + ".token_file", *run.token_file));
        }
        for (const auto& pin : run.pins) {
            if (!pin.secret_file.empty()) {
                read.push_back(forms(pin.yaml_path + ".secret_file", pin.secret_file));
            }
        }
    }
    std::optional<Named> state;
    if (c.state_backend == "file") {
        state = forms("state.path", c.state_path);
    }
    for (size_t i = 0; i < written.size(); ++i) {
        const Named& w = written[i];
        if (state && inside(w, *state)) {
            error(w.key, "is inside state.path (" + state->path +
                             "), egressd's store: give a path outside it");
            continue;
        }
        auto read_hit = std::find_if(read.begin(), read.end(),
                                     [&](const Named& r) { return same(r, w); });
        if (read_hit != read.end()) {
            error(w.key, "names the file of " + read_hit->key + " (" + read_hit->path +
                             "), which egressd reads: writing " + w.key +
                             " would destroy it; give another path");
            continue;
        }
        // (One run's ca_cert_out and ca_bundle_out: refused by parse_run, which leaves
        // such a run out of c.runs.)
        for (size_t j = 0; j < i; ++j) {
            const Named& o = written[j];
            if (same(o, w)) {
                error(w.key, "names the same file as " + o.key + " (" + o.path +
                                 "): give each its own file");
                break;
            }
        }
    }
}



using Handler = std::function<void(const YAML::Node& value, const std::string& path)>;

struct Field {
    std::string_view key;
    Handler handle;
};

/// Collects errors while converting nodes. Accessors report a problem under `path` and return
/// nullopt; callers keep going so that one pass reports everything. The `set_*` helpers build
/// handlers for `fields`, so each section below reads as its schema.
class Parser {
public:
    std::vector<std::string> errors;
    std::string source;  // names the top level in messages

    void error(const std::string& path, const std::string& problem) {
        errors.push_back(path + ": " + problem);
    }

    /// Walks a mapping in document order, dispatching each key to its handler. A null node (a
    /// section whose keys are all commented out) is an empty mapping. Returns the keys seen.
    std::set<std::string> fields(const YAML::Node& node, const std::string& path,
                                 const std::vector<Field>& known) {
        std::set<std::string> seen;
        const std::string& where = path.empty() ? source : path;
        if (node.IsNull()) {
            return seen;
        }
        if (!node.IsMap()) {
            error(where, "expected a mapping, got " + describe(node));
            return seen;
        }
        for (const auto& kv : node) {
            if (!kv.first.IsScalar()) {
                error(where, "keys must be strings, got " + describe(kv.first));
                continue;
            }
            const std::string& key = kv.first.Scalar();
            std::string key_path = join_path(path, key);
            auto it = std::find_if(known.begin(), known.end(),
                                   [&](const Field& f) { return f.key == key; });
            if (it == known.end()) {
                std::vector<std::string_view> names;
                for (const auto& f : known) {
                    names.push_back(f.key);
                }
                error(key_path, "unknown key (expected " + one_of(names) + ")");
            } else if (!seen.insert(key).second) {
                error(key_path, "duplicate key");
            } else {
                it->handle(kv.second, key_path);
            }
        }
        return seen;
    }

    Handler section(std::vector<Field> known) {
        return [this, known = std::move(known)](const YAML::Node& v, const std::string& p) {
            fields(v, p, known);
        };
    }

    /// Calls `item` for each element of a list; null is an empty list.
    void list(const YAML::Node& node, const std::string& path, const Handler& item) {
        if (node.IsNull()) {
            return;
        }
        if (!node.IsSequence()) {
            error(path, "expected a list, got " + describe(node));
            return;
        }
        for (size_t i = 0; i < node.size(); ++i) {
            item(node[i], index_path(path, i));
        }
    }

    /// A list whose items are converted by `convert` (nullopt = error already reported).
    template <class T, class F>
    std::vector<T> list_of(const YAML::Node& node, const std::string& path, F convert) {
        std::vector<T> out;
        list(node, path, [&](const YAML::Node& item, const std::string& p) {
            if (std::optional<T> v = convert(item, p)) {
                out.push_back(std::move(*v));
            }
        });
        return out;
    }

    std::optional<std::string> string(const YAML::Node& node, const std::string& path,
                                      bool allow_empty = false) {
        if (!node.IsScalar()) {
            error(path, "expected a string, got " + describe(node));
            return std::nullopt;
        }
        if (!allow_empty && node.Scalar().empty()) {
            error(path, "must not be empty");
            return std::nullopt;
        }
        return node.Scalar();
    }

    std::optional<uint64_t> integer(const YAML::Node& node, const std::string& path, uint64_t min,
                                    uint64_t max) {
        std::optional<uint64_t> v;
        if (node.IsScalar()) {
            v = parse_digits(node.Scalar());
        }
        if (!v || *v < min || *v > max) {
            error(path, "expected an integer in " + std::to_string(min) + ".." +
                            std::to_string(max) + ", got " + describe(node));
            return std::nullopt;
        }
        return v;
    }

    /// A duration greater than 0.
    std::optional<std::chrono::milliseconds> duration(const YAML::Node& node,
                                                      const std::string& path) {
        if (!node.IsScalar()) {
            error(path,
                  "expected a duration " + std::string(kDurationHint) + ", got " + describe(node));
            return std::nullopt;
        }
        auto d = parse_duration(node.Scalar());
        if (!d) {
            error(path, d.error());
            return std::nullopt;
        }
        if (d->count() <= 0) {
            error(path, "must be greater than 0");
            return std::nullopt;
        }
        return *d;
    }

    /// One of `names`; returns its index.
    std::optional<size_t> choice(const YAML::Node& node, const std::string& path,
                                 const std::vector<std::string_view>& names) {
        auto s = string(node, path, /*allow_empty=*/true);
        if (!s) {
            return std::nullopt;
        }
        for (size_t i = 0; i < names.size(); ++i) {
            if (*s == names[i]) {
                return i;
            }
        }
        error(path, "unknown value " + quote_value(*s) + " (expected " + one_of(names) + ")");
        return std::nullopt;
    }

    std::optional<policy::HostPattern> host_pattern(
        const YAML::Node& node, const std::string& path,
        policy::HostPattern::Scope scope = policy::HostPattern::Scope::OneLabel) {
        auto s = string(node, path);
        if (!s) {
            return std::nullopt;
        }
        auto pattern = policy::HostPattern::parse(*s, scope);
        if (!pattern) {
            error(path, pattern.error());
            return std::nullopt;
        }
        return std::move(*pattern);
    }

    std::optional<policy::Cidr> cidr(const YAML::Node& node, const std::string& path) {
        auto s = string(node, path);
        if (!s) {
            return std::nullopt;
        }
        auto c = policy::Cidr::parse(*s);
        if (!c) {
            error(path, c.error());
            return std::nullopt;
        }
        return std::move(*c);
    }

    // --- handler builders: each assigns its target only when the value is valid ----------

    Handler set_string(std::string& out) {
        return [this, &out](const YAML::Node& v, const std::string& p) {
            if (auto s = string(v, p)) {
                out = std::move(*s);
            }
        };
    }

    /// null or a non-empty string.
    Handler set_optional_string(std::optional<std::string>& out) {
        return [this, &out](const YAML::Node& v, const std::string& p) {
            if (v.IsNull()) {
                out.reset();
            } else if (auto s = string(v, p)) {
                out = std::move(*s);
            }
        };
    }

    Handler set_count(size_t& out, uint64_t min, uint64_t max) {
        return [this, &out, min, max](const YAML::Node& v, const std::string& p) {
            if (auto n = integer(v, p, min, max)) {
                out = static_cast<size_t>(*n);
            }
        };
    }

    Handler set_timeout(std::chrono::milliseconds& out) {
        return [this, &out](const YAML::Node& v, const std::string& p) {
            if (auto d = duration(v, p)) {
                out = *d;
            }
        };
    }

    Handler set_bool(bool& out) {
        return [this, &out](const YAML::Node& v, const std::string& p) {
            bool b = false;
            if (!v.IsScalar() || !YAML::convert<bool>::decode(v, b)) {
                error(p, "expected true or false, got " + describe(v));
            } else {
                out = b;
            }
        };
    }

    /// An enumeration spelled by `names`; stores the value at the same index of `values`.
    template <class T>
    Handler set_choice(T& out, std::vector<std::string_view> names, std::vector<T> values) {
        return [this, &out, names = std::move(names), values = std::move(values)](
                   const YAML::Node& v, const std::string& p) {
            if (auto i = choice(v, p, names)) {
                out = values[*i];
            }
        };
    }

    Handler set_listen(ListenAddress& out, bool allow_unix) {
        return [this, &out, allow_unix](const YAML::Node& v, const std::string& p) {
            if (auto a = listen(v, p, allow_unix)) {
                out = std::move(*a);
            }
        };
    }

    Handler set_patterns(std::vector<policy::HostPattern>& out,
                         policy::HostPattern::Scope scope = policy::HostPattern::Scope::OneLabel) {
        return [this, &out, scope](const YAML::Node& v, const std::string& p) {
            out = list_of<policy::HostPattern>(
                v, p, [this, scope](const YAML::Node& n, const std::string& np) {
                    return host_pattern(n, np, scope);
                });
        };
    }

    Handler set_cidrs(std::vector<policy::Cidr>& out) {
        return [this, &out](const YAML::Node& v, const std::string& p) {
            out = list_of<policy::Cidr>(
                v, p, [this](const YAML::Node& n, const std::string& np) { return cidr(n, np); });
        };
    }

    std::optional<ListenAddress> listen(const YAML::Node& node, const std::string& path,
                                        bool allow_unix) {
        auto s = string(node, path);
        if (!s) {
            return std::nullopt;
        }
        auto addr = parse_listen(*s, allow_unix);
        if (!addr) {
            error(path, addr.error());
            return std::nullopt;
        }
        return std::move(*addr);
    }

    // --- sections ------------------------------------------------------------------------

    void parse_root(const YAML::Node& root, Config& c) {
        using policy::Unpinned;
        constexpr uint64_t kMaxCount = std::numeric_limits<int32_t>::max();
        Limits& l = c.limits;
        fields(
            root, "",
            {{"listen", section({{"proxy", set_listen(c.proxy, false)},
                                 {"admin", set_listen(c.admin, true)},
                                 {"transparent",
                                  [this, &c](const YAML::Node& v, const std::string& p) {
                                      if (v.IsNull()) {
                                          c.transparent.reset();
                                      } else if (auto a = listen(v, p, false)) {
                                          c.transparent = std::move(*a);
                                      }
                                  }},
                                 {"advertise",
                                  [this, &c](const YAML::Node& v, const std::string& p) {
                                      if (v.IsNull()) {
                                          c.advertise.reset();
                                      } else if (auto s = string(v, p)) {
                                          if (auto a = parse_advertise(*s)) {
                                              c.advertise = std::move(*a);
                                          } else {
                                              error(p, a.error());
                                          }
                                      }
                                  }}})},
             {"admin",
              section({{"token_file", set_string(c.admin_token_file)},
                       {"max_body_bytes", set_count(c.admin_limits.max_body_bytes, 1024, 64 << 20)},
                       {"max_header_bytes",
                        set_count(c.admin_limits.max_header_bytes, 1024, 1 << 20)},
                       {"read_timeout", set_timeout(c.admin_limits.read_timeout)},
                       {"write_timeout", set_timeout(c.admin_limits.write_timeout)},
                       {"max_connections",
                        set_count(c.admin_limits.max_connections, 2, 100'000)},
                       {"max_runs", set_count(c.admin_limits.max_runs, 1, 1'000'000)},
                       {"max_pins_per_run",
                        set_count(c.admin_limits.max_pins_per_run, 1, 100'000)}})},
             {"state",
              [this, &c](const YAML::Node& v, const std::string& p) { parse_state(v, p, c); }},
             {"keys", section({{"master_key_file", set_string(c.master_key_file)},
                               {"kms_command", set_optional_string(c.kms_command)}})},
             {"upstream", section({{"ca_file", set_string(c.upstream_ca_file)}})},
             {"resolver", section({{"overrides",
                                    [this, &c](const YAML::Node& v, const std::string& p) {
                                        parse_overrides(v, p, c.resolver_overrides);
                                    }},
                                   {"servers",
                                    [this, &c](const YAML::Node& v, const std::string& p) {
                                        parse_dns_servers(v, p, c.resolver_servers);
                                    }}})},
             {"policy", section({{"unpinned", set_choice(c.policy.unpinned, {"tunnel", "intercept"},
                                                         {Unpinned::Tunnel, Unpinned::Intercept})},
                                 {"allow_hosts", set_patterns(c.policy.allow_hosts)},
                                 {"deny_hosts", set_patterns(c.policy.deny_hosts,
                                                             policy::HostPattern::Scope::Subtree)},
                                 {"allow_networks", set_cidrs(c.allow_networks)},
                                 {"websocket", set_bool(c.policy.websocket)},
                                 {"allowed_ports",
                                  [this, &c](const YAML::Node& v, const std::string& p) {
                                      c.policy.allowed_ports = list_of<uint16_t>(
                                          v, p, [this](const YAML::Node& n, const std::string& np) {
                                              auto port = integer(n, np, 1, 65535);
                                              return port ? std::optional<uint16_t>(*port)
                                                          : std::nullopt;
                                          });
                                  }}})},
             {"limits",
              section({{"max_header_bytes", set_count(l.max_header_bytes, 256, 16 << 20)},
                       {"max_header_fields", set_count(l.max_header_fields, 8, 10000)},
                       {"max_unidentified_connections",
                        set_count(l.max_unidentified_connections, 1, kMaxCount)},
                       {"header_timeout", set_timeout(l.header_timeout)},
                       {"idle_timeout", set_timeout(l.idle_timeout)},
                       {"connect_timeout", set_timeout(l.connect_timeout)},
                       {"max_dial_addresses", set_count(l.max_dial_addresses, 1, 64)},
                       {"tls_timeout", set_timeout(l.tls_timeout)},
                       {"dns_timeout", set_timeout(l.dns_timeout)},
                       {"drain_timeout", set_timeout(l.drain_timeout)},
                       {"linger_timeout", set_timeout(l.linger_timeout)},
                       {"refusal_timeout", set_timeout(l.refusal_timeout)},
                       {"upstream_idle_timeout", set_timeout(l.upstream_idle_timeout)},
                       {"scrub_hold_timeout",
                        [this, &l](const YAML::Node& v, const std::string& p) {
                            if (v.IsScalar()) {  // 0 too: held until the next piece or the end
                                if (auto z = parse_duration(v.Scalar()); z && z->count() == 0) {
                                    l.scrub_hold_timeout = *z;
                                    return;
                                }
                            }
                            if (auto d = duration(v, p)) {
                                l.scrub_hold_timeout = *d;
                            }
                        }},
                       {"connections_per_run", set_count(l.connections_per_run, 1, kMaxCount)},
                       {"h2_max_concurrent_streams",
                        set_count(l.h2_max_concurrent_streams, 1, kMaxCount)},
                       {"h2_max_header_list_bytes",
                        set_count(l.h2_max_header_list_bytes, 1024, 16 << 20)},
                       {"h2_max_header_fields", set_count(l.h2_max_header_fields, 8, 10000)},
                       {"h2_max_continuations", set_count(l.h2_max_continuations, 0, 1000)},
                       {"h2_stream_reset_burst", set_count(l.h2_stream_reset_burst, 1, kMaxCount)},
                       {"h2_stream_reset_rate", set_count(l.h2_stream_reset_rate, 1, kMaxCount)},
                       {"h2_max_premature_resets",
                        set_count(l.h2_max_premature_resets, 1, kMaxCount)},
                       {"h2_control_frame_burst",
                        set_count(l.h2_control_frame_burst, 10, kMaxCount)},
                       {"h2_max_outbound_ack", set_count(l.h2_max_outbound_ack, 1, 100000)},
                       {"h2_max_settings", set_count(l.h2_max_settings, 7, 1000)},
                       {"h2_stream_window", set_count(l.h2_stream_window, 16384, (1u << 31) - 1)},
                       {"h2_connection_window",
                        set_count(l.h2_connection_window, 65535, (1u << 31) - 1)},
                       {"h2_settings_timeout", set_timeout(l.h2_settings_timeout)},
                       {"static_ca_validity",
                        [this, &l](const YAML::Node& v, const std::string& p) {
                            auto d = duration(v, p);
                            if (d && *d < std::chrono::seconds(1)) {
                                error(p, "must be at least 1s");
                            } else if (d) {
                                l.static_ca_validity = *d;
                            }
                        }},
                       {"leaf_cache_size", set_count(l.leaf_cache_size, 1, kMaxCount)},
                       {"leaf_mints_per_minute",
                        set_count(l.leaf_mints_per_minute, 0, kMaxCount)},
                       {"max_upstream_idle_per_host",
                        set_count(l.max_upstream_idle_per_host, 0, kMaxCount)},
                       {"retry_body_bytes", set_count(l.retry_body_bytes, 0, 16 << 20)},
                       {"sign_body_bytes", set_count(l.sign_body_bytes, 0, 64 << 20)},
                       {"method_body_bytes", set_count(l.method_body_bytes, 0, 64 << 20)},
                       {"upstream_tls_sessions",
                        set_count(l.upstream_tls_sessions, 0, kMaxCount)},
                       {"worker_threads", set_count(l.worker_threads, 0, 256)}})},
             {"audit", section({{"path", set_string(c.audit.path)},
                                {"durable", set_bool(c.audit.durable)}})},
             {"log", section({{"level",
                               set_choice<std::string>(
                                   c.log_level, {"trace", "debug", "info", "warn", "error", "off"},
                                   {"trace", "debug", "info", "warn", "error", "off"})},
                              {"format", set_choice<std::string>(c.log_format, {"text", "json"},
                                                                 {"text", "json"})}})},
             {"runs",
              [this, &c](const YAML::Node& v, const std::string& p) { parse_runs(v, p, c); }}});
        check_listeners(c);
        check_written_files(c);
    }

    void parse_state(const YAML::Node& node, const std::string& path, Config& c) {
        bool endpoints_set = false;
        auto endpoints = [&](const YAML::Node& v, const std::string& p) {
            endpoints_set = true;
            c.etcd.endpoints =
                list_of<std::string>(v, p, [this](const YAML::Node& n, const std::string& np) {
                    auto s = string(n, np);
                    if (s && s->rfind("http://", 0) != 0 && s->rfind("https://", 0) != 0) {
                        error(np, "expected an http:// or https://host:port URL, got " +
                                      quote_value(*s));
                        s.reset();
                    }
                    return s;
                });
        };
        fields(
            node, path,
            {{"backend",
              set_choice<std::string>(c.state_backend, {"file", "etcd"}, {"file", "etcd"})},
             {"path", set_string(c.state_path)},
             {"etcd",
              section({{"endpoints", endpoints},
                       {"prefix", set_string(c.etcd.prefix)},
                       {"timeout",
                        [this, &c](const YAML::Node& v, const std::string& p) {
                            auto d = duration(v, p);
                            if (d && (*d < std::chrono::milliseconds(100) ||
                                      *d > std::chrono::minutes(10))) {
                                error(p, "must be between 100ms and 10m");
                            } else if (d) {
                                c.etcd.timeout = *d;
                            }
                        }},
                       {"lease_grace",
                        [this, &c](const YAML::Node& v, const std::string& p) {
                            auto d = duration(v, p);
                            if (d && (d->count() % 1000 != 0 || *d > std::chrono::hours(24))) {
                                error(p, "must be a whole number of seconds, at most 24h");
                            } else if (d) {
                                c.etcd.lease_grace =
                                    std::chrono::duration_cast<std::chrono::seconds>(*d);
                            }
                        }},
                       {"max_txn_ops", set_count(c.etcd.max_txn_ops, 1, 1'000'000)},
                       {"max_staleness",
                        [this, &c](const YAML::Node& v, const std::string& p) {
                            c.etcd.max_staleness.reset();
                            if (!v.IsNull()) {
                                c.etcd.max_staleness = duration(v, p);
                            }
                        }},
                       {"ca_file", set_string(c.etcd.ca_file)},
                       {"cert_file", set_optional_string(c.etcd.cert_file)},
                       {"key_file", set_optional_string(c.etcd.key_file)}})}});
        if (c.etcd.prefix.empty()) {
            error(join_path(path, "etcd.prefix"), "must not be empty");
        }
        // A replica in step with etcd confirms it about every second, at worst every
        // state.etcd.timeout + 1 s (while etcd's revision moves under other prefixes).
        if (const auto& m = c.etcd.max_staleness;
            m && (*m < std::max<std::chrono::milliseconds>(std::chrono::seconds(3),
                                                           2 * c.etcd.timeout) ||
                  *m > std::chrono::hours(24))) {
            error(join_path(path, "etcd.max_staleness"),
                  "must be null, or between 3s (and twice state.etcd.timeout) and 24h");
        }
        if (endpoints_set && c.state_backend == "etcd" && c.etcd.endpoints.empty()) {
            error(join_path(path, "etcd.endpoints"),
                  "must not be empty when state.backend is etcd");
        }
        if (c.etcd.ca_file.empty()) {
            error(join_path(path, "etcd.ca_file"),
                  "must not be empty (\"system\" for the system store)");
        }
        if (c.etcd.cert_file.has_value() != c.etcd.key_file.has_value()) {
            error(join_path(path, c.etcd.cert_file ? "etcd.key_file" : "etcd.cert_file"),
                  "must be set with " +
                      std::string(c.etcd.cert_file ? "etcd.cert_file" : "etcd.key_file") +
                      " (a client certificate needs both)");
        }
        if (c.state_backend == "etcd" && c.etcd.cert_file &&
            !has_https_endpoint(c.etcd.endpoints)) {
            error(join_path(path, "etcd.cert_file"),
                  "is set but no state.etcd.endpoints entry is https:// (a client certificate "
                  "is sent only over TLS)");
        }
    }

    void parse_overrides(const YAML::Node& node, const std::string& path,
                         std::map<std::string, std::vector<policy::IpAddress>>& out) {
        out.clear();
        if (node.IsNull()) {
            return;
        }
        if (!node.IsMap()) {
            error(path, "expected a mapping of host to addresses, got " + describe(node));
            return;
        }
        for (const auto& kv : node) {
            if (!kv.first.IsScalar()) {
                error(path, "keys must be host names, got " + describe(kv.first));
                continue;
            }
            std::string host_path = join_path(path, kv.first.Scalar());
            auto host = policy::normalize_host(kv.first.Scalar());
            if (!host) {
                error(host_path, host.error());
                continue;
            }
            auto addrs = list_of<policy::IpAddress>(
                kv.second, host_path, [this](const YAML::Node& n, const std::string& np) {
                    auto s = string(n, np);
                    std::optional<policy::IpAddress> ip;
                    if (s && !(ip = policy::IpAddress::parse(*s))) {
                        error(np, "bad IP address " + quote_value(*s));
                    }
                    return ip;
                });
            if (kv.second.IsSequence() && kv.second.size() == 0) {
                error(host_path, "must list at least one address");
            }
            if (!out.emplace(*host, std::move(addrs)).second) {
                error(host_path, "duplicate host " + quote_value(*host));
            }
        }
    }

    void parse_dns_servers(const YAML::Node& node, const std::string& path,
                           std::vector<std::string>& out) {
        out = list_of<std::string>(node, path, [this](const YAML::Node& n, const std::string& np) {
            auto s = string(n, np);
            if (s) {
                if (auto ok = check_dns_server(*s); !ok) {
                    error(np, ok.error());
                    s.reset();
                }
            }
            return s;
        });
    }

    std::optional<policy::InjectSpec> parse_inject(const YAML::Node& node,
                                                   const std::string& path) {
        using policy::InjectType;
        const size_t errors_before = errors.size();
        policy::InjectSpec spec;
        auto seen = fields(
            node, path,
            {{"type", set_choice(spec.type, {"bearer", "basic", "header", "aws-sigv4"},
                                 {InjectType::Bearer, InjectType::Basic, InjectType::Header,
                                  InjectType::AwsSigV4})},
             {"username", set_string(spec.username)},
             {"name", set_string(spec.header_name)},
             {"template", set_string(spec.value_template)},
             {"access_key_id", set_string(spec.access_key_id)},
             {"region", set_string(spec.region)},
             {"service", set_string(spec.service)}});
        if (node.IsNull()) {
            error(path, "expected a mapping such as {type: bearer}, got null");
        }
        if (errors.size() != errors_before) {
            return std::nullopt;
        }
        if (seen.count("type") == 0) {
            error(join_path(path, "type"), "required (bearer, basic, header or aws-sigv4)");
            return std::nullopt;
        }
        // Each type takes only its own options, so a typo cannot silently change meaning.
        auto only_for = [&](const char* key, InjectType type, const char* type_name) {
            if (seen.count(key) != 0 && spec.type != type) {
                error(join_path(path, key), std::string("only valid with type ") + type_name);
            }
        };
        only_for("username", InjectType::Basic, "basic");
        only_for("name", InjectType::Header, "header");
        only_for("template", InjectType::Header, "header");
        for (const char* key : {"access_key_id", "region", "service"}) {
            only_for(key, InjectType::AwsSigV4, "aws-sigv4");
        }
        // Without access_key_id the secret is a credentials document (policy/aws_sigv4.h).
        for (const char* key : {"region", "service"}) {
            if (spec.type == InjectType::AwsSigV4 && seen.count(key) == 0) {
                error(join_path(path, key), "required for type aws-sigv4");
            }
        }
        if (spec.type == InjectType::Basic && seen.count("username") == 0) {
            error(join_path(path, "username"), "required for type basic");
        }
        if (spec.type == InjectType::Header && seen.count("name") == 0) {
            error(join_path(path, "name"), "required for type header");
        }
        if (errors.size() != errors_before) {
            return std::nullopt;
        }
        auto valid = policy::validate_injection(std::move(spec));
        if (!valid) {
            // validate_injection names the field ("inject.name: ..."); anchor it at the pin.
            const std::string& msg = valid.error();
            if (msg.rfind("inject.", 0) == 0 || msg.rfind("inject:", 0) == 0) {
                errors.push_back(path.substr(0, path.size() - std::strlen("inject")) + msg);
            } else {
                error(path, msg);
            }
            return std::nullopt;
        }
        return std::move(*valid);
    }

    std::optional<std::string> path_prefix(const YAML::Node& node, const std::string& path) {
        auto s = string(node, path);
        if (!s) {
            return s;
        }
        if (auto why = policy::path_prefix_problem(*s)) {
            error(path, *why + ", got " + quote_value(*s));
            s.reset();
        }
        return s;
    }

    std::optional<std::string> method(const YAML::Node& node, const std::string& path) {
        auto s = string(node, path);
        if (s && !std::all_of(s->begin(), s->end(), is_tchar)) {
            error(path, "not an HTTP method token: " + quote_value(*s));
            s.reset();
        } else if (s) {
            std::transform(s->begin(), s->end(), s->begin(),
                           [](unsigned char c) { return static_cast<char>(std::toupper(c)); });
        }
        return s;
    }

    /// {org, project?, user?, workflow?}: a static run's identity in the store's scopes.
    std::optional<credstore::Scope> parse_scope(const YAML::Node& node, const std::string& path) {
        const size_t errors_before = errors.size();
        credstore::Scope scope;
        fields(node, path,
               {{"org", set_string(scope.org)},
                {"project", set_string(scope.project)},
                {"user", set_string(scope.user)},
                {"workflow", set_string(scope.workflow)}});
        if (!node.IsMap()) {
            if (node.IsNull()) {
                error(path, "expected a mapping such as {org: acme}, got null");
            }
            return std::nullopt;
        }
        if (errors.size() != errors_before) {
            return std::nullopt;
        }
        if (auto valid = scope.validate(); !valid) {
            // validate names the field as "scope.org: ..."; anchor it at this run.
            errors.push_back(path.substr(0, path.size() - std::strlen("scope")) + valid.error());
            return std::nullopt;
        }
        return scope;
    }

    std::optional<PinConfig> parse_pin(const YAML::Node& node, const std::string& path) {
        const size_t errors_before = errors.size();
        PinConfig pin;
        pin.yaml_path = path;
        std::optional<policy::InjectSpec> inject;
        auto seen = fields(node, path,
                           {{"host",
                             [&](const YAML::Node& v, const std::string& p) {
                                 if (auto h = host_pattern(v, p)) {
                                     pin.host = std::move(*h);
                                 }
                             }},
                            {"secret_file", set_string(pin.secret_file)},
                            {"secret",
                             [&](const YAML::Node& v, const std::string& p) {
                                 auto s = string(v, p);
                                 if (s && !credstore::valid_secret_name(*s)) {
                                     error(p, "bad secret name " + quote_value(*s) + " (expected " +
                                                  credstore::kSecretNameRule + ")");
                                 } else if (s) {
                                     pin.secret = std::move(*s);
                                 }
                             }},
                            {"inject", [&](const YAML::Node& v,
                                           const std::string& p) { inject = parse_inject(v, p); }},
                            {"path_prefixes",
                             [&](const YAML::Node& v, const std::string& p) {
                                 pin.path_prefixes = list_of<std::string>(
                                     v, p, [this](const YAML::Node& n, const std::string& np) {
                                         return path_prefix(n, np);
                                     });
                             }},
                            {"methods",
                             [&](const YAML::Node& v, const std::string& p) {
                                 pin.methods = list_of<std::string>(
                                     v, p, [this](const YAML::Node& n, const std::string& np) {
                                         return method(n, np);
                                     });
                             }},
                            {"headers", [&](const YAML::Node& v, const std::string& p) {
                                 pin.extra_headers = header_map(v, p);
                             }}});
        if (node.IsNull()) {
            error(path, "expected a mapping, got null");
        }
        if (!node.IsMap()) {
            return std::nullopt;
        }
        if (seen.count("host") == 0) {
            error(join_path(path, "host"), "required");
        }
        bool has_file = seen.count("secret_file") != 0;
        bool has_name = seen.count("secret") != 0;
        if (has_file && has_name) {
            error(path, "secret_file and secret are mutually exclusive; set exactly one");
        } else if (!has_file && !has_name) {
            error(path, "one of secret_file or secret is required");
        }
        if (seen.count("inject") == 0) {
            error(join_path(path, "inject"), "required (e.g. {type: bearer})");
        }
        if (errors.size() != errors_before || !inject) {
            return std::nullopt;
        }
        pin.inject = std::move(*inject);
        // The same rules as a pin made through the admin API (at most 20, no transport or
        // X-Egress-* header, not the injected one, no CR/LF/NUL).
        auto checked = policy::validate_extra_headers(pin.extra_headers, pin.inject);
        if (!checked) {
            errors.push_back(path + "." + checked.error());
            return std::nullopt;
        }
        pin.extra_headers = std::move(*checked);
        return pin;
    }

    /// A mapping of header name to value, in document order (checked by the caller).
    std::vector<policy::Header> header_map(const YAML::Node& node, const std::string& path) {
        std::vector<policy::Header> out;
        if (node.IsNull()) {
            return out;
        }
        if (!node.IsMap()) {
            error(path, "expected a mapping of header name to value, got " + describe(node));
            return out;
        }
        for (const auto& kv : node) {
            if (!kv.first.IsScalar()) {
                error(path, "keys must be header names, got " + describe(kv.first));
                continue;
            }
            const std::string name = kv.first.Scalar();
            if (auto value = string(kv.second, join_path(path, name))) {
                out.push_back({name, std::move(*value)});
            }
        }
        return out;
    }

    /// Returns the run and whether it is valid; an invalid run still carries its id and
    /// token_file so that the checks across runs can report on it.
    std::pair<RunConfig, bool> parse_run(const YAML::Node& node, const std::string& path) {
        const size_t errors_before = errors.size();
        RunConfig run;
        run.yaml_path = path;
        auto seen = fields(node, path,
                           {{"id",
                             [&](const YAML::Node& v, const std::string& p) {
                                 auto s = string(v, p, /*allow_empty=*/true);
                                 if (s && !valid_run_id(*s)) {
                                     error(p, "bad run id " + quote_value(*s) +
                                                  " (expected 1 to 64 of A-Z a-z 0-9 _ . -)");
                                 } else if (s) {
                                     run.id = std::move(*s);
                                 }
                             }},
                            {"token_file",
                             [&](const YAML::Node& v, const std::string& p) {
                                 // A bad value still counts as "has a token file", so the
                                 // only-static-run rule does not add a second, misleading error.
                                 run.token_file = v.IsNull()
                                                      ? std::nullopt
                                                      : std::optional(string(v, p).value_or(""));
                             }},
                            {"ttl",
                             [&](const YAML::Node& v, const std::string& p) {
                                 if (v.IsNull()) {
                                     run.ttl.reset();
                                 } else if (auto d = duration(v, p); d && d->count() % 1000 != 0) {
                                     error(p, "must be a whole number of seconds");
                                 } else if (d) {
                                     run.ttl = std::chrono::duration_cast<std::chrono::seconds>(*d);
                                 }
                             }},
                            {"ca_cert_out", set_string(run.ca_cert_out)},
                            {"ca_bundle_out", set_string(run.ca_bundle_out)},
                            {"sources", set_cidrs(run.sources)},
                            {"allow_hosts", set_patterns(run.allow_hosts)},
                            {"scope", [&](const YAML::Node& v,
                                          const std::string& p) { run.scope = parse_scope(v, p); }},
                            {"pins", [&](const YAML::Node& v, const std::string& p) {
                                 run.pins = list_of<PinConfig>(
                                     v, p, [this](const YAML::Node& n, const std::string& np) {
                                         return parse_pin(n, np);
                                     });
                             }}});
        if (node.IsNull()) {
            error(path, "expected a mapping, got null");
        }
        if (node.IsMap() && seen.count("id") == 0) {
            error(join_path(path, "id"), "required");
        }
        if (seen.count("ca_cert_out") == 0) {
            run.ca_cert_out = "var/run-" + run.id + "-ca.pem";
        }
        std::error_code ec_a;
        std::error_code ec_b;
        if (!run.ca_bundle_out.empty() && !run.ca_cert_out.empty() &&
            std::filesystem::absolute(run.ca_bundle_out, ec_a).lexically_normal() ==
                std::filesystem::absolute(run.ca_cert_out, ec_b).lexically_normal()) {
            // NODE_EXTRA_CA_CERTS (the CA file) would name every system root as the run's CA.
            error(join_path(path, "ca_bundle_out"),
                  "names the same file as ca_cert_out: give two files");
        }
        if (seen.count("scope") == 0) {
            // A store secret is found by the run's scope: without one it could never resolve.
            for (const auto& pin : run.pins) {
                if (!pin.secret.empty()) {
                    error(join_path(path, "scope"),
                          "required by " + pin.yaml_path +
                              ".secret (a store secret is found by the run's scope, e.g. "
                              "{org: acme, project: web})");
                    break;
                }
            }
        }
        return {std::move(run), errors.size() == errors_before};
    }

    void parse_runs(const YAML::Node& node, const std::string& path, Config& c) {
        std::map<std::string, std::string> first_path;  // id → path of its first run
        std::vector<std::string> anonymous;             // paths of runs with token_file null
        size_t count = 0;
        list(node, path, [&](const YAML::Node& item, const std::string& p) {
            ++count;
            auto [run, ok] = parse_run(item, p);
            if (!item.IsMap()) {
                return;
            }
            if (!run.token_file) {
                anonymous.push_back(p);
            }
            if (!run.id.empty()) {
                auto [it, inserted] = first_path.emplace(run.id, p);
                if (!inserted) {
                    error(join_path(p, "id"),
                          "duplicate run id " + quote_value(run.id) + " (first at " + it->second + ")");
                    ok = false;
                }
            }
            if (ok) {
                c.runs.push_back(std::move(run));
            }
        });
        if (count > 1) {
            for (const auto& p : anonymous) {
                error(join_path(p, "token_file"),
                      "null (requests without proxy credentials belong to this run) is allowed "
                      "only when it is the only static run; set a token_file");
            }
        }
    }

    void check_written_files(const Config& c) {
        for_each_written_file_clash(
            c, [this](const std::string& key, const std::string& msg) { error(key, msg); });
    }

    /// Two listeners on one TCP address would fail at bind time with a less helpful message.
    void check_listeners(const Config& c) {
        auto same = [](const ListenAddress& a, const ListenAddress& b) {
            return !a.is_unix() && !b.is_unix() && a.port != 0 && a.port == b.port &&
                   a.host == b.host;
        };
        if (same(c.proxy, c.admin)) {
            error("listen.admin", "same address as listen.proxy (" + c.proxy.to_string() + ")");
        }
        if (c.transparent && same(c.proxy, *c.transparent)) {
            error("listen.transparent",
                  "same address as listen.proxy (" + c.proxy.to_string() + ")");
        }
        if (c.transparent && same(c.admin, *c.transparent)) {
            error("listen.transparent",
                  "same address as listen.admin (" + c.admin.to_string() + ")");
        }
    }
};

/// Follows parse events without building nodes: counts documents, and notes where the first
/// anchor (&name) or alias (*name) is.
class ScanEvents final : public YAML::EventHandler {
public:
    std::optional<YAML::Mark> anchor_or_alias;

    void OnDocumentStart(const YAML::Mark&) override {}
    void OnDocumentEnd() override {}
    void OnNull(const YAML::Mark& m, YAML::anchor_t a) override { anchored(m, a); }
    void OnAlias(const YAML::Mark& m, YAML::anchor_t) override { note(m); }
    void OnScalar(const YAML::Mark& m, const std::string&, YAML::anchor_t a,
                  const std::string&) override {
        anchored(m, a);
    }
    void OnSequenceStart(const YAML::Mark& m, const std::string&, YAML::anchor_t a,
                         YAML::EmitterStyle::value) override {
        anchored(m, a);
    }
    void OnSequenceEnd() override {}
    void OnMapStart(const YAML::Mark& m, const std::string&, YAML::anchor_t a,
                    YAML::EmitterStyle::value) override {
        anchored(m, a);
    }
    void OnMapEnd() override {}

private:
    void anchored(const YAML::Mark& m, YAML::anchor_t a) {
        if (a != YAML::NullAnchor) {
            note(m);
        }
    }
    void note(const YAML::Mark& m) {
        if (!anchor_or_alias) {
            anchor_or_alias = m;
        }
    }
};

struct Scan {
    size_t documents = 0;                      // counted no further than the `max` asked
    std::optional<YAML::Mark> anchor_or_alias;  // the first one, in the documents counted
};

/// Documents in `text` (counting no further than `max`) and the first anchor or alias.
Scan scan_documents(const std::string& text, size_t max) {
    std::istringstream in(text);
    YAML::Parser parser(in);
    ScanEvents events;
    Scan out;
    while (out.documents < max && parser.HandleNextDocument(events)) {
        ++out.documents;
    }
    out.anchor_or_alias = events.anchor_or_alias;
    return out;
}

/// One problem per line. Values and keys echoed from the file may hold newlines, NUL or
/// terminal escapes: they are written as \xNN so no message spans lines or drives a terminal
/// (found by fuzz_config, tests/fuzz/regressions/config).
std::string join_errors(const std::vector<std::string>& errors) {
    std::string out;
    for (const auto& e : errors) {
        if (!out.empty()) {
            out += '\n';
        }
        for (char ch : e) {
            const auto c = static_cast<unsigned char>(ch);
            if ((c < 0x20 && c != '\t') || c == 0x7f) {
                char esc[8];
                std::snprintf(esc, sizeof esc, "\\x%02x", c);
                out += esc;
            } else {
                out.push_back(ch);
            }
        }
    }
    return out;
}

}  // namespace

std::string ListenAddress::to_string() const {
    if (is_unix()) {
        return "unix:" + unix_path;
    }
    if (host.find(':') != std::string::npos) {
        return "[" + host + "]:" + std::to_string(port);
    }
    return host + ":" + std::to_string(port);
}

std::string proxy_authority(const std::optional<std::string>& advertise,
                            const std::string& host, uint16_t port) {
    if (advertise) {
        return *advertise;
    }
    ListenAddress a{host, port, {}};
    if (a.host == "0.0.0.0") {
        a.host = "127.0.0.1";
    } else if (a.host == "::") {
        a.host = "::1";
    }
    return a.to_string();
}

Result<std::chrono::milliseconds> parse_duration(const std::string& text) {
    auto bad = [&] {
        return make_error("bad duration " + quote_value(text) + " " + std::string(kDurationHint));
    };
    size_t digits = 0;
    while (digits < text.size() && std::isdigit(static_cast<unsigned char>(text[digits]))) {
        ++digits;
    }
    // At most 9 digits: 999999999h still fits milliseconds in int64.
    auto value = parse_digits(std::string_view(text).substr(0, digits), 9);
    if (!value) {
        return bad();
    }
    std::string_view unit = std::string_view(text).substr(digits);
    int64_t ms_per_unit = 0;
    if (unit.empty() || unit == "s") {
        ms_per_unit = 1000;
    } else if (unit == "ms") {
        ms_per_unit = 1;
    } else if (unit == "m") {
        ms_per_unit = 60 * 1000;
    } else if (unit == "h") {
        ms_per_unit = 60 * 60 * 1000;
    } else {
        return bad();
    }
    // At most ten years: a deadline is now() + d in steady_clock's int64 nanoseconds, which a
    // duration over ~292 years wraps negative (a timeout that fires at once). A user who
    // writes a huge value means "never", and ten years is that for a proxy's timeouts.
    constexpr int64_t kMaxMs = int64_t{87'600} * 60 * 60 * 1000;
    const int64_t ms = static_cast<int64_t>(*value) * ms_per_unit;
    if (ms > kMaxMs) {
        return make_error("duration " + quote_value(text) + " is over the longest allowed, 87600h");
    }
    return std::chrono::milliseconds(ms);
}

std::vector<std::string> written_file_clashes(const Config& c) {
    std::vector<std::string> out;
    for_each_written_file_clash(c, [&](const std::string& key, const std::string& msg) {
        out.push_back(key + ": " + msg);
    });
    return out;
}

Result<Config> parse_config(const std::string& yaml_text, const std::string& source_name) {
    const std::string source = source_name.empty() ? "config" : source_name;
    std::vector<YAML::Node> docs;
    try {
        // Not YAML::LoadAll: on some inputs ("," at the top) yaml-cpp 0.7 reports empty
        // documents forever (jbeder/yaml-cpp#1040) and LoadAll never returns, taking
        // `--check` or a reload down (found by fuzz_config). Counting at most two documents
        // with a bounded event parse is enough to refuse a multi-document file.
        const Scan scan = scan_documents(yaml_text, 2);
        const size_t n = scan.documents;
        if (n > 1) {
            return make_error(source + ": expected one YAML document, found more than one");
        }
        if (scan.anchor_or_alias) {
            // Each alias is walked again wherever it is used: nested ones multiply (a 7 KB
            // file took 31 s to validate, and a reload holds the admin API meanwhile). A
            // config is small enough to write out.
            const YAML::Mark& m = *scan.anchor_or_alias;
            return make_error(source + ": line " + std::to_string(m.line + 1) +
                              ": YAML anchors and aliases (&name, *name) are not supported; "
                              "write the value out (column " +
                              std::to_string(m.column + 1) + ")");
        }
        if (n == 1) {
            docs.push_back(YAML::Load(yaml_text));
        }
    } catch (const YAML::Exception& e) {
        std::string what = e.msg.empty() ? std::string(e.what()) : e.msg;
        if (e.mark.is_null()) {
            return make_error(join_errors({source + ": " + what}));
        }
        return make_error(join_errors({source + ": line " + std::to_string(e.mark.line + 1) +
                                       ": " + what + " (column " +
                                       std::to_string(e.mark.column + 1) + ")"}));
    } catch (const std::exception& e) {
        return make_error(join_errors({source + ": " + e.what()}));
    }
    if (docs.size() > 1) {
        return make_error(source + ": expected one YAML document, found " +
                          std::to_string(docs.size()));
    }
    if (docs.empty() || docs.front().IsNull()) {
        // No document, or one with nothing in it: what a SIGHUP reads while an editor has
        // truncated the file and not yet written it again. As all the defaults it dropped
        // every static run (clients got 407, and the next reload made them new CAs); an
        // empty mapping, {}, still asks for all the defaults.
        return make_error(source + ": config is empty (write {} for all the defaults)");
    }
    Config config;
    config.source = source_name;
    Parser parser;
    parser.source = source;
    try {
        if (!docs.front().IsMap()) {
            parser.error(source,
                         "expected a mapping of sections (listen, policy, runs, ...) at the "
                         "top level, got " +
                             describe(docs.front()));
        } else {
            parser.parse_root(docs.front(), config);
        }
    } catch (const std::exception& e) {
        // yaml-cpp conversions are guarded above; this is a last line of defence so that a bad
        // file can never take the process down from inside the parser.
        parser.errors.push_back(source + ": " + e.what());
    }
    if (!parser.errors.empty()) {
        return make_error(join_errors(parser.errors));
    }
    return config;
}

Result<Config> load_config_file(const std::string& path) {
    auto opened = egress::open_regular_file(path);
    if (!opened) {
        return make_error(path + ": cannot read: " + opened.error());
    }
    const int fd = *opened;
    std::string text;
    char buf[16384];
    for (;;) {
        ssize_t n = ::read(fd, buf, sizeof buf);
        if (n < 0) {
            if (errno == EINTR) {
                continue;
            }
            int err = errno;
            ::close(fd);
            return make_error(path + ": cannot read: " + std::strerror(err));
        }
        if (n == 0) {
            break;
        }
        text.append(buf, static_cast<size_t>(n));
        if (text.size() > kMaxConfigBytes) {
            ::close(fd);
            return make_error(path + ": cannot read: file larger than 16 MiB");
        }
    }
    ::close(fd);
    return parse_config(text, path);
}

}  // namespace egress::proxy
