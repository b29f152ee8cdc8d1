#pragma once
// The egressd process: worker threads (one io_context per core), listeners, signals.
#include <memory>
#include <string>

#include "proxy/runtime.h"

namespace egress::proxy {

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
