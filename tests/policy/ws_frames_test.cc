#include "policy/ws_frames.h"

#include <gtest/gtest.h>

#include <random>

#include "tests/policy/scrubber_definition.h"

namespace egress::policy {
namespace {

const std::vector<std::string> kNeedles = {"ghp_secretvalue0123"};

std::shared_ptr<const ScrubPlan> plan() { return std::make_shared<const ScrubPlan>(kNeedles); }

/// An unmasked server frame: FIN + opcode, the payload's length in the shortest form.
std::string frame(std::string_view payload, uint8_t first = 0x81) {
    std::string f(1, static_cast<char>(first));
    const uint64_t n = payload.size();
    if (n < 126) {
        f.push_back(static_cast<char>(n));
    } else if (n <= 0xffff) {
        f.push_back(static_cast<char>(126));
        f.push_back(static_cast<char>(n >> 8));
        f.push_back(static_cast<char>(n & 0xff));
    } else {
        f.push_back(static_cast<char>(127));
        for (int shift = 56; shift >= 0; shift -= 8) {
            f.push_back(static_cast<char>((n >> shift) & 0xff));
        }
    }
    f.append(payload);
    return f;
}

std::string scrubbed(std::string_view payload) {
    return testing::scrub_definition(kNeedles, payload);
}

/// Feeds `stream` in pieces of `step` bytes; what came out after each piece is returned.
std::string feed_in_steps(WsServerScrubber& s, std::string_view stream, size_t step) {
    std::string out;
    for (size_t at = 0; at < stream.size(); at += step) {
        EXPECT_TRUE(s.feed(stream.substr(at, step), out)) << s.error();
    }
    return out;
}

TEST(WebsocketAccept, IsTheRfcExample) {
    EXPECT_EQ(websocket_accept("dGhlIHNhbXBsZSBub25jZQ=="), "s3pPLMBiTxaQ9kYGzzhZRbK+xOo=");  // RFC 6455 1.3
    EXPECT_NE(websocket_accept("dGhlIHNhbXBsZSBub25jZR=="), "s3pPLMBiTxaQ9kYGzzhZRbK+xOo=");
}

TEST(WsServerScrubber, ReplacesAnEchoedSecretInsideTheFrameAndKeepsTheHeader) {
    WsServerScrubber s(plan());
    const std::string payload = "{\"echo\":\"Bearer ghp_secretvalue0123\"}";
    std::string out;
    ASSERT_TRUE(s.feed(frame(payload), out));
    EXPECT_EQ(out, frame(scrubbed(payload)));
    EXPECT_EQ(out.find("ghp_secretvalue0123"), std::string::npos);
    EXPECT_EQ(s.frames(), 1u);
}

TEST(WsServerScrubber, EveryWayOfCuttingTheStreamGivesTheSameBytes) {
    // Frames of the three length forms, a control frame between the pieces of a fragmented
    // message, an empty frame, and secrets across the reads' cuts.
    const std::string big(70'000, 'x');
    const std::string medium = std::string(300, 'a') + "ghp_secretvalue0123" + std::string(200, 'b');
    std::string stream = frame("ghp_secretvalue0123 first", 0x01) + frame("ping ghp_secretvalue0123", 0x89) +
                         frame("", 0x80) + frame(medium, 0x82) + frame(big + "ghp_secretvalue0123", 0x82) +
                         frame("close", 0x88);
    // The fragmented message leaves its first fragment's last 18 bytes (the needle's length
    // - 1) to its last fragment, across the ping.
    const std::string first = scrubbed("ghp_secretvalue0123 first");
    std::string expected = frame(first.substr(0, first.size() - 18), 0x01) +
                           frame(scrubbed("ping ghp_secretvalue0123"), 0x89) +
                           frame(first.substr(first.size() - 18), 0x80) +
                           frame(scrubbed(medium), 0x82) +
                           frame(scrubbed(big + "ghp_secretvalue0123"), 0x82) + frame("close", 0x88);
    for (size_t step : {1u, 2u, 3u, 7u, 64u, 4096u, 1u << 20}) {
        WsServerScrubber s(plan());
        const bool same = feed_in_steps(s, stream, step) == expected;  // not printed: 70 KB
        EXPECT_TRUE(same) << "pieces of " << step;
        EXPECT_EQ(s.frames(), 6u);
    }
}

TEST(WsServerScrubber, FindsASecretSplitAcrossTheFragmentsOfAMessage) {
    // "ghp_secret" | pong | "value0123 end": the client reads one message holding the secret.
    const std::string stream = frame("x ghp_secret", 0x01) + frame("pong", 0x8a) +
                               frame("value0123 end", 0x80);
    const std::string whole = scrubbed("x ghp_secretvalue0123 end");
    ASSERT_NE(whole, "x ghp_secretvalue0123 end");
    for (size_t step : {1u, 5u, 1u << 20}) {
        WsServerScrubber s(plan());
        const std::string out = feed_in_steps(s, stream, step);
        EXPECT_EQ(out.find("ghp_secret"), std::string::npos) << "pieces of " << step;
        // A fragment shorter than what it must leave sends nothing; the last one sends all.
        EXPECT_EQ(out, frame("", 0x01) + frame("pong", 0x8a) + frame(whole, 0x80))
            << "pieces of " << step;
    }
}

TEST(WsServerScrubber, AFragmentsTailWaitsForTheNextFragmentOnly) {
    // 118 bytes + the 18 the first fragment left: the last fragment's header takes the
    // 16-bit length form; the first fragment's bytes but its tail go at once.
    const std::string a(200, 'a');
    const std::string b(118, 'b');
    WsServerScrubber s(plan());
    std::string out;
    ASSERT_TRUE(s.feed(frame(a, 0x02), out));
    EXPECT_EQ(out, frame(a.substr(0, 182), 0x02)) << "sent before the next fragment came";
    ASSERT_TRUE(s.feed(frame(b, 0x80), out));
    EXPECT_EQ(out, frame(a.substr(0, 182), 0x02) + frame(a.substr(182) + b, 0x80));
    EXPECT_EQ(static_cast<uint8_t>(out[182 + 4 + 1]), 126u);
}

TEST(WsServerScrubber, RefusesAMessageBegunBeforeTheLastOneEnded) {
    WsServerScrubber s(plan());
    std::string out;
    ASSERT_TRUE(s.feed(frame("part one", 0x01), out));
    EXPECT_FALSE(s.feed(frame("another message", 0x81), out));
    EXPECT_STREQ(s.error(), "upstream_interleaved_message");
}

TEST(WsServerScrubber, AMessageEndingInANeedlesPrefixIsNotHeldForTheNextMessage) {
    // A body scrubber holds "ghp_sec" back until more bytes come; here the message is over,
    // and the server may say nothing more until the client answers.
    WsServerScrubber s(plan());
    const std::string payload = "token prefix ghp_sec";
    std::string out;
    ASSERT_TRUE(s.feed(frame(payload), out));
    EXPECT_EQ(out, frame(payload));
}

TEST(WsServerScrubber, APayloadTailWaitsOnlyForTheRestOfItsFrame) {
    WsServerScrubber s(plan());
    const std::string payload = "x ghp_secretvalue0123 y";
    const std::string f = frame(payload);
    const size_t cut = f.find("ghp_") + 6;  // inside the secret
    std::string out;
    ASSERT_TRUE(s.feed(std::string_view(f).substr(0, cut), out));
    // The payload so far (8 bytes) is shorter than the needle - 1: all of it waits.
    EXPECT_EQ(out.size(), cut - 8) << "the payload's last bytes wait";
    ASSERT_TRUE(s.feed(std::string_view(f).substr(cut), out));
    EXPECT_EQ(out, frame(scrubbed(payload)));
}

// Inside a frame whose payload comes in several reads, how much goes out after a read never
// depends on the bytes (the body scrubber's oracle, test_scrub_hold.py): a read ending in
// a needle's prefix releases as much as one ending in other text.
TEST(WsServerScrubber, AReadsReleaseDoesNotDependOnItsTail) {
    const std::string lead(40, '.');
    for (size_t k = 1; k < kNeedles[0].size(); ++k) {
        size_t sent[2] = {};
        for (int which = 0; which < 2; ++which) {
            const std::string text =
                lead + (which == 0 ? kNeedles[0].substr(0, k) : std::string(k, 'q')) + " end";
            const std::string f = frame(text);
            WsServerScrubber s(plan());
            std::string out;
            ASSERT_TRUE(s.feed(std::string_view(f).substr(0, 2 + lead.size() + k), out));
            sent[which] = out.size();
            ASSERT_TRUE(s.feed(std::string_view(f).substr(2 + lead.size() + k), out));
            EXPECT_EQ(out, frame(scrubbed(text)));
        }
        EXPECT_EQ(sent[0], sent[1]) << "prefix of length " << k;
        EXPECT_EQ(sent[0], 2 + lead.size() + k - (kNeedles[0].size() - 1)) << k;
    }
}

TEST(WsServerScrubber, AnUnfragmentedMessagesHeaderPassesAsItCame) {
    // A payload length whose bytes spell the secret's first bytes ("gh" = 0x67 0x68) is a
    // header, not text: it passes as it is.
    const std::vector<std::string> needles = {"gh"};
    WsServerScrubber s(std::make_shared<const ScrubPlan>(needles));
    std::string payload(0x6768, 'z');
    std::string f = frame(payload, 0x82);
    ASSERT_EQ(f.substr(2, 2), "gh");
    std::string out;
    ASSERT_TRUE(s.feed(f, out));
    EXPECT_EQ(out, f);
}

TEST(WsServerScrubber, RefusesMaskedFramesAndReservedBits) {
    {
        WsServerScrubber s(plan());
        std::string masked = frame("hi");
        masked[1] = static_cast<char>(masked[1] | 0x80);
        std::string out;
        EXPECT_FALSE(s.feed(masked, out));
        EXPECT_STREQ(s.error(), "upstream_masked_frame");
        EXPECT_FALSE(s.feed(frame("later"), out)) << "the stream stays refused";
    }
    {
        WsServerScrubber s(plan());
        std::string out;
        EXPECT_TRUE(s.feed(frame("ok"), out));
        EXPECT_FALSE(s.feed(frame("deflated", 0xc1), out));  // RSV1: permessage-deflate
        EXPECT_STREQ(s.error(), "upstream_reserved_bits");
        EXPECT_EQ(out, frame("ok"));
    }
}

// A 64-bit length with its top bit set (RFC 6455 5.2 forbids it) after a fragment that left
// bytes to the next: unsent + length wrapped, the next frame announced 17 bytes, and every
// later byte was held, never sent (a hostile upstream grew egressd by what it sent).
TEST(WsServerScrubber, RefusesALengthWithItsTopBitSet) {
    WsServerScrubber s(plan());
    std::string out;
    ASSERT_TRUE(s.feed(frame(std::string(100, 'x'), 0x01), out));  // text, FIN=0
    std::string huge = {static_cast<char>(0x80), static_cast<char>(127)};  // continuation, FIN
    const uint64_t len = ~uint64_t{0} - 19;  // 2^64 - 20
    for (int i = 7; i >= 0; --i) {
        huge.push_back(static_cast<char>((len >> (8 * i)) & 0xff));
    }
    const size_t before = out.size();
    EXPECT_FALSE(s.feed(huge + std::string(4096, 'y'), out));
    EXPECT_STREQ(s.error(), "upstream_bad_frame_length");
    EXPECT_EQ(out.size(), before);  // nothing of that frame, and nothing held for it
}

TEST(WsServerScrubber, WithoutNeedlesTheBytesPassAsTheyCame) {
    WsServerScrubber s(nullptr);
    std::mt19937 rng(7);
    std::string stream;
    for (int i = 0; i < 50; ++i) {
        stream += frame(std::string(rng() % 300, static_cast<char>('a' + i % 26)), 0x82);
    }
    EXPECT_EQ(feed_in_steps(s, stream, 13), stream);
}

}  // namespace
}  // namespace egress::policy
