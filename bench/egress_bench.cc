// egress-bench: HTTP load through (or around) a forward proxy. See bench/README.md.

#include <charconv>
#include <cstdio>
#include <iostream>
#include <string>
#include <vector>

#include "bench/options.h"
#include "bench/report.h"
#include "bench/runner.h"

namespace egress::bench {
namespace {

constexpr int kExitOk = 0;
constexpr int kExitFailed = 1;
constexpr int kExitUsage = 2;

int usage_error(const std::string& message) {
  std::cerr << "egress-bench: " << message << "\n(see egress-bench --help)\n";
  return kExitUsage;
}

/// Parses and checks what this build supports. nullopt after printing why (exit code in `code`).
std::optional<BenchOptions> parse_supported(const std::vector<std::string>& args, int& code) {
  ParseResult parsed = parse_options(args);
  if (parsed.help) {
    std::cout << usage_text();
    code = kExitOk;
    return std::nullopt;
  }
  if (!parsed.error.empty()) {
    code = usage_error(parsed.error);
    return std::nullopt;
  }
  return std::move(parsed.options);
}

int run_single(const std::vector<std::string>& args) {
  int code = kExitOk;
  auto options = parse_supported(args, code);
  if (!options) {
    return code;
  }
  const RunResult result = run_benchmark(*options);
  if (options->json) {
    print_json(std::cout, *options, result);
  } else {
    print_text(std::cout, *options, result);
  }
  if (!result.fatal_error.empty()) {
    std::cerr << "egress-bench: " << result.fatal_error << "\n";
    return kExitFailed;
  }
  return result.stats.ok > 0 ? kExitOk : kExitFailed;
}

int run_compare(const std::vector<std::string>& base, const std::string& a_args,
                const std::string& b_args, int pairs, bool json) {
  CompareSide sides[2] = {{"A", a_args, {}, {}}, {"B", b_args, {}, {}}};
  for (auto& side : sides) {
    auto words = split_words(side.args);
    if (!words) {
      return usage_error("--compare " + side.label + ": unbalanced quotes");
    }
    std::vector<std::string> args = base;
    args.insert(args.end(), words->begin(), words->end());
    int code = kExitOk;
    auto options = parse_supported(args, code);
    if (!options) {
      return code;
    }
    side.options = std::move(*options);
    json = json || side.options.json;  // --json in a side's words is for the whole report
  }
  // Both sides must be able to start (resolution, --cacert) before A's first run: a B that
  // cannot is found now, not after A ran.
  for (const auto& side : sides) {
    const std::string error = check_setup(side.options);
    if (!error.empty()) {
      std::cerr << "egress-bench: --compare " << side.label << ": " << error << "\n";
      return kExitFailed;
    }
  }
  // Ctrl-C ends the comparison: the run it cut is partial and left out, and so is the A run
  // of a pair whose B never ran; the report covers the complete pairs. A run that cannot start
  // (or whose driver failed) ends it the same way, with exit status 1.
  bool interrupted = false;
  bool failed = false;
  for (int pair = 1; pair <= pairs && !interrupted && !failed; ++pair) {
    for (auto& side : sides) {
      RunResult r = run_benchmark(side.options);
      if (r.interrupted) {
        interrupted = true;
        std::fprintf(stderr, "egress-bench: pair %d %s: interrupted, left out\n", pair,
                     side.label.c_str());
        break;
      }
      if (!r.fatal_error.empty()) {
        failed = true;
        std::fprintf(stderr, "egress-bench: pair %d %s: %s; stopped, left out\n", pair,
                     side.label.c_str(), r.fatal_error.c_str());
        break;
      }
      std::string not_sent;
      if (r.not_sent > 0) {
        not_sent = ", " + std::to_string(r.not_sent) + " not sent";
      }
      std::fprintf(stderr, "egress-bench: pair %d %s: %.1f req/s, %llu errors%s\n", pair,
                   side.label.c_str(), r.rps(), static_cast<unsigned long long>(r.stats.failed),
                   not_sent.c_str());
      side.runs.push_back(std::move(r));
    }
    if (sides[0].runs.size() > sides[1].runs.size()) {
      sides[0].runs.pop_back();
    }
  }
  if (json) {
    print_compare_json(std::cout, sides[0], sides[1]);
  } else {
    print_compare_text(std::cout, sides[0], sides[1]);
  }
  if (failed) {
    return kExitFailed;
  }
  for (const auto& side : sides) {
    for (const auto& r : side.runs) {
      if (r.stats.ok == 0) {
        return kExitFailed;
      }
    }
  }
  return interrupted && sides[0].runs.empty() ? kExitFailed : kExitOk;
}

int main_impl(int argc, char** argv) {
  std::vector<std::string> args(argv + 1, argv + argc);
  // --compare 'A' 'B' and --pairs K are taken out; what remains is common to both sides.
  std::vector<std::string> base;
  std::optional<std::pair<std::string, std::string>> compare;
  int pairs = 3;
  bool json = false;
  bool pairs_set = false;
  for (std::size_t i = 0; i < args.size(); ++i) {
    if (args[i] == "--compare") {
      if (i + 2 >= args.size()) {
        return usage_error("--compare needs two arguments: 'ARGS A' 'ARGS B'");
      }
      compare.emplace(args[i + 1], args[i + 2]);
      i += 2;
    } else if (args[i] == "--pairs") {
      if (i + 1 >= args.size()) {
        return usage_error("--pairs needs a value");
      }
      const std::string& v = args[++i];
      auto [p, ec] = std::from_chars(v.data(), v.data() + v.size(), pairs);
      if (ec != std::errc() || p != v.data() + v.size() || pairs < 1 || pairs > 1000) {
        return usage_error("--pairs must be an integer in 1..1000");
      }
      pairs_set = true;
    } else {
      json = json || args[i] == "--json";
      base.push_back(args[i]);
    }
  }
  if (!compare) {
    if (pairs_set) {
      return usage_error("--pairs goes with --compare");
    }
    return run_single(base);
  }
  return run_compare(base, compare->first, compare->second, pairs, json);
}

}  // namespace
}  // namespace egress::bench

int main(int argc, char** argv) {
  try {
    return egress::bench::main_impl(argc, argv);
  } catch (const std::exception& e) {
    std::cerr << "egress-bench: " << e.what() << "\n";
    return 1;
  }
}
