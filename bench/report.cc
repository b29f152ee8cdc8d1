#include "bench/report.h"

#include <algorithm>
#include <optional>
#include <boost/json.hpp>
#include <cstdio>

namespace egress::bench {
namespace json = boost::json;
namespace {

struct Percentile {
  const char* text;
  const char* key;
  double p;
};
constexpr Percentile kPercentiles[] = {
    {"p50", "p50", 50}, {"p90", "p90", 90}, {"p99", "p99", 99}, {"p99.9", "p99_9", 99.9}};

std::string fixed(double v, int digits) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.*f", digits, v);
  return buf;
}

std::vector<double> present(const std::vector<std::optional<double>>& values) {
  std::vector<double> out;
  for (const auto& v : values) {
    if (v) {
      out.push_back(*v);
    }
  }
  return out;
}

/// A median as text, "n/a" for none.
std::string median_text(const std::vector<double>& values, int digits) {
  return values.empty() ? std::string("n/a") : fixed(median(values), digits);
}

/// A median for JSON, null for none.
json::value median_json(const std::vector<double>& values) {
  return values.empty() ? json::value(nullptr) : json::value(median(values));
}

std::string mode_text(const BenchOptions& o) {
  std::string s = o.rate ? "open loop at " + fixed(*o.rate, 1) + " req/s" : "closed loop";
  s += ", " + std::to_string(o.connections) + " connection" + (o.connections == 1 ? "" : "s");
  s += o.new_connection ? ", new connection per request" : ", keep-alive";
  if (o.protocol == Protocol::kHttp2 && !o.new_connection) {
    s += ", " + std::to_string(o.streams) + " stream" + (o.streams == 1 ? "" : "s") +
         " per connection";
  }
  s += ", " + std::to_string(o.threads) + " thread" + (o.threads == 1 ? "" : "s");
  return s;
}

/// A percentile of `h` in µs; none when `h` is empty (its 0 is no latency that was measured).
std::optional<double> percentile(const LatencyHistogram& h, double p) {
  return h.count() ? std::optional<double>(static_cast<double>(h.value_at_percentile(p)))
                   : std::nullopt;
}

json::value optional_json(const std::optional<double>& v) {
  return v ? json::value(*v) : json::value(nullptr);
}

/// A percentile as text, "n/a" when the histogram is empty.
std::string percentile_text(const LatencyHistogram& h, double p) {
  return h.count() ? std::to_string(h.value_at_percentile(p)) : std::string("n/a");
}

/// count, and min/mean/percentiles/max: null when count is 0 (no response, no latency).
json::object histogram_json(const LatencyHistogram& h) {
  json::object o;
  o["count"] = h.count();
  const bool any = h.count() > 0;
  o["min"] = any ? json::value(h.min()) : json::value(nullptr);
  o["mean"] = any ? json::value(h.mean()) : json::value(nullptr);
  for (const auto& p : kPercentiles) {
    o[p.key] = any ? json::value(h.value_at_percentile(p.p)) : json::value(nullptr);
  }
  o["max"] = any ? json::value(h.max()) : json::value(nullptr);
  return o;
}

json::object run_json(const BenchOptions& options, const RunResult& r) {
  json::object o;
  o["target"] = options.url;
  o["proxy"] = options.proxy ? json::value(options.proxy->display) : json::value(nullptr);
  o["protocol"] = options.protocol == Protocol::kHttp2 ? "h2" : "h1";
  o["method"] = options.method;
  o["connections"] = options.connections;
  o["streams"] = options.protocol == Protocol::kHttp2 && !options.new_connection ? options.streams : 1;
  o["threads"] = options.threads;
  o["new_connection"] = options.new_connection;
  o["rate"] = options.rate ? json::value(*options.rate) : json::value(nullptr);
  o["elapsed_s"] = r.elapsed_s;
  o["warmup_s"] = r.warmup_s;
  o["interrupted"] = r.interrupted;
  if (!r.fatal_error.empty()) {
    o["fatal_error"] = r.fatal_error;
  }
  json::object requests;
  requests["total"] = r.counted();
  requests["ok"] = r.stats.ok;
  requests["errors"] = r.stats.failed;
  requests["warmup"] = r.stats.warmup_requests;
  o["requests"] = std::move(requests);
  o["not_sent"] = r.not_sent;
  o["retries"] = r.stats.retries;
  o["rps"] = r.rps();
  auto latency = histogram_json(r.stats.latency);
  latency["lower_bounds"] = r.stats.latency_lower_bounds;
  o["latency_us"] = std::move(latency);
  o["connect_latency_us"] = histogram_json(r.stats.connect_latency);
  json::object errors;
  for (const auto& [k, n] : r.stats.errors) {
    errors[k] = n;
  }
  o["errors"] = std::move(errors);
  json::object samples;
  for (const auto& [k, m] : r.stats.error_samples) {
    samples[k] = m;
  }
  o["error_samples"] = std::move(samples);
  json::object status;
  for (std::size_t code = 0; code < r.stats.status_counts.size(); ++code) {
    if (r.stats.status_counts[code]) {
      status[std::to_string(code)] = r.stats.status_counts[code];
    }
  }
  o["status"] = std::move(status);
  json::object protocols;
  for (const auto& [k, n] : r.stats.protocols) {
    protocols[k] = n;
  }
  o["alpn"] = std::move(protocols);
  o["connections_opened"] = r.stats.connections_opened;
  o["tls_handshakes"] = r.stats.tls_handshakes;
  o["tls_resumed"] = r.stats.tls_resumed;
  o["bytes_received"] = r.stats.bytes_received;
  o["body_bytes_received"] = r.stats.body_bytes_received;
  o["bytes_sent"] = r.stats.bytes_sent;
  return o;
}

std::string join_counts(const std::map<std::string, std::uint64_t, std::less<>>& m) {
  std::string s;
  for (const auto& [k, n] : m) {
    s += (s.empty() ? "" : ", ") + k + " " + std::to_string(n);
  }
  return s.empty() ? "-" : s;
}

json::object side_json(const CompareSide& side) {
  json::object o;
  o["args"] = side.args;
  json::array runs;
  std::vector<double> rps;
  std::vector<std::optional<double>> p99;
  for (const auto& r : side.runs) {
    json::object run;
    run["rps"] = r.rps();
    run["requests"] = r.counted();
    run["errors"] = r.stats.failed;
    run["not_sent"] = r.not_sent;
    run["p50_us"] = optional_json(percentile(r.stats.latency, 50));
    run["p99_us"] = optional_json(percentile(r.stats.latency, 99));
    runs.push_back(std::move(run));
    rps.push_back(r.rps());
    p99.push_back(percentile(r.stats.latency, 99));  // a run without responses has none
  }
  o["runs"] = std::move(runs);
  o["median_rps"] = median_json(rps);
  o["median_p99_us"] = median_json(present(p99));
  return o;
}

/// B/A of each pair; none (nullopt) where A made no request (no ratio to take, and none
/// enters the median).
std::vector<std::optional<double>> pair_ratios(const CompareSide& a, const CompareSide& b) {
  std::vector<std::optional<double>> ratios;
  for (std::size_t i = 0; i < std::min(a.runs.size(), b.runs.size()); ++i) {
    const double ra = a.runs[i].rps();
    ratios.push_back(ra > 0 ? std::optional<double>(b.runs[i].rps() / ra) : std::nullopt);
  }
  return ratios;
}


}  // namespace

