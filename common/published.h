#pragma once
// A value that writers replace whole and any thread reads: the data path's runtime
// (proxy/worker.h) and the control plane's state snapshot (credstore/state_store.h).
//
// Not std::atomic<std::shared_ptr>: libstdc++ 12's load() reads the pointer under its lock
// bit and then clears the bit with a relaxed decrement, so the memory model does not order
// that read before the next writer's swap of the same pointer (x86's locked decrement does,
// which is why it works there). ThreadSanitizer reported the pair as a data race in egressd
// (a worker reloading the runtime, the admin thread publishing the next: `.ci/sanitize.sh
// thread`). A mutex orders both ways. Readers take it rarely: a worker reloads the runtime
// only when its generation moved, the control plane once per call.
#include <memory>
#include <mutex>
#include <utility>

namespace egress {

template <class T>
class Published {
public:
    std::shared_ptr<T> load() const {
        std::lock_guard<std::mutex> lock(mu_);
        return value_;
    }

    /// Replaces the value and returns the one it replaced (released by the caller, outside
    /// the lock: a runtime's last reference frees a whole policy).
    std::shared_ptr<T> exchange(std::shared_ptr<T> next) {
        {
            std::lock_guard<std::mutex> lock(mu_);
            value_.swap(next);
        }
        return next;
    }

    void store(std::shared_ptr<T> next) { exchange(std::move(next)); }

private:
    mutable std::mutex mu_;
    std::shared_ptr<T> value_;
};

}  // namespace egress
