// Fuzz target: the config loader (proxy/config.h parse_config) on YAML text. It does no I/O.
//
// Invariants checked beyond "no sanitizer report / no escaped exception":
//   * a refused config returns every problem as "path: problem" lines, never an empty error;
//   * an accepted config holds only validated values: each pin names exactly one secret
//     source, its injection passes validate_injection unchanged, its host pattern and every
//     allow_hosts pattern round-trip, methods are uppercase, ports are non-zero, and the
//     run ids are unique;
//   * the accepted global policy and runs can be evaluated (decide_destination) as loaded.
#include <cstdint>
#include <set>
#include <string>

#include "fuzz_common.h"
#include "proxy/config.h"

namespace {

using namespace egress;

void check_pattern(const policy::HostPattern& p) {
    auto again = policy::HostPattern::parse(p.text());
    FUZZ_CHECK(again && again->text() == p.text(), "pattern does not round-trip: " + p.text());
}

void check_config(const proxy::Config& c) {
    for (uint16_t port : c.policy.allowed_ports) {
        FUZZ_CHECK(port != 0, "allowed port 0");
    }
    for (const auto& p : c.policy.allow_hosts) {
        check_pattern(p);
    }
    for (const auto& n : c.allow_networks) {
        auto back = policy::Cidr::parse(n.to_string());
        FUZZ_CHECK(back && back->prefix == n.prefix, "allow_networks entry: " + n.to_string());
    }
    std::set<std::string> ids;
    const auto now = policy::Clock::now();
    const policy::HostPort probe{"api.github.com", 443};
    for (const auto& run : c.runs) {
        FUZZ_CHECK(!run.id.empty(), "run without an id at " + run.yaml_path);
        FUZZ_CHECK(ids.insert(run.id).second, "duplicate run id " + run.id);
        policy::RunPolicy rp;
        rp.id = run.id;
        rp.allow_hosts = run.allow_hosts;
        for (const auto& p : run.allow_hosts) {
            check_pattern(p);
        }
        for (const auto& pin : run.pins) {
            FUZZ_CHECK(pin.secret_file.empty() != pin.secret.empty(),
                       "pin needs exactly one secret source: " + pin.yaml_path);
            check_pattern(pin.host);
            auto v = policy::validate_injection(pin.inject);
            FUZZ_CHECK(v.ok(), "accepted injection fails validation at " + pin.yaml_path);
            FUZZ_CHECK(v->header_name == pin.inject.header_name,
                       "injection header name not normalized at " + pin.yaml_path);
            for (const auto& m : pin.methods) {
                FUZZ_CHECK(m.find_first_of("abcdefghijklmnopqrstuvwxyz") == std::string::npos,
                           "method not uppercase at " + pin.yaml_path);
            }
            policy::Pin p;
            p.id = pin.yaml_path;
            p.host = pin.host;
            p.path_prefixes = pin.path_prefixes;
            p.methods = pin.methods;
            p.inject = pin.inject;
            rp.pins.push_back(std::move(p));
        }
        policy::index_pins(rp);
        auto d = policy::decide_destination(c.policy, rp, probe, now);
        FUZZ_CHECK(d.carry != policy::Carry::Deny || !d.reason.empty(), "deny without reason");
    }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
    const std::string text(reinterpret_cast<const char*>(data), size);
    auto cfg = proxy::parse_config(text, "fuzz.yaml");
    if (!cfg) {
        const std::string& err = cfg.error();
        FUZZ_CHECK(!err.empty(), "empty error for a refused config");
        // config.h: problems "joined by '\n', each 'path: problem'". An echoed value must
        // not break a line (nor carry terminal control bytes to `egressd --check`).
        size_t start = 0;
        while (start <= err.size()) {
            size_t end = err.find('\n', start);
            if (end == std::string::npos) {
                end = err.size();
            }
            const std::string line = err.substr(start, end - start);
            bool clean = line.find(": ") != std::string::npos;
            for (char ch : line) {
                const auto c = static_cast<unsigned char>(ch);
                clean = clean && (c >= 0x20 || c == '\t') && c != 0x7f;
            }
            FUZZ_CHECK(clean, "error line is not 'path: problem': [" + err + "]");
            start = end + 1;
        }
        return 0;
    }
    check_config(*cfg);
    return 0;
}
