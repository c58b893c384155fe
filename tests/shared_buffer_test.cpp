// Shared buffers (src/transport/shared_buffer.hpp): allocation and the
// registry, and a peer's mappings, here with this process as its own peer
// (/proc/self/fd works like /proc/<peer>/fd). Allreduces on shared buffers:
// collectives_test (AllreduceSharedBuffers) and debug_log_test.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstring>

#include "transport/shared_buffer.hpp"

namespace cohort::transport {
namespace {

TEST(SharedBuffer, AllocatedZeroedAlignedAndRegistered) {
  auto b = allocate_shared_buffer(10000);
  ASSERT_NE(b, nullptr);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(b.get()) % 4096, 0u);
  for (size_t i = 0; i < 10000; ++i) ASSERT_EQ(b[i], std::byte{0}) << i;
  SharedRef whole = find_shared_buffer(b.get(), 10000);
  EXPECT_NE(whole.id, 0u);
  EXPECT_EQ(whole.base, reinterpret_cast<uint64_t>(b.get()));
  EXPECT_GE(whole.len, 10000u);
  EXPECT_GE(whole.fd, 0);
  EXPECT_EQ(find_shared_buffer(b.get() + 100, 50).id, whole.id);  // inside: the same buffer
  EXPECT_EQ(find_shared_buffer(b.get() + 100, whole.len).id, 0u);  // runs past its end
  int heap = 0;
  EXPECT_EQ(find_shared_buffer(&heap, sizeof heap).id, 0u);
  auto other = allocate_shared_buffer(1);
  EXPECT_NE(find_shared_buffer(other.get(), 1).id, whole.id);  // ids are never shared
  const void* gone = b.get();
  b.reset();
  EXPECT_EQ(find_shared_buffer(gone, 1).id, 0u) << "a freed buffer must leave the registry";
}

TEST(SharedBuffer, PeerMappingSeesAndChangesTheOwnersBytes) {
  auto b = allocate_shared_buffer(1 << 20);
  auto* owner = reinterpret_cast<uint32_t*>(b.get());
  for (uint32_t i = 0; i < (1u << 18); ++i) owner[i] = i * 7;
  const SharedRef ref = find_shared_buffer(b.get(), 1 << 20);
  SharedMappings peer;
  std::string why;
  const uint64_t at = ref.base + 4096;
  auto* p = reinterpret_cast<uint32_t*>(peer.at(getpid(), ref, at, 8192, &why));
  ASSERT_NE(p, nullptr) << why;
  EXPECT_NE(static_cast<void*>(p), static_cast<void*>(owner + 1024)) << "a second mapping, not the owner's pointer";
  EXPECT_EQ(p[0], 1024u * 7);
  p[1] = 0xdeadbeef;  // a store through the peer's mapping reaches the owner
  EXPECT_EQ(owner[1025], 0xdeadbeefu);
  // The mapping is cached: the same buffer again gives the same address.
  EXPECT_EQ(peer.at(getpid(), ref, at, 8192, &why), reinterpret_cast<uint8_t*>(p));
}

TEST(SharedBuffer, WhatCannotBeMappedSaysWhy) {
  auto b = allocate_shared_buffer(4096);
  const SharedRef ref = find_shared_buffer(b.get(), 4096);
  SharedMappings peer;
  std::string why;
  EXPECT_EQ(peer.at(getpid(), SharedRef{}, 0, 1, &why), nullptr);
  EXPECT_EQ(why, "not a shared buffer");
  EXPECT_EQ(peer.at(getpid(), ref, ref.base + 4000, 200, &why), nullptr);  // past the end
  EXPECT_NE(why.find("not inside its shared buffer"), std::string::npos) << why;
  SharedRef closed = ref;
  closed.fd = 1000000;  // no such descriptor
  closed.id = ref.id + 1000;
  EXPECT_EQ(peer.at(getpid(), closed, closed.base, 1, &why), nullptr);
  EXPECT_NE(why.find("cannot open /proc/"), std::string::npos) << why;
  SharedRef wrong_size = ref;
  wrong_size.len = ref.len * 2;
  wrong_size.id = ref.id + 2000;
  EXPECT_EQ(peer.at(getpid(), wrong_size, ref.base, 1, &why), nullptr);
  EXPECT_NE(why.find("is not the shared buffer announced"), std::string::npos) << why;
}

TEST(SharedBuffer, LeastRecentlyUsedMappingsAreDroppedPastTheLimit) {
  SharedMappings peer;
  std::vector<std::shared_ptr<std::byte[]>> bufs;
  std::vector<SharedRef> refs;
  std::string why;
  auto map = [&](size_t i) {
    auto* p = peer.at(getpid(), refs[i], refs[i].base, 4096, &why);
    EXPECT_NE(p, nullptr) << why;
    return p;
  };
  for (size_t i = 0; i < SharedMappings::kMaxMappings; ++i) {
    bufs.push_back(allocate_shared_buffer(4096));
    refs.push_back(find_shared_buffer(bufs.back().get(), 1));
    map(i)[0] = static_cast<uint8_t>(i);
    EXPECT_EQ(static_cast<uint8_t>(bufs.back()[0]), static_cast<uint8_t>(i));
  }
  EXPECT_EQ(peer.size(), SharedMappings::kMaxMappings);
  map(0);  // buffer 0 used again: buffer 1 is now the least recently used
  bufs.push_back(allocate_shared_buffer(4096));
  refs.push_back(find_shared_buffer(bufs.back().get(), 1));
  map(refs.size() - 1);
  EXPECT_EQ(peer.size(), SharedMappings::kMaxMappings);
  EXPECT_TRUE(peer.holds(refs[0].id)) << "a buffer just used must not be evicted";
  EXPECT_FALSE(peer.holds(refs[1].id)) << "the least recently used one goes";
  EXPECT_EQ(map(1)[0], 1) << "mapped again on demand, same bytes";
  EXPECT_FALSE(peer.holds(refs[2].id));
}

}  // namespace
}  // namespace cohort::transport
