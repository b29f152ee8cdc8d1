// egressd: credential-injecting egress forward proxy.
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/stat.h>

#include <cerrno>
#include <cstdio>
#include <csignal>
#include <cstdlib>
#include <cstring>
#include <string>

#include <spdlog/spdlog.h>

#include "credstore/envelope.h"
#include "credstore/secret.h"
#include "proxy/audit.h"
#include "proxy/config.h"
#include "proxy/etcd_store.h"
#include "proxy/logging.h"
#include "proxy/malloc_tuning.h"
#include "proxy/runtime.h"
#include "proxy/server.h"
#include "tls/contexts.h"

namespace {

constexpr const char* kUsage =
    "usage: egressd --config FILE [--check]\n"
    "  --config FILE   YAML configuration (see configs/quickstart.yaml)\n"
    "  --check         validate the configuration and exit (non-zero with messages naming\n"
    "                  the bad keys)\n";

/// Whether something is at `path`. `as_start_creates`: a dangling symlink counts (the admin
/// token and the master key: a start creates them with O_EXCL, which fails on it, and reading
/// it gives the error a start gives); else it does not (a rotation's .next: a start looks
/// through the link and finds nothing).
bool file_exists(const std::string& path, bool as_start_creates) {
    struct stat st {};
    const int r = as_start_creates ? ::lstat(path.c_str(), &st) : ::stat(path.c_str(), &st);
    return r == 0 || errno != ENOENT;
}

/// What a start would refuse beyond the parse, checked without side effects (no listener,
/// no file written, no store opened, so etcd is not contacted): every static run (token and
/// secret files, CA), the upstream CA bundle, etcd's TLS files, the admin token, the master
/// key and the audit file. Errors name the key, one per line.
std::string start_errors(std::shared_ptr<const egress::proxy::Config> config,
                         egress::proxy::BuildWarnings& warnings) {
    std::string errors;
    auto add = [&](const std::string& e) { errors += (errors.empty() ? "" : "\n") + e; };
    if (auto rt = egress::proxy::build_runtime(config, warnings); !rt) {
        add(rt.error());
    }
    if (auto files = egress::proxy::start_file_errors(*config); !files.empty()) {
        add(files);
    }
    // The admin token and the master key (and a rotation's .next) are read by the start
    // (ControlPlane::open) with these same functions, the key opened as it would be; one that
    // does not exist yet is made by the start, so it is fine here.
    if (file_exists(config->admin_token_file, true)) {
        if (auto t = egress::credstore::load_owner_only_secret_file("admin.token_file",
                                                                     config->admin_token_file);
            !t) {
            add(t.error());
        }
    }
    if (!config->kms_command) {
        const std::string& key_file = config->master_key_file;
        for (const std::string& key : {key_file, key_file + ".next"}) {
            if (file_exists(key, key == key_file)) {
                if (auto k = egress::credstore::open_master_key_file(key, false); !k) {
                    add(k.error());
                }
            }
        }
    }
    if (auto a = egress::proxy::AuditLog::check(config->audit.path); !a) {
        add(a.error());
    }
    return errors;
}

void harden_process() {
    // No core dumps: they would contain keys and secrets. RLIMIT_CORE alone does not stop a
    // core_pattern pipe (systemd-coredump, apport, a container runtime's handler: the kernel
    // ignores the limit for pipes), so egressd is also not dumpable, which also keeps
    // processes of the same user from attaching to it or reading /proc/PID/mem (only
    // CAP_SYS_PTRACE can: the memory tests run as root). Set after the malloc re-exec, which
    // would reset it.
    rlimit none{0, 0};
    setrlimit(RLIMIT_CORE, &none);
    ::prctl(PR_SET_DUMPABLE, 0, 0, 0, 0);
}

/// Raises the soft limit on open files to the hard limit, as nginx's worker_rlimit_nofile and
/// many servers do: a tunnel holds two descriptors, so the usual soft limit of 1024 ran out
/// before limits.connections_per_run's 512 (then accepts fail with EMFILE and wait: server.cc).
/// The hard limit is the operator's (systemd LimitNOFILE=, docker --ulimit, prlimit). Logged.
void raise_open_files_limit() {
    rlimit lim{};
    if (getrlimit(RLIMIT_NOFILE, &lim) != 0) {
        spdlog::warn("open files: cannot read the limit: {}", std::strerror(errno));
        return;
    }
    auto text = [](rlim_t v) {
        return v == RLIM_INFINITY ? std::string("unlimited") : std::to_string(v);
    };
    const rlim_t soft = lim.rlim_cur;
    if (soft != lim.rlim_max) {
        lim.rlim_cur = lim.rlim_max;
        if (setrlimit(RLIMIT_NOFILE, &lim) != 0) {
            spdlog::warn("open files: limit {} (cannot raise it to the hard limit {}: {})",
                         text(soft), text(lim.rlim_max), std::strerror(errno));
            return;
        }
        spdlog::info("open files: limit {} (the hard limit; raised from {})", text(lim.rlim_cur),
                     text(soft));
        return;
    }
    spdlog::info("open files: limit {} (the hard limit)", text(soft));
}

}  // namespace

