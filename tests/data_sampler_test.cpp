// DistributedSampler and torch_randperm: index for index what PyTorch 1.13 yields
// (fixtures written by tests/data/gen_sampler_fixtures.py), and the sampler's
// properties (disjoint shards with drop_last, full coverage with padding).
#include <gtest/gtest.h>

#include <algorithm>
#include <fstream>
#include <set>
#include <string>

#include <nlohmann/json.hpp>

#include "cohort/data.hpp"
#include "cohort/error.hpp"

namespace cohort::data {
namespace {

using nlohmann::json;

const json& fixtures() {
  static const json j = [] {
    const std::string path = std::string(COHORT_TEST_DATA_DIR) + "/sampler_fixtures.json";
    std::ifstream in(path);
    if (!in) throw std::runtime_error("cannot open " + path);
    return json::parse(in);
  }();
  return j;
}

// The fixture's FNV-1a 64 over each index as 8 little-endian bytes.
uint64_t fnv1a64(const std::vector<int64_t>& indices) {
  uint64_t h = 0xcbf29ce484222325ull;
  for (int64_t x : indices)
    for (int b = 0; b < 8; ++b) {
      h ^= (static_cast<uint64_t>(x) >> (8 * b)) & 0xff;
      h *= 0x100000001b3ull;
    }
  return h;
}

uint64_t seed_of(const json& c) {
  const json& s = c.at("seed");
  return s.is_number_unsigned() ? s.get<uint64_t>() : static_cast<uint64_t>(s.get<int64_t>());  // Python -1 wraps
}

// Empty when `got` is what the fixture case recorded, else what differs.
std::string mismatch(const json& c, const std::vector<int64_t>& got) {
  if (c.contains("indices")) {
    auto want = c.at("indices").get<std::vector<int64_t>>();
    if (got == want) return "";
    auto at = std::mismatch(got.begin(), got.end(), want.begin(), want.end());
    return "sizes " + std::to_string(got.size()) + " vs " + std::to_string(want.size()) + ", first difference at " +
           std::to_string(at.first - got.begin());
  }
  auto first = c.at("first").get<std::vector<int64_t>>();
  if (static_cast<int64_t>(got.size()) != c.at("count").get<int64_t>()) return "count " + std::to_string(got.size());
  if (!std::equal(first.begin(), first.end(), got.begin())) return "first indices differ";
  if (std::to_string(fnv1a64(got)) != c.at("fnv1a64").get<std::string>()) return "checksum differs";
  return "";
}

TEST(SamplerFixtures, MadeByTorch113) {
  EXPECT_EQ(fixtures().at("torch_version").get<std::string>().substr(0, 4), "1.13");
  EXPECT_GT(fixtures().at("randperm").size(), 30u);
  EXPECT_GT(fixtures().at("sampler").size(), 800u);
}

TEST(TorchRandperm, MatchesTorchForEveryFixture) {
  int failures = 0;
  for (const json& c : fixtures().at("randperm")) {
    std::string diff = mismatch(c, torch_randperm(c.at("n").get<int64_t>(), seed_of(c)));
    EXPECT_EQ(diff, "") << "torch.randperm case " << c.dump().substr(0, 120);
    if (!diff.empty() && ++failures == 10) FAIL() << "stopping after 10 mismatches";
  }
}

TEST(DistributedSampler, MatchesTorchForEveryFixture) {
  int failures = 0;
  for (const json& c : fixtures().at("sampler")) {
    SamplerOptions o{.num_replicas = c.at("num_replicas").get<int>(),
                     .rank = c.at("rank").get<int>(),
                     .shuffle = c.at("shuffle").get<bool>(),
                     .seed = seed_of(c),
                     .drop_last = c.at("drop_last").get<bool>()};
    DistributedSampler sampler(c.at("n").get<int64_t>(), o);
    sampler.set_epoch(c.at("epoch").get<int64_t>());
    std::vector<int64_t> got = sampler.indices();
    EXPECT_EQ(sampler.size(), c.at("size").get<int64_t>()) << c.dump().substr(0, 160);
    std::string diff = mismatch(c, got);
    EXPECT_EQ(diff, "") << "DistributedSampler case " << c.dump().substr(0, 160);
    if (!diff.empty() && ++failures == 10) FAIL() << "stopping after 10 mismatches";
  }
}

TEST(TorchRandperm, IsAPermutationAndSeedKeepsLow32Bits) {
  for (int64_t n : {0, 1, 2, 7, 1000}) {
    auto p = torch_randperm(n, 123);
    std::sort(p.begin(), p.end());
    for (int64_t i = 0; i < n; ++i) ASSERT_EQ(p[i], i);
  }
  // torch's mt19937 is seeded with the low 32 bits of the 64-bit seed.
  EXPECT_EQ(torch_randperm(500, 42), torch_randperm(500, (uint64_t{1} << 32) + 42));
  EXPECT_NE(torch_randperm(500, 42), torch_randperm(500, 43));
  EXPECT_THROW(torch_randperm(-1, 0), InvalidArgument);
}

std::vector<std::vector<int64_t>> all_ranks(int64_t n, SamplerOptions o, int64_t epoch) {
  std::vector<std::vector<int64_t>> out;
  for (o.rank = 0; o.rank < o.num_replicas; ++o.rank) out.push_back(sampler_indices(n, o, epoch));
  return out;
}

TEST(DistributedSampler, DropLastGivesDisjointEqualShards) {
  for (int64_t n : {0, 1, 5, 17, 64, 1001})
    for (int world : {1, 2, 3, 4, 7})
      for (bool shuffle : {false, true}) {
        auto shards = all_ranks(n, {.num_replicas = world, .shuffle = shuffle, .seed = 5, .drop_last = true}, 3);
        std::set<int64_t> seen;
        for (const auto& shard : shards) {
          ASSERT_EQ(static_cast<int64_t>(shard.size()), n / world) << "n " << n << " world " << world;
          for (int64_t i : shard) {
            ASSERT_TRUE(i >= 0 && i < n);
            ASSERT_TRUE(seen.insert(i).second) << "index " << i << " on two ranks (n " << n << ", world " << world << ")";
          }
        }
      }
}

TEST(DistributedSampler, PaddingCoversEverySampleAndRepeatsFromTheStart) {
  for (int64_t n : {1, 2, 5, 17, 64, 1001})
    for (int world : {1, 2, 3, 4, 7})
      for (bool shuffle : {false, true}) {
        SamplerOptions o{.num_replicas = world, .shuffle = shuffle, .seed = 9};
        auto shards = all_ranks(n, o, 2);
        const int64_t per_rank = (n + world - 1) / world;
        // Interleave the shards back into the padded order: position p is shard p % world, entry p / world.
        std::vector<int64_t> padded;
        for (int64_t p = 0; p < per_rank * world; ++p) {
          ASSERT_EQ(static_cast<int64_t>(shards[p % world].size()), per_rank);
          padded.push_back(shards[p % world][p / world]);
        }
        std::vector<int64_t> order = shuffle ? torch_randperm(n, 9 + 2) : std::vector<int64_t>();
        for (int64_t p = 0; p < static_cast<int64_t>(padded.size()); ++p)
          ASSERT_EQ(padded[p], shuffle ? order[p % n] : p % n) << "n " << n << " world " << world << " position " << p;
      }
}

TEST(DistributedSampler, PaddingLongerThanTheDataset) {
  // 2 samples, 7 ranks: PyTorch repeats the whole list until 7 entries.
  auto shards = all_ranks(2, {.num_replicas = 7, .shuffle = false}, 0);
  for (int r = 0; r < 7; ++r) EXPECT_EQ(shards[r], std::vector<int64_t>{r % 2});
  // With drop_last nobody gets anything.
  for (const auto& s : all_ranks(2, {.num_replicas = 7, .drop_last = true}, 0)) EXPECT_TRUE(s.empty());
}

TEST(DistributedSampler, EpochAndSeedChangeTheOrderDeterministically) {
  DistributedSampler a(1000, {.num_replicas = 2, .rank = 1, .seed = 7});
  DistributedSampler b(1000, {.num_replicas = 2, .rank = 1, .seed = 7});
  EXPECT_EQ(a.indices(), b.indices());
  auto epoch0 = a.indices();
  a.set_epoch(1);
  EXPECT_EQ(a.epoch(), 1);
  EXPECT_NE(a.indices(), epoch0);
  DistributedSampler c(1000, {.num_replicas = 2, .rank = 1, .seed = 8});
  EXPECT_NE(c.indices(), epoch0);
  // seed s at epoch e is seed s + e at epoch 0 (torch seeds with seed + epoch).
  DistributedSampler d(1000, {.num_replicas = 2, .rank = 1, .seed = 8});
  EXPECT_EQ(a.indices(), d.indices());
  EXPECT_EQ(a.size(), 500);
  EXPECT_EQ(a.dataset_size(), 1000);
}

TEST(DistributedSampler, BadOptionsSayWhatToFix) {
  auto message = [](int64_t n, SamplerOptions o) -> std::string {
    try {
      DistributedSampler s(n, o);
    } catch (const InvalidArgument& e) {
      return e.what();
    }
    return "(no exception)";
  };
  EXPECT_NE(message(10, {.num_replicas = 0}).find("num_replicas is 0; it must be at least 1"), std::string::npos);
  EXPECT_NE(message(10, {.num_replicas = -2}).find("num_replicas is -2"), std::string::npos);
  EXPECT_NE(message(10, {.num_replicas = 4, .rank = 4}).find("rank 4 is out of range for num_replicas 4; set it to "
                                                              "this process's rank in the group, 0 to 3"),
            std::string::npos);
  EXPECT_NE(message(10, {.num_replicas = 4, .rank = -1}).find("rank -1 is out of range"), std::string::npos);
  EXPECT_NE(message(-1, {}).find("dataset size is -1"), std::string::npos);
  EXPECT_THROW(sampler_indices(10, {.num_replicas = 2, .rank = 2}, 0), InvalidArgument);
  EXPECT_THROW(sampler_num_samples(10, {.num_replicas = 0}), InvalidArgument);
}

}  // namespace
}  // namespace cohort::data
