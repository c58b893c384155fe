// Loader: batches in sampler order, the prefetch bound, worker exceptions,
// deadlines, and a destructor that never hangs.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <mutex>
#include <stdexcept>
#include <thread>

#include "cohort/data.hpp"
#include "cohort/error.hpp"

namespace cohort::data {
namespace {

using namespace std::chrono_literals;

// Sample i is x = {i, -i}, y = 10 i. Optionally throws at one index, or blocks
// every get() until release() (to hold the worker mid-batch).
class CountingDataset : public Dataset {
 public:
  explicit CountingDataset(int64_t n) : n_(n) {}
  int64_t size() const override { return n_; }
  std::vector<int64_t> sample_shape() const override { return {2}; }
  void get(int64_t index, float* x, int64_t* y) const override {
    if (gated_) {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait(lock, [&] { return released_; });
    }
    if (index == throw_at_) throw std::out_of_range("sample " + std::to_string(index) + " is unreadable");
    x[0] = static_cast<float>(index);
    x[1] = -static_cast<float>(index);
    *y = 10 * index;
    ++fetched_;
  }
  int64_t fetched() const { return fetched_.load(); }
  void throw_at(int64_t i) { throw_at_ = i; }
  void gate() { gated_ = true; }
  void release() {
    std::lock_guard<std::mutex> lock(mu_);
    released_ = true;
    cv_.notify_all();
  }

