// Fuzz target: the body `_method` check of a POST to a pin limited to methods
// (policy/body_method.cc): every reading of Content-Type fields, form keys, multipart part
// headers under each boundary, and JSON. The body comes from the sandbox, and the parts are
// found with index arithmetic on it.
//
// Input: up to three Content-Type lines, a line holding a single NUL, then the body
// ("CT\nCT\n\x00\nBODY"; without a NUL line, the first line is the one Content-Type and the
// rest the body).
// Invariants checked beyond "no sanitizer report":
//   * the check is monotonic in the methods a pin allows: a body allowed for a pin limited to
//     GET and POST is allowed for one that also allows PUT, PATCH and DELETE (every refusal is
//     a method the pin does not allow, or a body refused whatever the pin allows);
//   * body_may_override_method says yes for every head whose body the check can refuse under
//     some pin (a body it would not read must never be refused: it is never read);
//   * the same head and body give the same answer twice.
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "fuzz_common.h"
#include "policy/request_head.h"
#include "policy/run_policy.h"

using namespace egress;

namespace {

policy::Pin pin_allowing(std::vector<std::string> methods) {
    policy::Pin p;
    p.id = "p";
    auto host = policy::HostPattern::parse("api.test");
    FUZZ_CHECK(host.ok(), "pattern");
    p.host = *host;
    p.methods = std::move(methods);
    return p;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
    if (size > 16384) {
        return 0;
    }
    const std::string_view in(reinterpret_cast<const char*>(data), size);
    policy::RequestHead head;
    head.method = "POST";
    const size_t end = in.find(std::string_view("\n\0\n", 3));
    std::string_view types = end == std::string_view::npos ? in.substr(0, in.find('\n'))
                                                           : in.substr(0, end);
    const std::string_view body =
        end == std::string_view::npos
            ? (types.size() < in.size() ? in.substr(types.size() + 1) : std::string_view())
            : in.substr(end + 3);
    while (head.headers.size() < 3) {
        const size_t nl = types.find('\n');
        head.headers.push_back({"content-type", std::string(types.substr(0, nl))});
        if (nl == std::string_view::npos) {
            break;
        }
        types = types.substr(nl + 1);
    }
    if (size % 7 == 0) {
        head.headers.clear();  // no Content-Type: a form to Rack
    }
    static const policy::Pin narrow = pin_allowing({"GET", "POST"});
    static const policy::Pin wide = pin_allowing({"GET", "POST", "PUT", "PATCH", "DELETE"});
    const bool narrow_ok = policy::body_method_matches(narrow, head, body);
    const bool wide_ok = policy::body_method_matches(wide, head, body);
    FUZZ_CHECK(!narrow_ok || wide_ok, "allowed for GET/POST but refused with more methods");
    FUZZ_CHECK(policy::body_method_matches(narrow, head, body) == narrow_ok, "not deterministic");
    if (!narrow_ok) {
        FUZZ_CHECK(policy::body_may_override_method(narrow, head),
                   "refused a body the proxy would not read");
    }
    return 0;
}
