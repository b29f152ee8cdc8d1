#pragma once
// Text and JSON reports of a run and of a --compare series. Pure formatting: no I/O besides
// the stream it is given.

#include <ostream>
#include <string>
#include <vector>

#include "bench/options.h"
#include "bench/runner.h"

namespace egress::bench {

void print_text(std::ostream& out, const BenchOptions& options, const RunResult& result);
/// One JSON object (single line, newline-terminated).
void print_json(std::ostream& out, const BenchOptions& options, const RunResult& result);

struct CompareSide {
  std::string label;  // "A" / "B"
  std::string args;   // as given to --compare
  BenchOptions options;
  std::vector<RunResult> runs;
};

void print_compare_text(std::ostream& out, const CompareSide& a, const CompareSide& b);
void print_compare_json(std::ostream& out, const CompareSide& a, const CompareSide& b);

/// Median of `values` (mean of the middle two when even); 0 when empty.
double median(std::vector<double> values);

}  // namespace egress::bench