 private:
  int64_t n_;
  int64_t throw_at_ = -1;
  bool gated_ = false;
  mutable std::atomic<int64_t> fetched_{0};
  mutable std::mutex mu_;
  mutable std::condition_variable cv_;
  bool released_ = false;
};

// Waits (up to 10 s) until the dataset has served `count` samples.
bool wait_fetched(const CountingDataset& ds, int64_t count) {
  for (auto deadline = std::chrono::steady_clock::now() + 10s; std::chrono::steady_clock::now() < deadline;) {
    if (ds.fetched() >= count) return true;
    std::this_thread::sleep_for(1ms);
  }
  return false;
}

TEST(Loader, BatchesFollowTheSamplerOrder) {
  CountingDataset ds(103);
  DistributedSampler sampler(ds.size(), {.num_replicas = 3, .rank = 1, .seed = 4});
  sampler.set_epoch(2);
  const std::vector<int64_t> order = sampler.indices();  // 35 indices
  for (bool drop_last : {false, true}) {
    Loader loader(ds, order, {.batch_size = 8, .drop_last = drop_last});
    EXPECT_EQ(loader.num_batches(), drop_last ? 4 : 5);
    std::vector<int64_t> seen;
    int64_t number = 0;
    while (auto batch = loader.next()) {
      const int64_t rows = batch->size();
      EXPECT_EQ(batch->number, number++);
      EXPECT_EQ(rows, number == 5 ? 3 : 8);
      EXPECT_EQ(batch->x_shape, (std::vector<int64_t>{rows, 2}));
      EXPECT_EQ(batch->y_shape, (std::vector<int64_t>{rows}));
      for (int64_t i = 0; i < rows; ++i) {
        const int64_t index = batch->indices[i];
        EXPECT_EQ(batch->x[2 * i], static_cast<float>(index));
        EXPECT_EQ(batch->x[2 * i + 1], -static_cast<float>(index));
        EXPECT_EQ(batch->y[i], 10 * index);
        seen.push_back(index);
      }
    }
    EXPECT_EQ(number, loader.num_batches());
    EXPECT_EQ(seen, drop_last ? std::vector<int64_t>(order.begin(), order.begin() + 32) : order);
    EXPECT_FALSE(loader.next().has_value());  // stays at the end
  }
}

TEST(Loader, EmptyIndexListEndsAtOnce) {
  CountingDataset ds(5);
  Loader loader(ds, {}, {.batch_size = 4});
  EXPECT_EQ(loader.num_batches(), 0);
  EXPECT_FALSE(loader.next().has_value());
}

TEST(Loader, TransformRunsOnEverySample) {
  CountingDataset ds(10);
  Loader loader(ds, {3, 1, 4}, {.batch_size = 2, .transform = [](int64_t index, float* x, int64_t* y) {
                                  x[0] += 0.5f;
                                  *y = index + 1;
                                }});
  auto a = loader.next(), b = loader.next();
  ASSERT_TRUE(a && b);
  EXPECT_EQ(a->x, (std::vector<float>{3.5f, -3, 1.5f, -1}));
  EXPECT_EQ(a->y, (std::vector<int64_t>{4, 2}));
  EXPECT_EQ(b->y, (std::vector<int64_t>{5}));
}

TEST(Loader, WorkerStaysAtMostPrefetchBatchesAhead) {
  for (int prefetch : {1, 2, 3}) {
    CountingDataset ds(1000);
    std::vector<int64_t> order(1000);
    for (int i = 0; i < 1000; ++i) order[i] = i;
    Loader loader(ds, order, {.batch_size = 10, .prefetch = prefetch});
    ASSERT_TRUE(wait_fetched(ds, 10 * prefetch));
    std::this_thread::sleep_for(20ms);  // had it overrun the bound, it would show by now
    EXPECT_EQ(ds.fetched(), 10 * prefetch);
    ASSERT_TRUE(loader.next());
    ASSERT_TRUE(wait_fetched(ds, 10 * (prefetch + 1)));
    std::this_thread::sleep_for(20ms);
    EXPECT_EQ(ds.fetched(), 10 * (prefetch + 1));
  }
}

TEST(Loader, PrefetchDepthComesFromTheKnob) {
  ::setenv("COHORT_PREFETCH_BATCHES", "3", 1);
  {
    CountingDataset ds(100);
    Loader loader(ds, std::vector<int64_t>(100, 7), {.batch_size = 5});
    ASSERT_TRUE(wait_fetched(ds, 15));
    std::this_thread::sleep_for(20ms);
    EXPECT_EQ(ds.fetched(), 15);
  }
  ::setenv("COHORT_PREFETCH_BATCHES", "0", 1);
  CountingDataset ds(1);
  EXPECT_THROW(Loader(ds, {0}), InvalidArgument);
  ::unsetenv("COHORT_PREFETCH_BATCHES");
}

TEST(Loader, DatasetExceptionReachesNextAfterTheGoodBatches) {
  CountingDataset ds(50);
  ds.throw_at(23);
  std::vector<int64_t> order(50);
  for (int i = 0; i < 50; ++i) order[i] = i;
  Loader loader(ds, order, {.batch_size = 10});
  ASSERT_TRUE(loader.next());  // 0..9
  ASSERT_TRUE(loader.next());  // 10..19
  EXPECT_THROW(
      {
        try {
          loader.next();  // 20..29 holds 23
        } catch (const std::out_of_range& e) {
          EXPECT_STREQ(e.what(), "sample 23 is unreadable");
          throw;
        }
      },
      std::out_of_range);
  EXPECT_THROW(loader.next(), std::out_of_range);  // and again: the epoch cannot go on
}

TEST(Loader, DestructorDoesNotHangWithPendingBatches) {
  CountingDataset ds(10000);
  std::vector<int64_t> order(10000);
  for (int i = 0; i < 10000; ++i) order[i] = i;
  { Loader untouched(ds, order, {.batch_size = 10}); }  // worker may be anywhere
  {
    Loader full(ds, order, {.batch_size = 10, .prefetch = 2});
    ASSERT_TRUE(full.next());
    ASSERT_TRUE(wait_fetched(ds, 30));  // queue full again: the worker waits for room
  }
  SUCCEED();
}

TEST(Loader, MoveKeepsTheEpochGoing) {
  CountingDataset ds(30);
  std::vector<int64_t> order = {4, 8, 15, 16, 23, 29};
  Loader first(ds, order, {.batch_size = 2});
  ASSERT_EQ(first.next()->indices, (std::vector<int64_t>{4, 8}));
  Loader second = std::move(first);
  EXPECT_THROW(first.next(), InvalidArgument);  // NOLINT(bugprone-use-after-move): the contract under test
  ASSERT_EQ(second.next()->indices, (std::vector<int64_t>{15, 16}));
  second = Loader(ds, order, {.batch_size = 4});  // stops the old worker, starts over
  ASSERT_EQ(second.next()->indices, (std::vector<int64_t>{4, 8, 15, 16}));
}

TEST(Loader, NextTimesOutWhileTheWorkerIsStuck) {
  CountingDataset ds(10);
  ds.gate();
  Loader loader(ds, {1, 2, 3}, {.batch_size = 2, .timeout = 50ms});
  try {
    loader.next();
    ADD_FAILURE() << "next() returned while every get() was blocked";
  } catch (const TimeoutError& e) {
    EXPECT_NE(std::string(e.what()).find("batch 0 of 2 was not ready after 0.05 s"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("COHORT_LOADER_TIMEOUT"), std::string::npos);
  }
  ds.release();  // the loader is still usable once the worker moves again
  auto batch = loader.next();
  ASSERT_TRUE(batch);
  EXPECT_EQ(batch->indices, (std::vector<int64_t>{1, 2}));
}

TEST(Loader, HugeTimeoutMeansWaitAsLongAsItTakes) {
  CountingDataset ds(10);
  // milliseconds::max() (a common "forever") used to overflow into a deadline in the past.
  Loader loader(ds, {1, 2, 3}, {.batch_size = 2, .timeout = std::chrono::milliseconds::max()});
  auto batch = loader.next();
  ASSERT_TRUE(batch);
  EXPECT_EQ(batch->indices, (std::vector<int64_t>{1, 2}));
  ::setenv("COHORT_LOADER_TIMEOUT", "1e300", 1);
  Loader from_knob(ds, {4, 5}, {.batch_size = 2});
  EXPECT_TRUE(from_knob.next());
  ::setenv("COHORT_LOADER_TIMEOUT", "0", 1);  // every batch would time out: refused, naming the knob
  try {
    Loader zero(ds, {4, 5}, {.batch_size = 2});
    ADD_FAILURE() << "COHORT_LOADER_TIMEOUT=0 was accepted";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("COHORT_LOADER_TIMEOUT=0"), std::string::npos) << e.what();
  }
  ::unsetenv("COHORT_LOADER_TIMEOUT");
}

TEST(Loader, BatchFnProducer) {
  auto square = [](std::span<const int64_t> indices, Batch& out) {
    out.x_shape = {static_cast<int64_t>(indices.size())};
    out.y_shape = {static_cast<int64_t>(indices.size())};
    for (int64_t i : indices) {
      out.x.push_back(static_cast<float>(i * i));
      out.y.push_back(i);
    }
  };
  Loader loader(square, {5, 6, 7}, {.batch_size = 2});
  EXPECT_EQ(loader.next()->x, (std::vector<float>{25, 36}));
  EXPECT_EQ(loader.next()->y, (std::vector<int64_t>{7}));
  EXPECT_FALSE(loader.next());

  Loader bad([](std::span<const int64_t>, Batch& out) { out.x_shape = {2}; }, {1, 2}, {.batch_size = 2});
  try {
    bad.next();
    ADD_FAILURE();
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("batch 0 has x shape [2] but 0 x values"), std::string::npos) << e.what();
  }
}

TEST(Loader, BadArgumentsAreCaughtOnTheCallersThread) {
  CountingDataset ds(10);
  try {
    Loader loader(ds, {1, 10}, {.batch_size = 2});
    ADD_FAILURE();
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("index 10 (at position 1) is out of range for a dataset of 10 samples"),
              std::string::npos);
  }
  EXPECT_THROW(Loader(ds, {1}, {.batch_size = 0}), InvalidArgument);
  EXPECT_THROW(Loader(ds, {1}, {.prefetch = -1}), InvalidArgument);
  EXPECT_THROW(Loader(ds, {1}, {.timeout = -1ms}), InvalidArgument);
  EXPECT_THROW(Loader(BatchFn(), {1}), InvalidArgument);
}

}  // namespace
}  // namespace cohort::data
