#include "credstore/state_store.h"

#include <gtest/gtest.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <random>
#include <sstream>
#include <thread>

#include "records.h"

namespace egress::credstore {
namespace {

namespace fs = std::filesystem;

class TempDir {
public:
    TempDir() {
        char name[] = "/tmp/egress_state_test_XXXXXX";
        const char* made = mkdtemp(name);
        EXPECT_NE(made, nullptr);
        path_ = name;
    }
    ~TempDir() {
        std::error_code ec;
        fs::remove_all(path_, ec);
    }
    const std::string& path() const { return path_; }

private:
    std::string path_;
};

std::string read_file(const std::string& path) {
    std::ifstream in(path, std::ios::binary);
    std::ostringstream s;
    s << in.rdbuf();
    return s.str();
}

Scope scope(std::string org, std::string project = "", std::string user = "",
            std::string workflow = "") {
    return Scope{std::move(org), std::move(project), std::move(user), std::move(workflow)};
}

using test_records::fake_secret;  // a sealed secret with placeholder blobs

Mutation put_secret(const SealedSecret& s) {
    Mutation m;
    m.kind = Mutation::Kind::PutSecret;
    m.secret = s;
    return m;
}

Mutation delete_secret(const std::string& name, std::optional<Scope> s = std::nullopt) {
    Mutation m;
    m.kind = Mutation::Kind::DeleteSecret;
    m.name = name;
    m.scope = std::move(s);
    return m;
}

// PinRecord::extra_headers is being added alongside the admin API; cover it when present.
template <class Pin>
void set_extra_headers(Pin& p) {
    if constexpr (requires { p.extra_headers; }) {
        p.extra_headers = {{"X-Org", "acme"}, {"Accept", "application/vnd.github+json"}};
    }
}

template <class Pin>
void expect_same_extra_headers(const Pin& a, const Pin& b) {
    if constexpr (requires { a.extra_headers; }) {
        EXPECT_EQ(a.extra_headers, b.extra_headers);
    }
}

RunRecord full_run(const std::string& id) {
    RunRecord r;
    r.id = id;
    r.scope = scope("acme", "web", "ana", "nightly");
    r.token_sha256 = std::string(64, 'f');
    r.created_at = 1700000000;
    r.expires_at = 1700001800;
    r.revoked = true;
    r.allow_hosts = {"pypi.org", "*.example.com"};
    r.source_cidrs = {"10.0.0.0/8"};
    PinRecord p;
    p.id = "pin_01";
    p.host = "api.github.com:443";
    p.secret = "github_token";
    p.inject = InjectRecord{"header", "", "X-Api-Key", "token {secret}", "", "", ""};
    p.path_prefixes = {"/repos/acme/"};
    p.methods = {"GET", "POST"};
    p.expires_at = 1700000600;
    set_extra_headers(p);
    r.pins.push_back(p);
    PinRecord basic;
    basic.id = "pin_02";
    basic.host = "*.s3.amazonaws.com";
    basic.secret = "s3";
    basic.inject = InjectRecord{"basic", "bob", "", "{secret}", "", "", ""};
    r.pins.push_back(basic);
    PinRecord aws;
    aws.id = "pin_03";
    aws.host = "dynamodb.eu-west-1.amazonaws.com";
    aws.secret = "aws_key";
    aws.inject = InjectRecord{"aws-sigv4", "", "", "{secret}", "AKIAIOSFODNN7EXAMPLE",
                              "eu-west-1", "dynamodb"};
    r.pins.push_back(aws);
    r.ca_cert_pem = "-----BEGIN CERTIFICATE-----\nMIIB\n-----END CERTIFICATE-----\n";
    r.ca_key = fake_secret("ca:" + id, r.scope);
    return r;
}

Mutation put_run(const RunRecord& r) {
    Mutation m;
    m.kind = Mutation::Kind::PutRun;
    m.run = r;
    return m;
}

Mutation delete_run(const std::string& id) {
    Mutation m;
    m.kind = Mutation::Kind::DeleteRun;
    m.run_id = id;
    return m;
}

void expect_same_run(const RunRecord& a, const RunRecord& b) {
    EXPECT_EQ(a.id, b.id);
    EXPECT_EQ(a.scope, b.scope);
    EXPECT_EQ(a.token_sha256, b.token_sha256);
    EXPECT_EQ(a.created_at, b.created_at);
    EXPECT_EQ(a.expires_at, b.expires_at);
    EXPECT_EQ(a.revoked, b.revoked);
    EXPECT_EQ(a.allow_hosts, b.allow_hosts);
    EXPECT_EQ(a.source_cidrs, b.source_cidrs);
    ASSERT_EQ(a.pins.size(), b.pins.size());
    for (size_t i = 0; i < a.pins.size(); ++i) {
        EXPECT_EQ(a.pins[i].id, b.pins[i].id);
        EXPECT_EQ(a.pins[i].host, b.pins[i].host);
        EXPECT_EQ(a.pins[i].secret, b.pins[i].secret);
        EXPECT_EQ(a.pins[i].inject.type, b.pins[i].inject.type);
        EXPECT_EQ(a.pins[i].inject.username, b.pins[i].inject.username);
        EXPECT_EQ(a.pins[i].inject.name, b.pins[i].inject.name);
        EXPECT_EQ(a.pins[i].inject.value_template, b.pins[i].inject.value_template);
        EXPECT_EQ(a.pins[i].inject.access_key_id, b.pins[i].inject.access_key_id);
        EXPECT_EQ(a.pins[i].inject.region, b.pins[i].inject.region);
        EXPECT_EQ(a.pins[i].inject.service, b.pins[i].inject.service);
        EXPECT_EQ(a.pins[i].path_prefixes, b.pins[i].path_prefixes);
        EXPECT_EQ(a.pins[i].methods, b.pins[i].methods);
        EXPECT_EQ(a.pins[i].expires_at, b.pins[i].expires_at);
        expect_same_extra_headers(a.pins[i], b.pins[i]);
    }
    EXPECT_EQ(a.ca_cert_pem, b.ca_cert_pem);
    EXPECT_EQ(a.ca_key.name, b.ca_key.name);
    EXPECT_EQ(a.ca_key.ciphertext, b.ca_key.ciphertext);
}

void expect_same_snapshot(const StateSnapshot& a, const StateSnapshot& b) {
    EXPECT_EQ(a.revision, b.revision);
    ASSERT_EQ(a.secrets.size(), b.secrets.size());
    for (const auto& [key, s] : a.secrets) {
        auto it = b.secrets.find(key);
        ASSERT_NE(it, b.secrets.end()) << key;
        const SealedSecret& t = it->second;
        EXPECT_EQ(s.name, t.name);
        EXPECT_EQ(s.scope, t.scope);
        EXPECT_EQ(s.version, t.version);
        EXPECT_EQ(s.created_at, t.created_at);
        EXPECT_EQ(s.kek_id, t.kek_id);
        EXPECT_EQ(s.wrapped_dek, t.wrapped_dek);
        EXPECT_EQ(s.nonce, t.nonce);
        EXPECT_EQ(s.ciphertext, t.ciphertext);
    }
    ASSERT_EQ(a.runs.size(), b.runs.size());
    for (const auto& [id, r] : a.runs) {
        auto it = b.runs.find(id);
        ASSERT_NE(it, b.runs.end()) << id;
        expect_same_run(r, it->second);
    }
}

// ---- apply_mutations -----------------------------------------------------------------------

TEST(ApplyMutations, PutAndDeleteSecrets) {
    StateSnapshot base;
    auto next = apply_mutations(base, {put_secret(fake_secret("gh", scope("acme"))),
                                       put_secret(fake_secret("gh", scope("acme", "web"))),
                                       put_secret(fake_secret("npm", scope("acme")))});
    ASSERT_TRUE(next.ok()) << next.error();
    EXPECT_EQ(next->secrets.size(), 3U);
    EXPECT_TRUE(base.secrets.empty());  // pure
    EXPECT_EQ(next->revision, base.revision);

    // Put replaces the same name+scope (rotation).
    auto rotated = apply_mutations(*next, {put_secret(fake_secret("gh", scope("acme"), 2))});
    ASSERT_TRUE(rotated.ok());
    EXPECT_EQ(rotated->secrets.size(), 3U);
    EXPECT_EQ(rotated->secrets.at(secret_key("gh", scope("acme"))).version, 2U);

    auto one = apply_mutations(*next, {delete_secret("gh", scope("acme", "web"))});
    ASSERT_TRUE(one.ok()) << one.error();
    EXPECT_EQ(one->secrets.size(), 2U);
    EXPECT_TRUE(one->secrets.contains(secret_key("gh", scope("acme"))));

    auto all = apply_mutations(*next, {delete_secret("gh")});
    ASSERT_TRUE(all.ok()) << all.error();
    ASSERT_EQ(all->secrets.size(), 1U);
    EXPECT_EQ(all->secrets.begin()->second.name, "npm");
}

TEST(ApplyMutations, ErrorsTable) {
    StateSnapshot base;
    base.secrets[secret_key("gh", scope("acme"))] = fake_secret("gh", scope("acme"), 3);
    base.runs["run_1"] = full_run("run_1");
    SealedSecret unnamed = fake_secret("", scope("acme"));
    RunRecord no_id;
    Mutation replace_missing;
    replace_missing.kind = Mutation::Kind::ReplaceSecrets;
    replace_missing.secrets = {fake_secret("gh", scope("acme"), 3),
                               fake_secret("gone", scope("acme"))};
    Mutation replace_stale;
    replace_stale.kind = Mutation::Kind::ReplaceSecrets;
    replace_stale.secrets = {fake_secret("gh", scope("acme"), 2)};

    const std::vector<std::pair<std::vector<Mutation>, std::string>> cases = {
        {{delete_secret("nope")}, "not_found: secret nope"},
        {{delete_secret("gh", scope("acme", "web"))},
         "not_found: secret gh (org=acme,project=web)"},
        {{delete_run("run_2")}, "not_found: run run_2"},
        {{delete_run("run_1"), delete_run("run_1")}, "not_found: run run_1"},
        {{put_secret(unnamed)}, "invalid:"},
        {{put_run(no_id)}, "invalid:"},
        {{replace_missing}, "not_found: secret gone"},
        {{replace_stale}, "conflict: secret gh"},
    };
    for (const auto& [mutations, expected] : cases) {
        auto r = apply_mutations(base, mutations);
        ASSERT_FALSE(r.ok()) << expected;
        EXPECT_EQ(r.error().rfind(expected, 0), 0U) << r.error();
    }
}

TEST(ApplyMutations, RunsAndReplaceSecrets) {
    StateSnapshot base;
    auto next = apply_mutations(base, {put_run(full_run("run_1")), put_run(full_run("run_2")),
                                       put_secret(fake_secret("gh", scope("acme"))),
                                       put_secret(fake_secret("npm", scope("acme")))});
    ASSERT_TRUE(next.ok());
    RunRecord revoked = next->runs.at("run_1");
    revoked.revoked = true;
    revoked.pins.clear();
    Mutation replace;
    replace.kind = Mutation::Kind::ReplaceSecrets;
    SealedSecret rewrapped = fake_secret("gh", scope("acme"));
    rewrapped.kek_id = "file:new";
    replace.secrets = {rewrapped};
    auto after = apply_mutations(*next, {put_run(revoked), delete_run("run_2"), replace});
    ASSERT_TRUE(after.ok()) << after.error();
    ASSERT_EQ(after->runs.size(), 1U);
    EXPECT_TRUE(after->runs.at("run_1").pins.empty());
    EXPECT_EQ(after->secrets.at(secret_key("gh", scope("acme"))).kek_id, "file:new");
    EXPECT_EQ(after->secrets.at(secret_key("npm", scope("acme"))).kek_id, "file:0123abcd");
}

TEST(ApplyMutations, ReplaceSecretsRefusesASecretCreatedAgain) {
    // A rewrap of the sealing read before; meanwhile the secret was deleted and created again
    // (version 1 again, another sealing): the rewrap must not put the old value back.
    SealedSecret created_again = fake_secret("gh", scope("acme"));
    created_again.nonce = "bmV3bm9uY2UxMjM0";
    created_again.ciphertext = "bmV3IHZhbHVl";
    StateSnapshot base;
    auto next = apply_mutations(base, {put_secret(created_again)});
    ASSERT_TRUE(next.ok());
    Mutation replace;
    replace.kind = Mutation::Kind::ReplaceSecrets;
    SealedSecret rewrapped_old = fake_secret("gh", scope("acme"));
    rewrapped_old.kek_id = "file:new";
    replace.secrets = {rewrapped_old};
    auto after = apply_mutations(*next, {replace});
    ASSERT_FALSE(after.ok());
    EXPECT_TRUE(after.error().starts_with("conflict: secret gh")) << after.error();
}

// ---- JSON ----------------------------------------------------------------------------------

TEST(SnapshotJson, RoundTrip) {
    StateSnapshot s;
    s.revision = 42;
    for (const Scope& sc : {scope("acme"), scope("acme", "web", "ana", "nightly")}) {
        s.secrets[secret_key("gh", sc)] = fake_secret("gh", sc, 7);
    }
    s.runs["run_1"] = full_run("run_1");
    RunRecord bare;
    bare.id = "run_2";
    bare.scope = scope("acme");
    s.runs["run_2"] = bare;
    const std::string text = snapshot_to_json(s);
    auto back = snapshot_from_json(text);
    ASSERT_TRUE(back.ok()) << back.error();
    expect_same_snapshot(s, *back);
    EXPECT_EQ(snapshot_to_json(*back), text);  // stable
}

TEST(SnapshotJson, ErrorsNameThePlace) {
    const std::vector<std::pair<std::string, std::string>> cases = {
        {"", "invalid JSON"},
        {"{\"format\":1,\"revision\":1", "invalid JSON"},
        {"[]", "state: expected an object"},
        {"{\"revision\":1}", "state.format: required"},
        {"{\"format\":2,\"revision\":1}", "state.format: unsupported"},
        {"{\"format\":1,\"revision\":-1}", "state.revision"},
        {"{\"format\":1,\"revision\":1,\"secrets\":{}}", "state.secrets: expected an array"},
        {"{\"format\":1,\"revision\":1,\"secrets\":[{\"name\":\"a\"}]}", "state.secrets[0].scope"},
        {"{\"format\":1,\"revision\":1,\"runs\":[{\"id\":\"r\",\"scope\":{\"org\":\"a\"},"
         "\"pins\":[{\"id\":5}]}]}",
         "state.runs[0].pins[0].id: expected a string"},
    };
    for (const auto& [text, fragment] : cases) {
        auto r = snapshot_from_json(text);
        ASSERT_FALSE(r.ok()) << text;
        EXPECT_NE(r.error().find(fragment), std::string::npos) << text << " -> " << r.error();
    }
    StateSnapshot dup;
    dup.secrets["x"] = fake_secret("gh", scope("acme"));
    dup.secrets["y"] = fake_secret("gh", scope("acme"));
    auto r = snapshot_from_json(snapshot_to_json(dup));
    ASSERT_FALSE(r.ok());
    EXPECT_NE(r.error().find("duplicate secret"), std::string::npos);
}

// ---- resolution ----------------------------------------------------------------------------

TEST(ResolveSecret, MostSpecificMatchingScopeWins) {
    const Scope run = scope("acme", "web", "ana", "nightly");
    StateSnapshot s;
    const std::vector<Scope> all = {scope("acme"),
                                    scope("acme", "web"),
                                    scope("acme", "", "ana"),
                                    scope("acme", "", "", "nightly"),
                                    scope("acme", "api"),
                                    scope("other")};
    for (const Scope& sc : all) {
        s.secrets[secret_key("tok", sc)] = fake_secret("tok", sc);
    }
    s.secrets[secret_key("tok2", scope("acme", "web", "ana", "nightly"))] =
        fake_secret("tok2", scope("acme", "web", "ana", "nightly"));
    // A name that shares the prefix must not leak into the candidates.
    s.secrets[secret_key("to", scope("acme", "web", "ana", "nightly"))] =
        fake_secret("to", scope("acme", "web", "ana", "nightly"));

    std::vector<ScopeCandidate> chain;
    const SealedSecret* best = resolve_secret(s, "tok", run, &chain);
    ASSERT_NE(best, nullptr);
    EXPECT_EQ(best->scope, scope("acme", "", "", "nightly"));
    ASSERT_EQ(chain.size(), 6U);
    for (size_t i = 1; i < chain.size(); ++i) {
        EXPECT_GE(chain[i - 1].scope.specificity(), chain[i].scope.specificity());
    }
    EXPECT_EQ(chain[0].scope, scope("acme", "", "", "nightly"));
    EXPECT_TRUE(chain[0].matches);
    EXPECT_EQ(chain[1].scope, scope("acme", "", "ana"));
    EXPECT_TRUE(chain[1].matches);
    for (const ScopeCandidate& c : chain) {
        const bool should_match = c.scope != scope("acme", "api") && c.scope != scope("other");
        EXPECT_EQ(c.matches, should_match) << c.scope.to_string();
        EXPECT_EQ(c.version, 1U);
    }

    // The table: each run scope picks workflow > user > project > org among what matches.
    struct Case {
        Scope run;
        std::optional<Scope> expected;
    };
    const std::vector<Case> cases = {
        {run, scope("acme", "", "", "nightly")},
        {scope("acme", "web", "ana", "daily"), scope("acme", "", "ana")},
        {scope("acme", "web", "bob", "daily"), scope("acme", "web")},
        {scope("acme", "api", "bob"), scope("acme", "api")},
        {scope("acme", "ops", "bob"), scope("acme")},
        {scope("other", "web", "ana", "nightly"), scope("other")},
        {scope("nobody"), std::nullopt},
    };
    for (const Case& c : cases) {
        const SealedSecret* got = resolve_secret(s, "tok", c.run);
        if (!c.expected) {
            EXPECT_EQ(got, nullptr) << c.run.to_string();
            continue;
        }
        ASSERT_NE(got, nullptr) << c.run.to_string();
        EXPECT_EQ(got->scope, *c.expected) << c.run.to_string();
    }
    EXPECT_EQ(resolve_secret(s, "missing", run), nullptr);
    std::vector<ScopeCandidate> none;
    EXPECT_EQ(resolve_secret(s, "tok", scope("nobody"), &none), nullptr);
    EXPECT_EQ(none.size(), 6U);
    EXPECT_FALSE(none[0].matches);
}

// ---- FileStateStore ------------------------------------------------------------------------

TEST(FileStateStore, CreatesFolderAndSurvivesReopen) {
    TempDir tmp;
    const std::string dir = tmp.path() + "/var/state";
    auto store = FileStateStore::open(dir);
    ASSERT_TRUE(store.ok()) << store.error();
    struct stat st {};
    ASSERT_EQ(stat(dir.c_str(), &st), 0);
    EXPECT_EQ(st.st_mode & 0777, 0700U);
    EXPECT_EQ((*store)->snapshot()->revision, 0U);
    EXPECT_TRUE((*store)->snapshot()->secrets.empty());

    std::vector<uint64_t> seen;
    (*store)->on_change(
        [&](std::shared_ptr<const StateSnapshot> s) { seen.push_back(s->revision); });
    auto r1 = (*store)->apply({put_secret(fake_secret("gh", scope("acme")))});
    ASSERT_TRUE(r1.ok()) << r1.error();
    EXPECT_EQ(*r1, 1U);
    auto r2 = (*store)->apply(
        {put_run(full_run("run_1")), put_secret(fake_secret("gh", scope("acme", "web")))});
    ASSERT_TRUE(r2.ok()) << r2.error();
    EXPECT_EQ(*r2, 2U);
    EXPECT_EQ(seen, (std::vector<uint64_t>{1, 2}));
    ASSERT_EQ(stat((dir + "/state.json").c_str(), &st), 0);
    EXPECT_EQ(st.st_mode & 0777, 0600U);
    EXPECT_FALSE(fs::exists(dir + "/state.json.tmp"));

    auto before = (*store)->snapshot();
    store = FileStateStore::open(dir);
    ASSERT_TRUE(store.ok()) << store.error();
    expect_same_snapshot(*before, *(*store)->snapshot());
    auto r3 = (*store)->apply({delete_secret("gh")});
    ASSERT_TRUE(r3.ok());
    EXPECT_EQ(*r3, 3U);
}

TEST(FileStateStore, FailedBatchChangesNothing) {
    TempDir tmp;
    auto store = FileStateStore::open(tmp.path());
    ASSERT_TRUE(store.ok());
    ASSERT_TRUE((*store)->apply({put_secret(fake_secret("gh", scope("acme")))}).ok());
    const std::string file_before = read_file(tmp.path() + "/state.json");
    auto snap_before = (*store)->snapshot();
    int calls = 0;
    (*store)->on_change([&](std::shared_ptr<const StateSnapshot>) { ++calls; });

    auto failed = (*store)->apply({put_secret(fake_secret("npm", scope("acme"))),
                                   put_run(full_run("run_9")), delete_run("run_absent")});
    ASSERT_FALSE(failed.ok());
    EXPECT_EQ(failed.error(), "not_found: run run_absent");
    EXPECT_EQ((*store)->snapshot(), snap_before);
    EXPECT_EQ(read_file(tmp.path() + "/state.json"), file_before);
    EXPECT_EQ(calls, 0);
    store = FileStateStore::open(tmp.path());
    ASSERT_TRUE(store.ok());
    EXPECT_EQ((*store)->snapshot()->revision, 1U);
    EXPECT_EQ((*store)->snapshot()->secrets.size(), 1U);
    EXPECT_TRUE((*store)->snapshot()->runs.empty());
}

TEST(FileStateStore, StaleTempIgnoredAndCorruptFileRefused) {
    TempDir tmp;
    {
        auto store = FileStateStore::open(tmp.path());
        ASSERT_TRUE(store.ok());
        ASSERT_TRUE((*store)->apply({put_secret(fake_secret("gh", scope("acme")))}).ok());
    }
    std::ofstream(tmp.path() + "/state.json.tmp") << "{\"format\":1,\"revi";
    auto store = FileStateStore::open(tmp.path());
    ASSERT_TRUE(store.ok()) << store.error();
    EXPECT_EQ((*store)->snapshot()->revision, 1U);
    EXPECT_FALSE(fs::exists(tmp.path() + "/state.json.tmp"));

    std::ofstream(tmp.path() + "/state.json", std::ios::trunc) << "{\"format\":1,\"revi";
    auto corrupt = FileStateStore::open(tmp.path());
    ASSERT_FALSE(corrupt.ok());
    EXPECT_NE(corrupt.error().find(tmp.path() + "/state.json"), std::string::npos)
        << corrupt.error();

    const std::string not_dir = tmp.path() + "/state.json";
    EXPECT_FALSE(FileStateStore::open(not_dir).ok());
}

TEST(FileStateStore, CiphertextOnlyAtRest) {
    TempDir tmp;
    const std::string key_path = tmp.path() + "/master.key";
    auto kek = open_master_key_file(key_path, true);
    ASSERT_TRUE(kek.ok()) << kek.error();
    const std::string value = "ghp_AT_REST_MARKER_value_987";
    auto sealed = seal(**kek, "gh", scope("acme"), 1, value);
    ASSERT_TRUE(sealed.ok());
    auto store = FileStateStore::open(tmp.path() + "/state");
    ASSERT_TRUE(store.ok());
    ASSERT_TRUE((*store)->apply({put_secret(*sealed)}).ok());
    const std::string at_rest = read_file(tmp.path() + "/state/state.json");
    EXPECT_NE(at_rest.find(sealed->ciphertext), std::string::npos);
    EXPECT_EQ(at_rest.find(value), std::string::npos);
    EXPECT_EQ(at_rest.find(base64_encode(value)), std::string::npos);

    store = FileStateStore::open(tmp.path() + "/state");
    ASSERT_TRUE(store.ok());
    const SealedSecret* back = resolve_secret(*(*store)->snapshot(), "gh", scope("acme", "x"));
    ASSERT_NE(back, nullptr);
    EXPECT_EQ(unseal(**kek, *back).value()->reveal(), value);
}

// A child applies writes in a loop and reports each acknowledged revision on a pipe; it is
// killed with SIGKILL at a random moment. The reopened store must parse and hold every
// acknowledged write.
TEST(FileStateStore, KillNineLeavesAConsistentCompleteStore) {
    std::mt19937 rng(std::random_device{}());
    for (int round = 0; round < 3; ++round) {
        TempDir tmp;
        const std::string dir = tmp.path() + "/state";
        int fds[2];
        ASSERT_EQ(pipe(fds), 0);
        const pid_t pid = fork();
        ASSERT_GE(pid, 0);
        if (pid == 0) {
            close(fds[0]);
            auto store = FileStateStore::open(dir);
            if (!store.ok()) {
                _exit(2);
            }
            for (uint64_t i = 0; i < 100000; ++i) {
                RunRecord run = full_run("run_" + std::to_string(i % 7));
                run.expires_at = static_cast<int64_t>(i);
                auto rev = (*store)->apply(
                    {put_secret(fake_secret("s" + std::to_string(i), scope("acme"), i + 1)),
                     put_run(run)});
                if (!rev.ok()) {
                    _exit(3);
                }
                const uint64_t ack = *rev;
                if (write(fds[1], &ack, sizeof ack) != static_cast<ssize_t>(sizeof ack)) {
                    _exit(4);
                }
            }
            _exit(0);
        }
        close(fds[1]);
        std::uniform_int_distribution<int> delay_ms(100, 400);
        std::this_thread::sleep_for(std::chrono::milliseconds(delay_ms(rng)));
        kill(pid, SIGKILL);
        int status = 0;
        ASSERT_EQ(waitpid(pid, &status, 0), pid);
        ASSERT_TRUE(WIFSIGNALED(status)) << "child ended early with status " << status;
        uint64_t last_ack = 0;
        uint64_t ack = 0;
        size_t acks = 0;
        while (read(fds[0], &ack, sizeof ack) == static_cast<ssize_t>(sizeof ack)) {
            EXPECT_EQ(ack, last_ack + 1);
            last_ack = ack;
            ++acks;
        }
        close(fds[0]);

        auto store = FileStateStore::open(dir);
        ASSERT_TRUE(store.ok()) << store.error();
        auto snap = (*store)->snapshot();
        EXPECT_GE(snap->revision, last_ack) << "round " << round;
        EXPECT_LE(snap->revision, last_ack + 1);  // at most one write done but not acknowledged
        EXPECT_EQ(snap->secrets.size(), snap->revision);
        for (uint64_t i = 0; i < last_ack; ++i) {
            EXPECT_TRUE(snap->secrets.contains(secret_key("s" + std::to_string(i), scope("acme"))))
                << "acknowledged secret s" << i << " lost";
        }
        EXPECT_FALSE(fs::exists(dir + "/state.json.tmp"));
        // The store keeps working after the crash.
        auto next = (*store)->apply({put_secret(fake_secret("after", scope("acme")))});
        ASSERT_TRUE(next.ok()) << next.error();
        EXPECT_EQ(*next, snap->revision + 1);
        RecordProperty("acknowledged_writes_round_" + std::to_string(round),
                       static_cast<int>(acks));
    }
}

}  // namespace
}  // namespace egress::credstore