double median(std::vector<double> values) {
  if (values.empty()) {
    return 0;
  }
  std::sort(values.begin(), values.end());
  const std::size_t n = values.size();
  return n % 2 ? values[n / 2] : (values[n / 2 - 1] + values[n / 2]) / 2;
}

void print_text(std::ostream& out, const BenchOptions& o, const RunResult& r) {
  const auto& s = r.stats;
  out << "target          " << o.url << "\n";
  if (o.proxy) {
    out << "proxy           " << o.proxy->display
        << (o.target.tls ? " (CONNECT)" : " (absolute-form)") << "\n";
  }
  out << "load            " << o.method << ", " << mode_text(o) << "\n";
  if (!r.fatal_error.empty()) {
    out << "error           " << r.fatal_error << "\n";
  }
  out << "measured        " << fixed(r.elapsed_s, 3) << " s";
  if (r.warmup_s > 0) {
    out << " after " << fixed(r.warmup_s, 3) << " s warmup (" << s.warmup_requests
        << " requests not counted)";
  }
  out << (r.interrupted ? " (interrupted)" : "") << "\n";
  out << "requests        " << r.counted() << " total, " << s.ok << " ok, " << s.failed
      << " errors";
  if (r.not_sent > 0) {
    out << "; " << r.not_sent << " not sent (due in the window, but every connection was busy:"
        << " the client fell behind the rate)";
  }
  if (s.retries > 0) {
    out << "; " << s.retries << " sent again (their kept-alive connection closed while idle)";
  }
  out << "\n";
  out << "requests/s      " << fixed(r.rps(), 1) << "\n";
  if (s.latency.count()) {
    out << "latency (us)   ";
    for (const auto& p : kPercentiles) {
      out << " " << p.text << " " << s.latency.value_at_percentile(p.p);
    }
    out << "  max " << s.latency.max() << "  mean " << fixed(s.latency.mean(), 1) << "\n";
    if (s.latency_lower_bounds > 0) {
      out << "                (" << s.latency_lower_bounds << " of " << s.latency.count()
          << " are lower bounds: timed out, or not sent by the window's end)\n";
    }
  } else {
    out << "latency (us)    n/a (no response)\n";
  }
  if (s.connect_latency.count()) {
    out << "connect (us)    p50 " << s.connect_latency.value_at_percentile(50) << " p99 "
        << s.connect_latency.value_at_percentile(99) << "  max " << s.connect_latency.max() << "  ("
        << s.connections_opened << " connections, " << s.tls_resumed << "/" << s.tls_handshakes
        << " TLS resumed)\n";
  }
  out << "errors          " << join_counts(s.errors) << "\n";
  for (const auto& [k, m] : s.error_samples) {
    out << "  " << k << ": " << m << "\n";
  }
  std::string status;
  for (std::size_t code = 0; code < s.status_counts.size(); ++code) {
    if (s.status_counts[code]) {
      status += (status.empty() ? "" : ", ") + std::to_string(code) + " " +
                std::to_string(s.status_counts[code]);
    }
  }
  out << "status codes    " << (status.empty() ? "-" : status) << "\n";
  out << "protocols       " << join_counts(s.protocols) << "\n";
  out << "bytes           " << s.bytes_received << " received (" << s.body_bytes_received
      << " body), " << s.bytes_sent << " sent\n";
}

