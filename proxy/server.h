#pragma once
// The egressd process: worker threads (one io_context per core), listeners, signals.
#include <memory>
#include <string>

#include "proxy/runtime.h"

namespace egress::proxy {

/// What a start would refuse in the files fixed at start (the upstream CA bundle, etcd's TLS
/// files, anything but a socket at a unix listen.admin path), one error per line naming the
/// key, "" when none. `--check` and a reload ask it
/// too: a reload that changes them applies them only at the next start, which must not be
/// the first to find them broken.
std::string start_file_errors(const Config& config);

class Server {
public:
    /// `config_path` is re-read on SIGHUP.
    Server(std::shared_ptr<const Runtime> runtime, std::string config_path);
    ~Server();
    /// Runs until SIGTERM/SIGINT, then drains (drain_timeout) and returns the exit code.
    /// SIGHUP reloads the configuration atomically; an invalid one is refused (logged with
    /// the bad keys) and the running one keeps serving.
    int run();

private:
    struct Impl;
    std::unique_ptr<Impl> impl_;
};

}  // namespace egress::proxy