namespace egress::credstore {
namespace {

// Read-modify-write guards: what keeps two replicas (state.backend etcd) from losing each
// other's changes. Checked against the state the change is applied to.
TEST(ApplyMutations, APutSecretExpectingAVersionIsAConflictWhenTheStoredOneMoved) {
    StateSnapshot base;
    base.secrets[secret_key("gh", scope("acme"))] = fake_secret("gh", scope("acme"), 3);
    Mutation rotate = put_secret(fake_secret("gh", scope("acme"), 4));
    rotate.expect_version = 3;
    auto ok = apply_mutations(base, {rotate});
    ASSERT_TRUE(ok.ok()) << ok.error();
    EXPECT_EQ(ok->secrets.at(secret_key("gh", scope("acme"))).version, 4U);

    // Another writer already stored version 4: a second "3 → 4" must not replace it.
    auto late = apply_mutations(*ok, {rotate});
    ASSERT_FALSE(late.ok());
    EXPECT_EQ(late.error(), "conflict: secret gh (org=acme) changed (now version 4) meanwhile; "
                            "try again");

    Mutation create = put_secret(fake_secret("gh", scope("acme"), 1));
    create.expect_version = 0;
    auto exists = apply_mutations(base, {create});
    ASSERT_FALSE(exists.ok());
    EXPECT_NE(exists.error().find("already exists"), std::string::npos) << exists.error();
    auto gone = apply_mutations(StateSnapshot{}, {rotate});
    ASSERT_FALSE(gone.ok());
    EXPECT_NE(gone.error().find("was deleted"), std::string::npos) << gone.error();
}

TEST(ApplyMutations, APutRunExpectingARecordIsAConflictWhenTheStoredOneChanged) {
    StateSnapshot base;
    RunRecord read = full_run("run_1");
    read.revoked = false;
    base.runs["run_1"] = read;

    // Another replica revoked the run after this one read it to add a pin.
    StateSnapshot revoked = base;
    revoked.runs["run_1"].revoked = true;
    Mutation add_pin = put_run(read);
    add_pin.run.pins.pop_back();
    add_pin.expect_run = read;
    auto lost = apply_mutations(revoked, {add_pin});
    ASSERT_FALSE(lost.ok());
    EXPECT_EQ(lost.error(), "conflict: run run_1 changed meanwhile; try again");

    auto fine = apply_mutations(base, {add_pin});
    ASSERT_TRUE(fine.ok()) << fine.error();
    EXPECT_EQ(fine->runs.at("run_1").pins.size(), read.pins.size() - 1);
    auto absent = apply_mutations(StateSnapshot{}, {add_pin});
    ASSERT_FALSE(absent.ok());
    EXPECT_EQ(absent.error(), "not_found: run run_1");
}

}  // namespace
}  // namespace egress::credstore
