#include "policy/scrubber.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <random>

#include "tests/policy/scrubber_definition.h"

namespace egress::policy {
namespace {

std::string whole(Scrubber& s, std::string_view body) {
    std::string out;
    s.feed(body, out);
    s.finish(out);
    return out;
}

// Feeds `body` split at `cuts` (sorted positions) and returns the output.
std::string split_feed(const std::vector<std::string>& needles, std::string_view body,
                       const std::vector<size_t>& cuts) {
    Scrubber s(needles);
    std::string out;
    size_t prev = 0;
    for (size_t cut : cuts) {
        s.feed(body.substr(prev, cut - prev), out);
        prev = cut;
    }
    s.feed(body.substr(prev), out);
    s.finish(out);
    return out;
}

// The same pieces through feed_in_place, each in its own buffer (as the proxy's relay buffer
// or HTTP/2 piece) behind `headroom` bytes of junk the scrubber may overwrite: what it returns
// is what would be sent. Where the held bytes fit the headroom, what it returns must lie in the
// piece's own buffer (no copy into `spill`).
std::string split_feed_in_place_with(const std::vector<std::string>& needles,
                                     std::string_view body, const std::vector<size_t>& cuts,
                                     size_t headroom) {
    Scrubber s(needles);
    std::string out;
    std::string spill;
    size_t prev = 0;
    for (size_t i = 0; i <= cuts.size(); ++i) {
        const size_t cut = i < cuts.size() ? cuts[i] : body.size();
        std::string buf(headroom, '#');
        buf.append(body.substr(prev, cut - prev));
        const std::span<char> piece(buf.data() + headroom, buf.size() - headroom);
        const size_t held = s.held();
        const std::string_view sent = s.feed_in_place(piece, headroom, i == cuts.size(), spill);
        if (held <= headroom && s.active()) {
            const bool in_buffer = sent.empty() || (sent.data() == piece.data() - held &&
                                                    sent.size() <= held + piece.size());
            if (!in_buffer) {
                return "<copied although " + std::to_string(held) + " held bytes fit>";
            }
        }
        out.append(sent);
        prev = cut;
    }
    return out;
}

// Without headroom (the copy into `spill`), with one that some held tails fit and with one
// they all fit: the three must send the same bytes.
std::string split_feed_in_place(const std::vector<std::string>& needles, std::string_view body,
                                const std::vector<size_t>& cuts) {
    const std::string none = split_feed_in_place_with(needles, body, cuts, 0);
    for (size_t headroom : {size_t{5}, size_t{64}}) {
        const std::string with = split_feed_in_place_with(needles, body, cuts, headroom);
        if (with != none) {
            return "<headroom " + std::to_string(headroom) + " sent: " + with + ">";
        }
    }
    return none;
}

TEST(Scrubber, InactiveIsIdentity) {
    Scrubber none;
    EXPECT_FALSE(none.active());
    EXPECT_EQ(whole(none, "abc"), "abc");
    Scrubber empty({"", ""});
    EXPECT_FALSE(empty.active());
    EXPECT_EQ(empty.scrub_value("x"), "x");
}

struct ValueCase {
    std::vector<std::string> needles;
    std::string input;
    std::string want;
};

class ScrubValueTest : public ::testing::TestWithParam<ValueCase> {};

TEST_P(ScrubValueTest, KeepsLengthAndReplaces) {
    const ValueCase& c = GetParam();
    Scrubber s(c.needles);
    const std::string got = s.scrub_value(c.input);
    EXPECT_EQ(got, c.want);
    EXPECT_EQ(got.size(), c.input.size());
    Scrubber streaming(c.needles);
    EXPECT_EQ(whole(streaming, c.input), c.want);
}

INSTANTIATE_TEST_SUITE_P(
    Table, ScrubValueTest,
    ::testing::Values(
        ValueCase{{"secret"}, "no match", "no match"}, ValueCase{{"secret"}, "secret", "[REDAC"},
        ValueCase{
            {"ghp_0123456789abcdef"}, "tok=ghp_0123456789abcdef;", "tok=[REDACTED]**********;"},
        ValueCase{{"0123456789"}, "x0123456789y", "x[REDACTED]y"},
        ValueCase{{"ab"}, "abab ab", "[R[R [R"}, ValueCase{{"s"}, "sss", "[[["},
        // Longest match wins at a position.
        ValueCase{{"abc", "abcdefgh"}, "abcdefgh!", "[REDACTE!"},
        ValueCase{{"abcdefgh", "abc"},
                  "abcdefg!",
                  "[RE"
                  "defg!"},
        // Overlapping needles: every byte of either occurrence is covered.
        ValueCase{{"abc", "bcdef"}, "abcdef", "[REDAC"}, ValueCase{{"aa"}, "aaaaa", "[REDA"},
        ValueCase{{"Bearer tok", "tok"}, "Bearer tok tok", "[REDACTED] [RE"}));

TEST(Scrubber, ScrubInPlaceChangesOnlyWhereANeedleOccurs) {
    Scrubber s({"tok", "Bearer tok"});
    std::string clean = "application/json";
    const char* before = clean.data();
    s.scrub_in_place(clean);
    EXPECT_EQ(clean, "application/json");
    EXPECT_EQ(clean.data(), before);  // same buffer: nothing copied
    std::string echoed = "seen=Bearer tok;end";
    s.scrub_in_place(echoed);
    EXPECT_EQ(echoed, "seen=[REDACTED];end");
    EXPECT_EQ(s.replacements(), 2U);  // occurrences: "Bearer tok" and the "tok" inside it
}

TEST(Scrubber, FieldsNamedAfterTheSecretAreDroppedAndValuesScrubbed) {
    Scrubber s({"Bearer sk-Tok9", "sk-Tok9"});
    std::vector<Header> fields = {{"content-type", "text/plain"},
                                  {"x-echo-sk-tok9", "1"},  // lowercased by an h2 upstream
                                  {"X-Seen", "Bearer sk-Tok9"},
                                  {"X-SK-TOK9-Suffix", "2"},
                                  {"x-sk-tok", "a prefix of the secret is not the secret"}};
    s.scrub_fields(fields);
    ASSERT_EQ(fields.size(), 3U);
    EXPECT_EQ(fields[0].name, "content-type");
    EXPECT_EQ(fields[1].name, "X-Seen");
    EXPECT_EQ(fields[1].value, "[REDACTED]****");
    EXPECT_EQ(fields[2].name, "x-sk-tok");
    EXPECT_EQ(s.replacements(), 4U);  // two names, and both needles in X-Seen's value

    Scrubber inactive;
    std::vector<Header> kept = {{"x-echo-sk-tok9", "1"}};
    inactive.scrub_fields(kept);
    EXPECT_EQ(kept.size(), 1U);
}

// Every piece but the last leaves exactly (longest needle - 1) bytes, or all it has when that
// is less, whatever they are; a match found before them still covers them when they go out.
TEST(Scrubber, HoldsBackExactlyLongestMinusOne) {
    Scrubber s({"abcdef"});
    std::string out;
    s.feed("xxabcde", out);
    EXPECT_EQ(out, "xx");
    s.feed("f", out);
    EXPECT_EQ(out, "xx[");
    s.feed("abc", out);
    EXPECT_EQ(out, "xx[RED");
    s.feed("x", out);
    EXPECT_EQ(out, "xx[REDA");
    s.finish(out);
    EXPECT_EQ(out, "xx[REDACabcx");
    EXPECT_EQ(s.replacements(), 1U);
}

TEST(Scrubber, FinishFlushesPartialMatch) {
    Scrubber s({"secret"});
    std::string out;
    s.feed("data secr", out);
    EXPECT_EQ(out, "data");
    EXPECT_EQ(s.held(), 5U);
    s.finish(out);
    EXPECT_EQ(out, "data secr");
    EXPECT_EQ(s.held(), 0U);
}

// The oracle this closes: a sandbox has a pinned upstream reflect text it chose at the end of
// a piece, and reads how much of the piece egressd sent at once (h1 chunk sizes, h2 DATA
// sizes). Holding back only bytes that begin a needle told it whether its guess was a prefix
// of the secret, byte by byte. Pieces of the same length must release the same bytes.
TEST(Scrubber, PiecesOfOneLengthReleaseTheSameWhateverTheirTail) {
    const std::vector<std::string> needles = {"sk-live-9f3a", "Bearer sk-live-9f3a"};
    const std::string lead = "data: you said ";
    // A needle's prefix of each length, and text of the same length that begins none.
    for (size_t k = 1; k < needles[1].size(); ++k) {
        const std::string right = lead + needles[1].substr(0, k);
        const std::string wrong = lead + std::string(k, 'q');
        std::vector<size_t> sizes[2];
        for (int which = 0; which < 2; ++which) {
            const std::string& piece = which == 0 ? right : wrong;
            Scrubber fed(needles);
            Scrubber in_place(needles);
            std::string spill;
            for (int round = 0; round < 3; ++round) {  // the first piece and later ones
                std::string out;
                fed.feed(piece, out);
                std::string copy = piece;
                const size_t n = in_place.feed_in_place(copy, false, spill).size();
                EXPECT_EQ(n, out.size()) << "k=" << k;
                sizes[which].push_back(out.size());
            }
            std::string rest;
            fed.finish(rest);
            sizes[which].push_back(rest.size());
        }
        EXPECT_EQ(sizes[0], sizes[1]) << "prefix of length " << k;
        // exactly: all but the longest needle's length - 1 (or nothing, when shorter)
        const size_t hold = needles[1].size() - 1;
        EXPECT_EQ(sizes[0][0], right.size() - std::min(hold, right.size())) << k;
    }
}

// The bytes held when a paused stream is released (finish() mid-stream) are scrubbed as far
// as they show, and the stream goes on as a new one.
TEST(Scrubber, AReleaseInTheMiddleGoesOnAsANewStream) {
    Scrubber s({"tok", "Bearer tok"});
    std::string out;
    s.feed("a tok b tok", out);  // all but 9 bytes go
    EXPECT_EQ(out, "a ");
    s.finish(out);  // the two "tok" in the held bytes are whole
    EXPECT_EQ(out, "a [RE b [RE");
    s.feed(" Bearer tok end", out);
    EXPECT_EQ(out, "a [RE b [RE [REDA");
    s.finish(out);  // a match found before the held bytes covers them
    EXPECT_EQ(out, "a [RE b [RE [REDACTED] end");
    EXPECT_EQ(s.replacements(), 4U);  // "Bearer tok" and the "tok" inside it
}

// Property: for every split position (and every pair of split positions), the streamed output
// equals the one-shot output, and no needle survives.
TEST(Scrubber, EverySplitPositionGivesTheSameResult) {
    const std::vector<std::vector<std::string>> needle_sets = {
        {"ghp_s3cr3t"}, {"ghp_s3cr3t", "Bearer ghp_s3cr3t"}, {"abc", "bcdef", "abcdefgh"},
        {"aa", "aaa"},  {"x:tok", "eDp0b2s=", "tok"},
    };
    const std::vector<std::string> bodies = {
        "{\"token\":\"ghp_s3cr3t\",\"auth\":\"Bearer ghp_s3cr3t\"}ghp_s3cr3",
        "abcdefghabcdefabcbcdefgh abc ab",
        "aaaaaaa a aa aaa",
        "x:tok eDp0b2s= tok tokx:to",
        "ghp_s3cr3ghp_s3cr3tghp_s3cr3t",
    };
    for (const auto& needles : needle_sets) {
        for (const std::string& body : bodies) {
            Scrubber one(needles);
            const std::string expected = one.scrub_value(body);
            ASSERT_EQ(expected.size(), body.size());
            for (const std::string& n : needles) {
                EXPECT_EQ(expected.find(n), std::string::npos) << n << " in " << expected;
            }
            for (size_t i = 0; i <= body.size(); ++i) {
                EXPECT_EQ(split_feed(needles, body, {i}), expected) << "cut " << i;
                EXPECT_EQ(split_feed_in_place(needles, body, {i}), expected) << "cut " << i;
                for (size_t j = i; j <= body.size(); ++j) {
                    ASSERT_EQ(split_feed(needles, body, {i, j}), expected)
                        << "cuts " << i << "," << j;
                }
            }
            // One byte at a time.
            std::vector<size_t> all;
            for (size_t i = 1; i < body.size(); ++i) {
                all.push_back(i);
            }
            EXPECT_EQ(split_feed(needles, body, all), expected);
            EXPECT_EQ(split_feed_in_place(needles, body, all), expected);
        }
    }
}

TEST(Scrubber, RandomBodiesAndSplits) {
    std::mt19937 rng(12345);
    const std::vector<std::string> needles = {"abab", "bab", "abba", "b"};
    for (int iter = 0; iter < 300; ++iter) {
        std::string body(static_cast<size_t>(rng() % 40), 'a');
        for (char& c : body) {
            c = "abx"[rng() % 3];
        }
        Scrubber one(needles);
        const std::string expected = one.scrub_value(body);
        for (const std::string& n : needles) {
            ASSERT_EQ(expected.find(n), std::string::npos) << body;
        }
        std::vector<size_t> cuts;
        for (size_t i = 1; i < body.size(); ++i) {
            if (rng() % 3 == 0) {
                cuts.push_back(i);
            }
        }
        ASSERT_EQ(split_feed(needles, body, cuts), expected) << body;
        ASSERT_EQ(split_feed_in_place(needles, body, cuts), expected) << body;
    }
}

// The search skips ahead with memmem on the needles that hold no other needle ("Bearer tok"
// holds "tok") and walks byte by byte near the end of each piece: both must find exactly what
// the definition does, one-shot and streamed, for needle sets that contain one another.
TEST(Scrubber, MatchesTheDefinitionOnRandomBodies) {
    std::mt19937 rng(777);
    const std::vector<std::vector<std::string>> needle_sets = {
        {"tok", "Bearer tok"},
        {"abab", "bab", "abba", "b"},
        {"xyzzy", "Basic eHl6enk=", "eHl6enk="},
        {"aXa", "aXaXa", "XaX"},
        {"ab", "zzabzz", "ab ab"},
    };
    const std::string alphabet = "abBtokXxyz ";
    for (const auto& needles : needle_sets) {
        for (int iter = 0; iter < 400; ++iter) {
            std::string body;
            const size_t len = rng() % 300;
            while (body.size() < len) {
                if (rng() % 8 == 0) {
                    body += needles[rng() % needles.size()];  // plant whole needles too
                } else {
                    body += alphabet[rng() % alphabet.size()];
                }
            }
            const std::string want = testing::scrub_definition(needles, body);
            Scrubber one(needles);
            ASSERT_EQ(one.scrub_value(body), want) << body;
            std::vector<size_t> cuts;
            for (size_t i = 1; i < body.size(); ++i) {
                if (rng() % 37 == 0) {
                    cuts.push_back(i);
                }
            }
            ASSERT_EQ(split_feed(needles, body, cuts), want) << body;
            ASSERT_EQ(split_feed_in_place(needles, body, cuts), want) << body;
        }
    }
}

TEST(Scrubber, LargeBodyStreams) {
    const std::string secret = "ghp_0123456789abcdefghijklmnopqrstuvwxyz";
    std::string body;
    for (int i = 0; i < 2000; ++i) {
        body += "filler-" + std::to_string(i) + (i % 97 == 0 ? secret : "");
    }
    Scrubber s({secret});
    std::string out;
    for (size_t off = 0; off < body.size(); off += 16384) {
        s.feed(std::string_view(body).substr(off, 16384), out);
    }
    s.finish(out);
    EXPECT_EQ(out.size(), body.size());
    EXPECT_EQ(out.find(secret), std::string::npos);
    EXPECT_EQ(s.replacements(), 21U);
}

// In place: the returned bytes are the piece's own (no copy) unless bytes were held back
// from the previous piece; held-back bytes are wiped in the piece; `last` flushes them.
TEST(Scrubber, FeedInPlaceRewritesThePieceAndHoldsBackAPrefix) {
    Scrubber s({"secret"});
    std::string spill;
    std::string a = "data secret more secr";
    const std::string_view out_a = s.feed_in_place(a, false, spill);
    EXPECT_EQ(out_a.data(), a.data());  // the piece itself, scrubbed where it lies
    EXPECT_EQ(out_a, "data [REDAC more");  // the replacement keeps the length
    EXPECT_EQ(a.substr(out_a.size()), std::string(5, '\0'));  // " secr" held back, wiped here
    std::string b = "et end";
    const std::string_view out_b = s.feed_in_place(b, true, spill);
    EXPECT_EQ(out_b.data(), spill.data());  // held bytes go first: the spill path
    EXPECT_EQ(out_b, " [REDAC end");
    EXPECT_EQ(s.replacements(), 2U);
    // With headroom in front of the next piece, the held bytes go there: no copy of the piece.
    Scrubber h({"secret"});
    std::string buf_a = "data secret more secr";
    EXPECT_EQ(h.feed_in_place(buf_a, false, spill), "data [REDAC more");
    std::string buf_b = std::string(8, '#') + "et end";
    const std::span<char> piece_b(buf_b.data() + 8, buf_b.size() - 8);
    const std::string_view sent_b = h.feed_in_place(piece_b, 8, true, spill);
    EXPECT_EQ(sent_b.data(), buf_b.data() + 3);  // the 5 held bytes just before the piece
    EXPECT_EQ(sent_b, " [REDAC end");
    EXPECT_EQ(h.held(), 0U);
    // Too little headroom for what is held: the copy, as without.
    Scrubber small({"secret"});
    std::string buf_c = "more secr";
    EXPECT_EQ(small.feed_in_place(buf_c, false, spill), "more");
    std::string buf_d = std::string(4, '#') + "et";
    const std::string_view sent_d =
        small.feed_in_place(std::span<char>(buf_d.data() + 4, 2), 4, true, spill);
    EXPECT_EQ(sent_d.data(), spill.data());
    EXPECT_EQ(sent_d, " [REDAC");
    std::string c = "plain";
    Scrubber inactive;
    EXPECT_EQ(inactive.feed_in_place(c, true, spill).data(), c.data());
}

}  // namespace
}  // namespace egress::policy
