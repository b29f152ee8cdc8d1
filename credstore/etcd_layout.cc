#include "credstore/etcd_layout.h"

namespace egress::credstore::etcd {

namespace {

constexpr std::string_view kSecrets = "secrets/";
constexpr std::string_view kRuns = "runs/";

int64_t revision_of(const std::map<std::string, int64_t>& revs, const std::string& key) {
    auto it = revs.find(key);
    return it == revs.end() ? 0 : it->second;
}

}  // namespace

std::string secret_path(const std::string& prefix, const SealedSecret& s) {
    return prefix + std::string(kSecrets) + secret_key(s.name, s.scope);
}

std::string run_path(const std::string& prefix, const std::string& run_id) {
    return prefix + std::string(kRuns) + run_id;
}

std::string prefix_range_end(const std::string& prefix) {
    std::string end = prefix;
    while (!end.empty()) {
        auto& last = reinterpret_cast<unsigned char&>(end.back());
        if (last < 0xff) {
            ++last;
            return end;
        }
        end.pop_back();
    }
    return std::string(1, '\0');  // every key (etcd's convention for an all-0xff prefix)
}

Result<bool> apply_kv(StateSnapshot& snap, std::map<std::string, int64_t>& revs,
                      const std::string& prefix, std::string_view key,
                      std::optional<std::string_view> value, int64_t mod_revision) {
    if (key.substr(0, prefix.size()) != prefix) {
        return false;
    }
    const std::string_view rest = key.substr(prefix.size());
    const bool is_secret = rest.substr(0, kSecrets.size()) == kSecrets;
    const bool is_run = rest.substr(0, kRuns.size()) == kRuns;
    if (!is_secret && !is_run) {
        return false;
    }
    const std::string name(rest.substr(is_secret ? kSecrets.size() : kRuns.size()));
    if (!value) {
        if (is_secret) {
            snap.secrets.erase(name);
        } else {
            snap.runs.erase(name);
        }
        revs.erase(std::string(key));
        return true;
    }
    // The key's revision is kept whatever its value holds: a record that does not parse is
    // still there, and a write that replaces or deletes it must be guarded by its revision.
    revs[std::string(key)] = mod_revision;
    // A record that does not parse is dropped from the state (fail closed: the value it had
    // before is not served on), and the error says why.
    auto unreadable = [&](const std::string& why) -> Result<bool> {
        if (is_secret) {
            snap.secrets.erase(name);
        } else {
            snap.runs.erase(name);
        }
        return make_error("etcd key " + std::string(key) + ": " + why);
    };
    if (is_secret) {
        auto s = secret_record_from_json(*value);
        if (!s) {
            return unreadable(s.error());
        }
        if (secret_key(s->name, s->scope) != name) {
            return unreadable("holds secret " + secret_key(s->name, s->scope));
        }
        snap.secrets[name] = std::move(*s);
    } else {
        auto r = run_record_from_json(*value);
        if (!r) {
            return unreadable(r.error());
        }
        if (r->id != name) {
            return unreadable("holds run " + r->id);
        }
        snap.runs[name] = std::move(*r);
    }
    return true;
}

TxnPlan plan_txn(const View& base, const StateSnapshot& next, const std::string& prefix) {
    TxnPlan plan;
    const StateSnapshot& old = *base.snap;
    auto guard = [&](const std::string& key) {
        plan.expect[key] = revision_of(base.mod_revisions, key);
    };
    for (const auto& [k, s] : next.secrets) {
        auto it = old.secrets.find(k);
        std::string text = secret_record_to_json(s);
        if (it != old.secrets.end() && secret_record_to_json(it->second) == text) {
            continue;
        }
        std::string key = secret_path(prefix, s);
        guard(key);
        plan.puts.push_back({std::move(key), std::move(text), std::nullopt});
    }
    for (const auto& [k, s] : old.secrets) {
        if (next.secrets.count(k) == 0) {
            std::string key = secret_path(prefix, s);
            guard(key);
            plan.deletes.push_back(std::move(key));
        }
    }
    for (const auto& [id, r] : next.runs) {
        auto it = old.runs.find(id);
        std::string text = run_record_to_json(r);
        if (it != old.runs.end() && run_record_to_json(it->second) == text) {
            continue;
        }
        std::string key = run_path(prefix, id);
        guard(key);
        const bool same_life = it != old.runs.end() && it->second.expires_at == r.expires_at &&
                               base.mod_revisions.count(key) != 0;
        plan.puts.push_back({std::move(key), std::move(text),
                             same_life ? std::nullopt : std::optional<int64_t>(r.expires_at),
                             same_life});
    }
    for (const auto& [id, r] : old.runs) {
        if (next.runs.count(id) == 0) {
            std::string key = run_path(prefix, id);
            guard(key);
            plan.deletes.push_back(std::move(key));
        }
    }
    return plan;
}

}  // namespace egress::credstore::etcd