void print_json(std::ostream& out, const BenchOptions& options, const RunResult& result) {
  out << json::serialize(run_json(options, result)) << "\n";
}

void print_compare_text(std::ostream& out, const CompareSide& a, const CompareSide& b) {
  const auto ratios = pair_ratios(a, b);
  out << "A: " << a.args << "\nB: " << b.args << "\n";
  out << "pair   A rps        B rps        B/A     A p99 us   B p99 us\n";
  for (std::size_t i = 0; i < ratios.size(); ++i) {
    char line[160];
    const std::string ratio = ratios[i] ? fixed(*ratios[i], 3) : std::string("n/a");
    std::snprintf(line, sizeof line, "%-6zu %-12.1f %-12.1f %-7s %-10s %s\n", i + 1,
                  a.runs[i].rps(), b.runs[i].rps(), ratio.c_str(),
                  percentile_text(a.runs[i].stats.latency, 99).c_str(),
                  percentile_text(b.runs[i].stats.latency, 99).c_str());
    out << line;
  }
  std::vector<double> ra, rb;
  for (const auto& r : a.runs) ra.push_back(r.rps());
  for (const auto& r : b.runs) rb.push_back(r.rps());
  out << "median A rps    " << median_text(ra, 1) << "\n";
  out << "median B rps    " << median_text(rb, 1) << "\n";
  out << "median B/A      " << median_text(present(ratios), 3) << "\n";
}

void print_compare_json(std::ostream& out, const CompareSide& a, const CompareSide& b) {
  json::object o;
  o["pairs"] = std::min(a.runs.size(), b.runs.size());
  o["a"] = side_json(a);
  o["b"] = side_json(b);
  const auto ratios = pair_ratios(a, b);
  json::array r;
  for (const auto& x : ratios) {
    r.push_back(x ? json::value(*x) : json::value(nullptr));
  }
  o["ratios"] = std::move(r);
  o["median_ratio"] = median_json(present(ratios));
  out << json::serialize(o) << "\n";
}

}  // namespace egress::bench
