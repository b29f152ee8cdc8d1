#pragma once
// The scrubber's definition, byte by byte with no skipping, for the unit tests
// (tests/policy/scrubber_test.cc) and the differential fuzz target (tests/fuzz/fuzz_scrubber.cc)
// to compare Scrubber against: at each position the longest needle that starts there extends
// the covered run; a run starts its replacement text over when it begins after uncovered bytes
// (or right where the previous run ended). Empty needles are ignored.
#include <algorithm>
#include <string>
#include <string_view>
#include <vector>

namespace egress::policy::testing {

inline std::string scrub_definition(std::vector<std::string> needles, std::string_view body) {
    std::erase_if(needles, [](const std::string& n) { return n.empty(); });
    std::stable_sort(needles.begin(), needles.end(),
                     [](const auto& a, const auto& b) { return a.size() > b.size(); });
    constexpr std::string_view kRedacted = "[REDACTED]";
    std::string out(body);
    size_t covered_left = 0;
    size_t run_pos = 0;
    for (size_t i = 0; i < body.size(); ++i) {
        for (const std::string& n : needles) {
            if (body.substr(i, n.size()) == n) {
                if (covered_left == 0) {
                    run_pos = 0;
                }
                covered_left = std::max(covered_left, n.size());
                break;
            }
        }
        if (covered_left > 0) {
            out[i] = run_pos < kRedacted.size() ? kRedacted[run_pos] : '*';
            ++run_pos;
            --covered_left;
        }
    }
    return out;
}

}  // namespace egress::policy::testing
