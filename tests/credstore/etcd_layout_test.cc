// The pure half of the etcd backend: the key layout, watched keys applied to a view, and the
// transaction planned from a view to the next state. The network half (proxy/etcd_store.cc)
// is tested against a real etcd in tests/integration/test_fleet.py.
#include "credstore/etcd_layout.h"

#include <gtest/gtest.h>

#include "records.h"

namespace egress::credstore::etcd {
namespace {

const std::string kPrefix = "/egressd/";

SealedSecret secret(const std::string& name, const std::string& org, uint64_t version = 1) {
    return test_records::fake_secret(name, Scope{org, "", "", ""}, version);
}

RunRecord run(const std::string& id, int64_t expires_at = 1700001800) {
    RunRecord r;
    r.id = id;
    r.scope = Scope{"acme", "", "", ""};
    r.token_sha256 = std::string(64, 'f');
    r.created_at = 1700000000;
    r.expires_at = expires_at;
    r.ca_cert_pem = "-----BEGIN CERTIFICATE-----\nMIIB\n-----END CERTIFICATE-----\n";
    r.ca_key = secret("ca:" + id, "acme");
    return r;
}

/// A view holding `snap`, each record at mod revision `rev`, as a range answer would give.
View view_of(const StateSnapshot& snap, int64_t rev) {
    StateSnapshot s;
    std::map<std::string, int64_t> revs;
    for (const auto& [k, v] : snap.secrets) {
        EXPECT_TRUE(apply_kv(s, revs, kPrefix, secret_path(kPrefix, v), secret_record_to_json(v), rev)
                        .ok());
    }
    for (const auto& [id, r] : snap.runs) {
        EXPECT_TRUE(apply_kv(s, revs, kPrefix, run_path(kPrefix, id), run_record_to_json(r), rev)
                        .ok());
    }
    View v;
    v.snap = std::make_shared<const StateSnapshot>(std::move(s));
    v.mod_revisions = std::move(revs);
    return v;
}

TEST(EtcdLayout, KeysLiveUnderThePrefixOneRecordEach) {
    EXPECT_EQ(secret_path(kPrefix, secret("gh", "acme")), "/egressd/secrets/gh@org=acme");
    EXPECT_EQ(run_path(kPrefix, "run_1"), "/egressd/runs/run_1");
}

TEST(EtcdLayout, PrefixRangeEndIsThePrefixWithItsLastByteIncremented) {
    EXPECT_EQ(prefix_range_end("/egressd/"), "/egressd0");
    EXPECT_EQ(prefix_range_end(std::string("a\xff", 2)), "b");
    EXPECT_EQ(prefix_range_end(std::string("\xff\xff", 2)), std::string(1, '\0'));
}

TEST(EtcdLayout, PutsAndDeletesOfWatchedKeysChangeTheView) {
    StateSnapshot snap;
    std::map<std::string, int64_t> revs;
    const SealedSecret gh = secret("gh", "acme");
    ASSERT_TRUE(apply_kv(snap, revs, kPrefix, secret_path(kPrefix, gh), secret_record_to_json(gh), 5)
                    .ok());
    ASSERT_TRUE(apply_kv(snap, revs, kPrefix, run_path(kPrefix, "run_1"),
                         run_record_to_json(run("run_1")), 6)
                    .ok());
    ASSERT_EQ(snap.secrets.count("gh@org=acme"), 1U);
    EXPECT_EQ(snap.secrets.at("gh@org=acme").ciphertext, gh.ciphertext);
    ASSERT_EQ(snap.runs.count("run_1"), 1U);
    EXPECT_EQ(snap.runs.at("run_1").ca_key.name, "ca:run_1");
    EXPECT_EQ(revs.at("/egressd/secrets/gh@org=acme"), 5);
    EXPECT_EQ(revs.at("/egressd/runs/run_1"), 6);

    ASSERT_TRUE(apply_kv(snap, revs, kPrefix, run_path(kPrefix, "run_1"), std::nullopt, 7).ok());
    EXPECT_EQ(snap.runs.count("run_1"), 0U);
    EXPECT_EQ(revs.count("/egressd/runs/run_1"), 0U);
    EXPECT_EQ(snap.secrets.size(), 1U);
}

TEST(EtcdLayout, KeysOutsideTheLayoutAreIgnored) {
    StateSnapshot snap;
    std::map<std::string, int64_t> revs;
    auto other_prefix = apply_kv(snap, revs, kPrefix, "/other/secrets/x@org=a", "{}", 3);
    auto other_kind = apply_kv(snap, revs, kPrefix, "/egressd/leases/x", "{}", 3);
    ASSERT_TRUE(other_prefix.ok());
    ASSERT_TRUE(other_kind.ok());
    EXPECT_FALSE(*other_prefix);
    EXPECT_FALSE(*other_kind);
    EXPECT_TRUE(snap.secrets.empty());
    EXPECT_TRUE(revs.empty());
}

// Fail closed: a record that no longer parses is not served with the value it had before (a
// revoked run would have gone on), and its key keeps its revision, so a write can replace or
// delete it (guarded by a stale revision, every write to it had failed).
TEST(EtcdLayout, ARecordThatDoesNotParseIsDroppedAndItsRevisionKept) {
    StateSnapshot snap;
    std::map<std::string, int64_t> revs;
    const SealedSecret gh = secret("gh", "acme");
    const std::string key = secret_path(kPrefix, gh);
    ASSERT_TRUE(apply_kv(snap, revs, kPrefix, key, secret_record_to_json(gh), 5).ok());
    ASSERT_TRUE(apply_kv(snap, revs, kPrefix, run_path(kPrefix, "run_1"),
                         run_record_to_json(run("run_1")), 6)
                    .ok());

    auto bad = apply_kv(snap, revs, kPrefix, key, "{not json", 9);
    ASSERT_FALSE(bad.ok());
    EXPECT_NE(bad.error().find(key), std::string::npos) << bad.error();
    EXPECT_EQ(snap.secrets.count("gh@org=acme"), 0U);
    EXPECT_EQ(revs.at(key), 9);
    auto bad_run = apply_kv(snap, revs, kPrefix, run_path(kPrefix, "run_1"), "[]", 10);
    ASSERT_FALSE(bad_run.ok());
    EXPECT_TRUE(snap.runs.empty());
    EXPECT_EQ(revs.at(run_path(kPrefix, "run_1")), 10);
    // A write of the name again is planned against the unreadable record's revision.
    View v;
    v.snap = std::make_shared<const StateSnapshot>(snap);
    v.mod_revisions = revs;
    StateSnapshot next = snap;
    next.secrets["gh@org=acme"] = gh;
    const TxnPlan plan = plan_txn(v, next, kPrefix);
    ASSERT_EQ(plan.puts.size(), 1U);
    EXPECT_EQ(plan.expect.at(key), 9);
    ASSERT_TRUE(apply_kv(snap, revs, kPrefix, key, secret_record_to_json(gh), 12).ok());

    // A record under another record's key (a hand edit, a bug) is refused, not filed there.
    auto moved = apply_kv(snap, revs, kPrefix, "/egressd/secrets/npm@org=acme",
                          secret_record_to_json(gh), 10);
    ASSERT_FALSE(moved.ok());
    EXPECT_NE(moved.error().find("holds secret gh@org=acme"), std::string::npos) << moved.error();
    auto run_moved = apply_kv(snap, revs, kPrefix, run_path(kPrefix, "run_2"),
                              run_record_to_json(run("run_1")), 11);
    ASSERT_FALSE(run_moved.ok());
    EXPECT_EQ(snap.secrets.size(), 1U);  // gh, written again above
    EXPECT_TRUE(snap.runs.empty());
}

TEST(EtcdLayout, NoChangeIsAnEmptyPlan) {
    StateSnapshot s;
    s.secrets["gh@org=acme"] = secret("gh", "acme");
    s.runs["run_1"] = run("run_1");
    const View v = view_of(s, 4);
    EXPECT_TRUE(plan_txn(v, *v.snap, kPrefix).empty());
}

TEST(EtcdLayout, ThePlanWritesOnlyChangedRecordsGuardedByTheirRevisions) {
    StateSnapshot s;
    s.secrets["gh@org=acme"] = secret("gh", "acme");
    s.secrets["npm@org=acme"] = secret("npm", "acme");
    s.runs["run_1"] = run("run_1");
    s.runs["run_2"] = run("run_2");
    const View base = view_of(s, 4);

    StateSnapshot next = *base.snap;
    next.secrets["gh@org=acme"] = secret("gh", "acme", 2);  // rotated
    next.secrets["s3@org=acme"] = secret("s3", "acme");     // new
    next.runs.erase("run_2");                               // deleted
    next.runs["run_1"].revoked = true;                      // revoked
    auto plan = plan_txn(base, next, kPrefix);

    ASSERT_EQ(plan.puts.size(), 3U);
    ASSERT_EQ(plan.deletes.size(), 1U);
    EXPECT_EQ(plan.deletes[0], "/egressd/runs/run_2");
    std::map<std::string, const TxnPlan::Put*> puts;
    for (const auto& p : plan.puts) {
        puts[p.key] = &p;
    }
    ASSERT_EQ(puts.count("/egressd/secrets/gh@org=acme"), 1U);
    ASSERT_EQ(puts.count("/egressd/secrets/s3@org=acme"), 1U);
    ASSERT_EQ(puts.count("/egressd/runs/run_1"), 1U);
    EXPECT_EQ(puts.count("/egressd/secrets/npm@org=acme"), 0U);  // unchanged: not written
    // Secrets carry no lease; a run rewritten with the same expiry keeps the lease it has.
    EXPECT_FALSE(puts["/egressd/secrets/gh@org=acme"]->run_expires_at.has_value());
    EXPECT_FALSE(puts["/egressd/secrets/gh@org=acme"]->keep_lease);
    EXPECT_FALSE(puts["/egressd/runs/run_1"]->run_expires_at.has_value());
    EXPECT_TRUE(puts["/egressd/runs/run_1"]->keep_lease);
    // A new run's put carries its expiry (its key gets a lease ending after it).
    StateSnapshot with_new = *base.snap;
    with_new.runs["run_3"] = run("run_3");
    const auto created = plan_txn(base, with_new, kPrefix);
    ASSERT_EQ(created.puts.size(), 1U);
    ASSERT_TRUE(created.puts[0].run_expires_at.has_value());
    EXPECT_EQ(*created.puts[0].run_expires_at, 1700001800);
    EXPECT_FALSE(created.puts[0].keep_lease);

    // Every written or deleted key is guarded: existing ones by the revision the view saw,
    // a new one by 0 (it must still be absent); untouched keys are not compared.
    EXPECT_EQ(plan.expect.size(), 4U);
    EXPECT_EQ(plan.expect.at("/egressd/secrets/gh@org=acme"), 4);
    EXPECT_EQ(plan.expect.at("/egressd/secrets/s3@org=acme"), 0);
    EXPECT_EQ(plan.expect.at("/egressd/runs/run_1"), 4);
    EXPECT_EQ(plan.expect.at("/egressd/runs/run_2"), 4);

    // The plan is faithful: replaying it as watch events on the base gives `next`.
    StateSnapshot replay = *base.snap;
    std::map<std::string, int64_t> revs = base.mod_revisions;
    for (const auto& p : plan.puts) {
        ASSERT_TRUE(apply_kv(replay, revs, kPrefix, p.key, p.value, 5).ok());
    }
    for (const auto& k : plan.deletes) {
        ASSERT_TRUE(apply_kv(replay, revs, kPrefix, k, std::nullopt, 5).ok());
    }
    EXPECT_EQ(snapshot_to_json(replay), snapshot_to_json(next));
}

}  // namespace
}  // namespace egress::credstore::etcd
