#include "bench/options.h"

#include "common/base64.h"

#include <algorithm>
#include <boost/url/parse.hpp>
#include <boost/url/url_view.hpp>
#include <cctype>
#include <charconv>
#include <cmath>
#include <limits>

namespace egress::bench {
namespace {

std::string lower(std::string_view s) {
  std::string out(s);
  std::transform(out.begin(), out.end(), out.begin(),
                 [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
  return out;
}

template <class Int>
std::optional<Int> parse_uint(std::string_view s) {
  Int v{};
  auto [p, ec] = std::from_chars(s.data(), s.data() + s.size(), v);
  if (ec != std::errc() || p != s.data() + s.size() || s.empty()) {
    return std::nullopt;
  }
  return v;
}

std::optional<double> parse_double(std::string_view s) {
  if (s.empty()) {
    return std::nullopt;
  }
  std::string copy(s);
  char* end = nullptr;
  const double v = std::strtod(copy.c_str(), &end);
  if (end != copy.c_str() + copy.size() || !std::isfinite(v)) {
    return std::nullopt;
  }
  return v;
}

bool is_token_char(char c) {
  return std::isalnum(static_cast<unsigned char>(c)) ||
         std::string_view("!#$%&'*+-.^_`|~").find(c) != std::string_view::npos;
}

/// Parses the target URL; returns an error message or empty.
std::string parse_target(std::string_view text, TargetUrl& out) {
  auto r = boost::urls::parse_uri(text);
  if (!r) {
    return "invalid target URL '" + std::string(text) + "'";
  }
  const boost::urls::url_view u = *r;
  const std::string scheme = lower(u.scheme());
  if (scheme != "https" && scheme != "http") {
    return "target URL must be https:// or http://";
  }
  if (u.has_userinfo()) {
    return "credentials in the target URL are not supported (use -H)";
  }
  out.tls = scheme == "https";
  out.host = u.host_address();
  if (out.host.empty()) {
    return "target URL has no host";
  }
  const std::uint16_t default_port = out.tls ? 443 : 80;
  out.port = u.has_port() ? u.port_number() : default_port;
  if (u.has_port() && out.port == 0) {
    return "invalid port in target URL";
  }
  const std::string host_in_url(u.encoded_host());  // brackets kept for IPv6
  out.connect_authority = host_in_url + ":" + std::to_string(out.port);
  out.authority = out.port == default_port ? host_in_url : out.connect_authority;
  out.origin_form = std::string(u.encoded_target());
  if (out.origin_form.empty() || out.origin_form.front() != '/') {
    out.origin_form.insert(0, "/");
  }
  out.absolute_form = scheme + "://" + out.authority + out.origin_form;
  return {};
}

std::string parse_proxy(std::string_view text, ProxyUrl& out) {
  auto r = boost::urls::parse_uri(text);
  if (!r) {
    return "invalid proxy URL '" + std::string(text) + "'";
  }
  const boost::urls::url_view u = *r;
  if (lower(u.scheme()) != "http") {
    return "proxy URL must be http://[user:pass@]host:port";
  }
  out.host = u.host_address();
  if (out.host.empty()) {
    return "proxy URL has no host";
  }
  out.port = u.has_port() ? u.port_number() : 80;
  if (out.port == 0) {
    return "invalid port in proxy URL";
  }
  out.display = "http://";
  if (u.has_userinfo()) {
    const std::string credentials = u.user() + ":" + u.password();
    out.authorization = "Basic " + egress::base64_encode(credentials);
    // The user as written (percent-encoded): decoded, it may be any bytes, and the display
    // goes into the JSON report, which must stay valid UTF-8.
    out.display += std::string(u.encoded_user()) + (u.has_password() ? ":***@" : "@");
  }
  out.display += std::string(u.encoded_host()) + ":" + std::to_string(out.port);
  return {};
}

std::string parse_header(std::string_view text, std::pair<std::string, std::string>& out) {
  const auto colon = text.find(':');
  if (colon == std::string_view::npos || colon == 0) {
    return "header must be 'Name: value': '" + std::string(text) + "'";
  }
  std::string_view name = text.substr(0, colon);
  std::string_view value = text.substr(colon + 1);
  if (!std::all_of(name.begin(), name.end(), is_token_char)) {
    return "invalid header name '" + std::string(name) + "'";
  }
  while (!value.empty() && (value.front() == ' ' || value.front() == '\t')) {
    value.remove_prefix(1);
  }
  while (!value.empty() && (value.back() == ' ' || value.back() == '\t')) {
    value.remove_suffix(1);
  }
  if (value.find_first_of("\r\n") != std::string_view::npos) {
    return "header value may not contain CR or LF";
  }
  out = {std::string(name), std::string(value)};
  return {};
}

}  // namespace

std::optional<Duration> parse_duration(std::string_view text) {
  std::size_t unit_at = text.size();
  while (unit_at > 0 && std::isalpha(static_cast<unsigned char>(text[unit_at - 1]))) {
    --unit_at;
  }
  const std::string_view unit = text.substr(unit_at);
  const auto number = parse_double(text.substr(0, unit_at));
  if (!number || *number < 0) {
    return std::nullopt;
  }
  double scale = 0;  // nanoseconds per unit
  if (unit.empty() || unit == "s") {
    scale = 1e9;
  } else if (unit == "ms") {
    scale = 1e6;
  } else if (unit == "us") {
    scale = 1e3;
  } else if (unit == "m") {
    scale = 60e9;
  } else if (unit == "h") {
    scale = 3600e9;
  } else {
    return std::nullopt;
  }
  const double ns = *number * scale;
  if (ns > 1e18) {
    return std::nullopt;
  }
  return Duration(static_cast<std::int64_t>(std::llround(ns)));
}

std::optional<std::vector<std::string>> split_words(std::string_view text) {
  std::vector<std::string> words;
  std::string word;
  bool in_word = false;
  for (std::size_t i = 0; i < text.size(); ++i) {
    const char c = text[i];
    if (c == '\'') {
      const auto end = text.find('\'', i + 1);
      if (end == std::string_view::npos) {
        return std::nullopt;
      }
      word.append(text.substr(i + 1, end - i - 1));
      in_word = true;
      i = end;
    } else if (c == '"') {
      std::size_t j = i + 1;
      for (; j < text.size() && text[j] != '"'; ++j) {
        if (text[j] == '\\' && j + 1 < text.size() &&
            std::string_view("\"\\$`").find(text[j + 1]) != std::string_view::npos) {
          ++j;
        }
        word.push_back(text[j]);
      }
      if (j >= text.size()) {
        return std::nullopt;
      }
      in_word = true;
      i = j;
    } else if (c == '\\' && i + 1 < text.size()) {
      word.push_back(text[++i]);
      in_word = true;
    } else if (std::isspace(static_cast<unsigned char>(c))) {
      if (in_word) {
        words.push_back(std::move(word));
        word.clear();
        in_word = false;
      }
    } else {
      word.push_back(c);
      in_word = true;
    }
  }
  if (in_word) {
    words.push_back(std::move(word));
  }
  return words;
}

const char* usage_text() {
  return R"(usage: egress-bench [options] URL
       egress-bench [common options] --compare 'ARGS A' 'ARGS B' [--pairs K]

Drives HTTP load at URL (https:// or http://), directly or through a forward proxy.

  --proxy URL          http://[user:pass@]host:port; CONNECT for https targets (credentials
                       sent as Proxy-Authorization: Basic), absolute-form for http targets
  --cacert FILE        verify the target's certificate against FILE (default: system store)
  --insecure           do not verify the target's certificate
  --h1                 HTTP/1.1 (default)
  --h2                 HTTP/2 (https targets only; ALPN must select h2)
  --streams M          --h2: concurrent streams per connection (default 1)
  --connections N      concurrent connections (default 1)
  --threads T          io_context threads (default 1)
  --duration D         measured run time, e.g. 10s, 500ms, 2m (default 10s)
  --requests N         stop after exactly N counted requests (with --duration: first bound wins)
  --warmup D           run for D before measuring; those requests are not counted (default 0)
  --new-connection     one request per connection: connect, CONNECT, TLS handshake every time
  --rate R             open loop: R requests/s in total on a fixed schedule (0.001 to 1e7);
                       latency is measured from each request's intended send time
  -H 'Name: value'     extra request header (repeatable)
  --method M           request method (default GET, or POST with --body-size)
  --body-size N        send a request body of N bytes
  --timeout D          per-phase timeout: connect, CONNECT, handshake, request (default 10s)
  --no-tls-resume      do not resume TLS sessions on new connections
  --json               print one JSON object instead of text
  --compare A B        run A and B alternately (A B A B ...) in this process; each is a quoted
                       argument list appended to the common options
  --pairs K            number of A/B pairs for --compare (default 3)
  -h, --help           this text

Exit status: 0 when at least one counted request succeeded, 1 when none did or the run could not
start, 2 on a usage error.
)";
}

ParseResult parse_options(const std::vector<std::string>& args) {
  ParseResult result;
  BenchOptions& o = result.options;
  bool method_set = false;
  bool streams_set = false;
  std::string proxy_text;
  auto fail = [&](std::string message) {
    result.error = std::move(message);
    return result;
  };
  for (std::size_t i = 0; i < args.size(); ++i) {
    const std::string& a = args[i];
    auto value = [&](std::string& out) {
      if (i + 1 >= args.size()) {
        result.error = a + " needs a value";
        return false;
      }
      out = args[++i];
      return true;
    };
    std::string v;
    if (a == "-h" || a == "--help") {
      result.help = true;
      return result;
    } else if (a == "--h1") {
      o.protocol = Protocol::kHttp1;
    } else if (a == "--h2") {
      o.protocol = Protocol::kHttp2;
    } else if (a == "--insecure" || a == "-k") {
      o.insecure = true;
    } else if (a == "--new-connection") {
      o.new_connection = true;
    } else if (a == "--no-tls-resume") {
      o.tls_resume = false;
    } else if (a == "--json") {
      o.json = true;
    } else if (a == "--proxy") {
      if (!value(proxy_text)) return result;
    } else if (a == "--cacert") {
      if (!value(o.cacert)) return result;
    } else if (a == "--method" || a == "-m") {
      if (!value(o.method)) return result;
      if (o.method.empty() || !std::all_of(o.method.begin(), o.method.end(), is_token_char)) {
        return fail("invalid method '" + o.method + "'");
      }
      method_set = true;
    } else if (a == "-H" || a == "--header") {
      if (!value(v)) return result;
      std::pair<std::string, std::string> h;
      if (auto e = parse_header(v, h); !e.empty()) return fail(e);
      o.headers.push_back(std::move(h));
    } else if (a == "--connections" || a == "-c" || a == "--threads" || a == "-t") {
      if (!value(v)) return result;
      auto n = parse_uint<int>(v);
      if (!n || *n < 1 || *n > 100000) return fail(a + " must be an integer in 1..100000");
      (a == "--connections" || a == "-c" ? o.connections : o.threads) = *n;
    } else if (a == "--streams") {
      if (!value(v)) return result;
      auto n = parse_uint<int>(v);
      if (!n || *n < 1 || *n > 1000) return fail("--streams must be an integer in 1..1000");
      o.streams = *n;
      streams_set = true;
    } else if (a == "--requests" || a == "-n") {
      if (!value(v)) return result;
      auto n = parse_uint<std::uint64_t>(v);
      if (!n || *n < 1) return fail("--requests must be a positive integer");
      o.requests = *n;
    } else if (a == "--body-size") {
      if (!value(v)) return result;
      auto n = parse_uint<std::uint64_t>(v);
      if (!n || *n > (std::uint64_t{1} << 30)) return fail("--body-size must be 0..1073741824");
      o.body_size = *n;
    } else if (a == "--duration" || a == "-d" || a == "--warmup" || a == "--timeout") {
      if (!value(v)) return result;
      auto d = parse_duration(v);
      if (!d) return fail(a + ": invalid duration '" + v + "' (e.g. 10s, 500ms, 2m)");
      if (a == "--warmup") {
        o.warmup = *d;
      } else if (a == "--timeout") {
        if (d->count() == 0) return fail("--timeout must be positive");
        o.timeout = *d;
      } else {
        if (d->count() == 0) return fail("--duration must be positive");
        o.duration = *d;
      }
    } else if (a == "--rate" || a == "-r") {
      if (!value(v)) return result;
      auto r = parse_double(v);
      // At least one request per 1000 s: a smaller rate's schedule would not fit the clock.
      if (!r || *r < 1e-3 || *r > 1e7) return fail("--rate must be a number in [0.001, 1e7]");
      o.rate = *r;
    } else if (!a.empty() && a.front() == '-') {
      return fail("unknown option '" + a + "'");
    } else {
      if (!o.url.empty()) {
        return fail("more than one target URL ('" + o.url + "', '" + a + "')");
      }
      o.url = a;
    }
  }
  if (o.url.empty()) {
    return fail("missing target URL");
  }
  if (auto e = parse_target(o.url, o.target); !e.empty()) return fail(e);
  if (!proxy_text.empty()) {
    ProxyUrl p;
    if (auto e = parse_proxy(proxy_text, p); !e.empty()) return fail(e);
    o.proxy = std::move(p);
  }
  if (!method_set && o.body_size > 0) {
    o.method = "POST";
  }
  if (!o.duration && !o.requests) {
    o.duration = std::chrono::seconds(10);
  }
  o.threads = std::min(o.threads, o.connections);
  if (o.protocol == Protocol::kHttp2 && !o.target.tls) {
    return fail("--h2 needs an https:// target (no cleartext h2c)");
  }
  if (streams_set && o.protocol != Protocol::kHttp2) {
    return fail("--streams needs --h2 (HTTP/1.1 has one request in flight per connection)");
  }
  return result;
}

}  // namespace egress::bench
