#include "proxy/h2_pool.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

namespace egress::proxy {
namespace {

bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

TEST(H2Pool, FreedBlocksAreReusedBySizeClass) {
    H2Pool pool;
    void* a = pool.allocate(40);  // 56 bytes with the header: the 64-byte class
    ASSERT_NE(a, nullptr);
    EXPECT_TRUE(aligned16(a));
    EXPECT_GE(H2Pool::usable_size(a), 40U);
    pool.release(a);
    EXPECT_EQ(pool.cached_bytes(), 64U);
    void* b = pool.allocate(48);  // same class: the same block again
    EXPECT_EQ(b, a);
    EXPECT_EQ(pool.cached_bytes(), 0U);
    void* c = pool.allocate(100);  // another class: a fresh block
    EXPECT_NE(c, a);
    pool.release(b);
    pool.release(c);
    pool.release(nullptr);
}

TEST(H2Pool, AWipingPoolZeroesBlocksAsTheyAreFreed) {
    for (const bool wipe : {false, true}) {
        H2Pool pool(wipe);
        auto* a = static_cast<unsigned char*>(pool.allocate(100));  // the 128-byte class
        ASSERT_NE(a, nullptr);
        std::memset(a, 'S', H2Pool::usable_size(a));
        pool.release(a);
        // The free list hands the same block back: what the freed block still holds is visible.
        auto* b = static_cast<unsigned char*>(pool.allocate(100));
        ASSERT_EQ(b, a);
        const size_t n = H2Pool::usable_size(b);
        const size_t left = static_cast<size_t>(std::count(b, b + n, 'S'));
        if (wipe) {
            EXPECT_EQ(left, 0U);
            EXPECT_EQ(static_cast<size_t>(std::count(b, b + n, 0)), n);
        } else {
            EXPECT_EQ(left, n);  // the plain pool does not touch freed blocks (the test can fail)
        }
        // A reallocation that moves the block copies it, then frees (and wipes) the old one.
        std::memset(b, 'T', n);
        auto* c = static_cast<unsigned char*>(pool.reallocate(b, 600));
        ASSERT_NE(c, nullptr);
        ASSERT_NE(c, b);
        EXPECT_EQ(static_cast<size_t>(std::count(c, c + n, 'T')), n);
        auto* d = static_cast<unsigned char*>(pool.allocate(100));  // b's block again
        ASSERT_EQ(d, b);
        EXPECT_EQ(static_cast<size_t>(std::count(d, d + n, 'T')), wipe ? 0U : n);
        pool.release(c);
        pool.release(d);
    }
}

TEST(H2Pool, EverySizeGetsAnAlignedBlockThatHoldsIt) {
    H2Pool pool;
    std::vector<void*> blocks;
    for (size_t n : {size_t{0}, size_t{1}, size_t{16}, size_t{17}, size_t{4080}, size_t{4081},
                     size_t{70000}}) {
        void* p = pool.allocate(n);
        ASSERT_NE(p, nullptr) << n;
        EXPECT_TRUE(aligned16(p)) << n;
        EXPECT_GE(H2Pool::usable_size(p), n);
        std::memset(p, 0xab, n);
        blocks.push_back(p);
    }
    for (void* p : blocks) {
        pool.release(p);
    }
    // The 70 000-byte block went back to malloc: only classed blocks are kept.
    EXPECT_LE(pool.cached_bytes(), H2Pool::kMaxCachedBytes);
    EXPECT_EQ(pool.allocate(size_t{SIZE_MAX} - 8), nullptr);
}

TEST(H2Pool, CachedMemoryIsBounded) {
    H2Pool pool;
    std::vector<void*> blocks;
    for (int i = 0; i < 200; ++i) {  // 200 x 1 KiB blocks: more than the cache keeps
        blocks.push_back(pool.allocate(1000));
    }
    for (void* p : blocks) {
        pool.release(p);
    }
    EXPECT_LE(pool.cached_bytes(), H2Pool::kMaxCachedBytes);
    EXPECT_GE(pool.cached_bytes(), H2Pool::kMaxCachedBytes - 1024);
    pool.trim();
    EXPECT_EQ(pool.cached_bytes(), 0U);
    void* again = pool.allocate(1000);  // a fresh block after the trim, still usable
    ASSERT_NE(again, nullptr);
    pool.release(again);
    EXPECT_EQ(pool.cached_bytes(), 1024U);
}

TEST(H2Pool, ReallocateKeepsTheBytesAcrossClassesAndLargeBlocks) {
    H2Pool pool;
    const std::string text = "nghttp2 buffers grow by realloc";
    char* p = static_cast<char*>(pool.reallocate(nullptr, text.size()));
    ASSERT_NE(p, nullptr);
    std::memcpy(p, text.data(), text.size());
    for (size_t n : {size_t{32}, size_t{500}, size_t{5000}, size_t{100000}, size_t{40}}) {
        p = static_cast<char*>(pool.reallocate(p, n));
        ASSERT_NE(p, nullptr) << n;
        EXPECT_GE(H2Pool::usable_size(p), n);
        EXPECT_EQ(std::string(p, text.size()), text) << n;
    }
    pool.release(p);
}

TEST(H2Pool, AllocateZeroedClearsAReusedBlockAndRefusesOverflow) {
    H2Pool pool;
    void* a = pool.allocate(64);
    std::memset(a, 0xff, 64);
    pool.release(a);
    auto* z = static_cast<unsigned char*>(pool.allocate_zeroed(8, 8));
    ASSERT_EQ(static_cast<void*>(z), a);  // the dirty block, reused
    for (int i = 0; i < 64; ++i) {
        EXPECT_EQ(z[i], 0) << i;
    }
    pool.release(z);
    EXPECT_EQ(pool.allocate_zeroed(SIZE_MAX / 2, 4), nullptr);
}

// nghttp2 itself on the pool: a client and a server session exchange a request and a
// response through their mem_send/mem_recv, all of their memory from two pools.
TEST(H2Pool, CarriesAnNghttp2Exchange) {
    H2Pool client_pool;
    H2Pool server_pool;
    nghttp2_session_callbacks* cbs = nullptr;
    ASSERT_EQ(nghttp2_session_callbacks_new(&cbs), 0);
    int requests = 0;
    nghttp2_session_callbacks_set_on_frame_recv_callback(
        cbs, [](nghttp2_session*, const nghttp2_frame* f, void* u) {
            if (f->hd.type == NGHTTP2_HEADERS && (f->hd.flags & NGHTTP2_FLAG_END_STREAM) != 0) {
                ++*static_cast<int*>(u);
            }
            return 0;
        });
    nghttp2_session* client = nullptr;
    nghttp2_session* server = nullptr;
    int responses = 0;
    ASSERT_EQ(nghttp2_session_client_new3(&client, cbs, &responses, nullptr, client_pool.mem()), 0);
    ASSERT_EQ(nghttp2_session_server_new3(&server, cbs, &requests, nullptr, server_pool.mem()), 0);
    nghttp2_session_callbacks_del(cbs);
    nghttp2_submit_settings(client, NGHTTP2_FLAG_NONE, nullptr, 0);
    nghttp2_submit_settings(server, NGHTTP2_FLAG_NONE, nullptr, 0);
    auto pump = [](nghttp2_session* from, nghttp2_session* to) {
        const uint8_t* data = nullptr;
        for (ssize_t n; (n = nghttp2_session_mem_send(from, &data)) > 0;) {
            ASSERT_EQ(nghttp2_session_mem_recv(to, data, static_cast<size_t>(n)), n);
        }
    };
    auto nv = [](const char* n, const char* v) {
        return nghttp2_nv{reinterpret_cast<uint8_t*>(const_cast<char*>(n)),
                          reinterpret_cast<uint8_t*>(const_cast<char*>(v)), std::strlen(n),
                          std::strlen(v), NGHTTP2_NV_FLAG_NONE};
    };
    for (int i = 0; i < 50; ++i) {
        const nghttp2_nv req[] = {nv(":method", "GET"), nv(":scheme", "https"),
                                  nv(":authority", "a.test"), nv(":path", "/x"),
                                  nv("x-custom-field", "value")};
        const int32_t id = nghttp2_submit_request(client, nullptr, req, 5, nullptr, nullptr);
        ASSERT_GT(id, 0);
        pump(client, server);
        const nghttp2_nv resp[] = {nv(":status", "204"), nv("x-reply", "ok")};
        ASSERT_EQ(nghttp2_submit_response(server, id, resp, 2, nullptr), 0);
        pump(server, client);
    }
    EXPECT_EQ(requests, 50);
    EXPECT_EQ(responses, 50);
    EXPECT_GT(client_pool.cached_bytes() + server_pool.cached_bytes(), 0U);  // blocks reused
    nghttp2_session_del(client);
    nghttp2_session_del(server);
}

}  // namespace
}  // namespace egress::proxy