int main(int argc, char** argv) {
    std::string config_path;
    bool check = false;
    for (int i = 1; i < argc; ++i) {
        std::string a = argv[i];
        if (a == "--config" && i + 1 < argc) {
            config_path = argv[++i];
        } else if (a.rfind("--config=", 0) == 0) {
            config_path = a.substr(9);
        } else if (a == "--check" || a == "--check-config") {
            check = true;
        } else if (a == "--help" || a == "-h") {
            std::fputs(kUsage, stdout);
            return 0;
        } else if (a == "--version") {
            std::puts("egressd 0.1.0");
            return 0;
        } else {
            std::fprintf(stderr, "egressd: unknown argument '%s'\n%s", a.c_str(), kUsage);
            return 2;
        }
    }
    if (config_path.empty()) {
        std::fputs(kUsage, stderr);
        return 2;
    }
    if (!check) {
        // A SIGHUP before the reload handler exists (Server::run installs it, before its
        // threads start, once the runtime, the control plane and the store are up: seconds on
        // etcd) would end the process: ignored until then. The disposition survives the exec below.
        std::signal(SIGHUP, SIG_IGN);
        // Once, before anything else (threads, files): see proxy/malloc_tuning.h.
        egress::proxy::reexec_with_malloc_tuning(argv);
    }
    auto cfg = egress::proxy::load_config_file(config_path);
    if (!cfg) {
        std::fprintf(stderr, "egressd: invalid configuration %s:\n%s\n", config_path.c_str(),
                     cfg.error().c_str());
        return 1;
    }
    if (check) {
        harden_process();  // the check reads secret and key files too
        auto config = std::make_shared<const egress::proxy::Config>(std::move(*cfg));
        egress::proxy::BuildWarnings warnings;
        const std::string errors = start_errors(config, warnings);
        for (const auto& w : warnings.lines) {
            std::fprintf(stderr, "egressd: warning: %s\n", w.c_str());
        }
        if (!errors.empty()) {
            std::fprintf(stderr, "egressd: %s cannot start:\n%s\n", config_path.c_str(),
                         errors.c_str());
            return 1;
        }
        std::printf("egressd: %s is valid\n", config_path.c_str());
        return 0;
    }
    harden_process();
    egress::proxy::setup_logging(cfg->log_format, cfg->log_level);
    raise_open_files_limit();
    if (const char* tunables = std::getenv("GLIBC_TUNABLES")) {
        spdlog::info("malloc: GLIBC_TUNABLES={}", tunables);
    }

    auto config = std::make_shared<const egress::proxy::Config>(std::move(*cfg));
    egress::proxy::BuildWarnings warnings;
    auto runtime = egress::proxy::build_runtime(config, warnings);
    for (const auto& w : warnings.lines) {
        spdlog::warn("{}", w);
    }
    if (!runtime) {
        spdlog::error("cannot start:\n{}", runtime.error());
        return 1;
    }
    egress::proxy::BuildWarnings file_warnings;
    if (auto w = egress::proxy::write_ca_files(**runtime, nullptr, &file_warnings); !w) {
        spdlog::error("cannot start:\n{}", w.error());
        return 1;
    }
    for (const auto& w : file_warnings.lines) {
        spdlog::warn("{}", w);
    }
    try {
        egress::proxy::Server server(*runtime, config_path);
        return server.run();
    } catch (const std::exception& e) {
        spdlog::error("cannot start: {}", e.what());
        return 1;
    }
}
