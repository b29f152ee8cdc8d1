#pragma once
// egress-bench command line: parsed once into an immutable BenchOptions (STYLE.md 15). Pure: no
// I/O, errors are returned as messages, never printed or exited on here.

#include <chrono>
#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace egress::bench {

using Duration = std::chrono::nanoseconds;

/// Where requests go. `authority` is what Host / CONNECT carry (port omitted when default).
struct TargetUrl {
  bool tls = true;                // https
  std::string host;               // without IPv6 brackets
  std::uint16_t port = 0;         // explicit or the scheme default
  std::string authority;          // Host header value
  std::string connect_authority;  // host:port, always with the port (CONNECT target)
  std::string origin_form;        // path?query, at least "/"
  std::string absolute_form;      // scheme://authority/path?query
};

struct ProxyUrl {
  std::string host;
  std::uint16_t port = 0;
  std::string authorization;  // "Basic b64(user:pass)" or empty
  std::string display;        // the URL with the password redacted
};

enum class Protocol { kHttp1, kHttp2 };

struct BenchOptions {
  std::string url;  // as given
  TargetUrl target;
  std::optional<ProxyUrl> proxy;
  std::string cacert;
  bool insecure = false;
  Protocol protocol = Protocol::kHttp1;
  int connections = 1;
  int streams = 1;  // --h2: concurrent streams per connection
  int threads = 1;
  std::optional<Duration> duration;       // default 10 s when neither bound is given
  std::optional<std::uint64_t> requests;  // counted requests, exact
  Duration warmup{0};
  bool new_connection = false;
  std::optional<double> rate;  // open loop, requests/s over all connections
  std::vector<std::pair<std::string, std::string>> headers;
  std::string method = "GET";
  std::uint64_t body_size = 0;
  Duration timeout = std::chrono::seconds(10);
  bool tls_resume = true;
  bool json = false;
};

struct ParseResult {
  BenchOptions options;
  std::string error;  // non-empty: usage error
  bool help = false;
};

/// Parses arguments (without argv[0]). Later options override earlier ones, so a base set of
/// arguments can be followed by per-run arguments (--compare).
ParseResult parse_options(const std::vector<std::string>& args);

/// "10s", "250ms", "100us", "2m", "1.5s", "3" (seconds). nullopt when malformed or negative.
std::optional<Duration> parse_duration(std::string_view text);

/// Shell-like word splitting for --compare arguments: whitespace separates words, single and
/// double quotes group, backslash escapes outside single quotes. nullopt on an unclosed quote.
std::optional<std::vector<std::string>> split_words(std::string_view text);

/// Usage text for --help and usage errors.
const char* usage_text();

}  // namespace egress::bench
