#pragma once
// The egressd process: worker threads (one io_context per core), listeners, signals.
#include <memory>

#include "proxy/runtime.h"

namespace egress::proxy {

class Server {
public:
    explicit Server(std::shared_ptr<const Runtime> runtime);
    ~Server();
    /// Runs until SIGTERM/SIGINT, then drains (drain_timeout) and returns the exit code.
    int run();

private:
    struct Impl;
    std::unique_ptr<Impl> impl_;
};

}  // namespace egress::proxy
