// Reducer: averaging, launch order and overlap, no_sync, find_unused,
// gradient_as_bucket_view, errors. Ranks run as threads over shm and tcp,
// world sizes 1..4; expected values are closed-form (ddp_test_util.hpp).
#include <thread>

#include "ddp_test_util.hpp"

namespace cohort::ddp {
namespace {

using namespace test;
using cohort::testing::run_ranks;

#define EXPECT_CONTAINS(text, part) \
  EXPECT_NE(std::string(text).find(part), std::string::npos) << "expected \"" << (part) << "\" in: " << (text)

class ReducerTest : public ::testing::TestWithParam<Config> {};

TEST_P(ReducerTest, AveragesGradientsMarkedInAnyOrder) {
  auto [transport, n] = GetParam();
  run_ranks(n, transport, [&](ProcessGroup& pg) {
    const int r = pg.rank();
    Grads g(mixed_model());
    Reducer red(pg, g.specs, small_buckets());
    ASSERT_EQ(red.plan().size(), kMixedBuckets);
    for (int t = 0; t < 3; ++t) {
      g.fill([&](size_t p, size_t i) { return grad_value(r, p, i, t); });
      // A different order on every rank and every iteration.
      for (size_t p : shuffled(g.specs.size(), 1000 * r + t)) red.mark_ready(p, g.ptr(p));
      red.finalize();
      expect_values(g.specs, r, "iteration " + std::to_string(t), [&](size_t p, size_t i) { return g.at(p, i); },
                    [&](size_t p, size_t i) { return avg_value(n, p, i, t); });
      IterationStats st = red.stats();
      EXPECT_EQ(st.iteration, uint64_t(t));
      EXPECT_EQ(st.marks, g.specs.size());
      EXPECT_EQ(st.unused_params, 0u);
      ASSERT_EQ(st.buckets.size(), kMixedBuckets);
      for (const BucketStats& b : st.buckets) {
        EXPECT_EQ(b.bytes, red.plan()[b.index].bytes());
        EXPECT_LE(b.ready, b.launched);
        EXPECT_LE(b.launched, b.completed);
        EXPECT_LE(b.completed, st.finalized);
        EXPECT_LE(st.started, b.ready);
      }
    }
  });
}

TEST_P(ReducerTest, MarkReadyFromSeveralThreads) {
  auto [transport, n] = GetParam();
  run_ranks(n, transport, [&](ProcessGroup& pg) {
    const int r = pg.rank();
    Grads g(mixed_model());
    Reducer red(pg, g.specs, small_buckets());
    for (int t = 0; t < 2; ++t) {
      g.fill([&](size_t p, size_t i) { return grad_value(r, p, i, t); });
      // Like autograd's per-device threads: two threads mark disjoint halves.
      auto order = shuffled(g.specs.size(), 77 * r + t);
      std::thread other([&] {
        for (size_t k = 0; k < order.size(); k += 2) red.mark_ready(order[k], g.ptr(order[k]));
      });
      for (size_t k = 1; k < order.size(); k += 2) red.mark_ready(order[k], g.ptr(order[k]));
      other.join();
      red.finalize();
      expect_values(g.specs, r, "threads", [&](size_t p, size_t i) { return g.at(p, i); },
                    [&](size_t p, size_t i) { return avg_value(n, p, i, t); });
    }
  });
}

TEST_P(ReducerTest, CommunicationStartsDuringBackwardInPlanOrder) {
  auto [transport, n] = GetParam();
  run_ranks(n, transport, [&](ProcessGroup& pg) {
    const int r = pg.rank();
    Grads g(mixed_model());
    Reducer red(pg, g.specs, small_buckets());
    const size_t np = g.specs.size();
    g.fill([&](size_t p, size_t i) { return grad_value(r, p, i, 0); });

    // Reverse registration order (as backward runs): bucket 0 = [9 8] launches
    // at the second mark, long before the last parameter is ready.
    red.mark_ready(9, g.ptr(9));
    EXPECT_EQ(red.stats().buckets[0].marks_at_launch, -1);
    red.mark_ready(8, g.ptr(8));
    IterationStats st = red.stats();
    EXPECT_EQ(st.buckets[0].marks_at_launch, 2);
    EXPECT_EQ(st.buckets[1].marks_at_launch, -1);
    for (size_t p = 8; p-- > 0;) red.mark_ready(p, g.ptr(p));
    st = red.stats();
    long cumulative = 0;
    for (size_t b = 0; b < kMixedBuckets; ++b) {
      cumulative += static_cast<long>(red.plan()[b].params.size());
      EXPECT_EQ(st.buckets[b].marks_at_launch, cumulative) << "bucket " << b;
      EXPECT_FALSE(st.buckets[b].launched_in_finalize);
      EXPECT_LT(st.buckets[0].marks_at_launch, static_cast<long>(np));
    }
    red.finalize();

    // Registration order: bucket 5 = [1 0] is complete first but waits until
    // bucket 0 (which needs parameter 9, the last mark) has launched.
    g.fill([&](size_t p, size_t i) { return grad_value(r, p, i, 1); });
    for (size_t p = 0; p < np; ++p) red.mark_ready(p, g.ptr(p));
    st = red.stats();
    for (size_t b = 0; b < kMixedBuckets; ++b) {
      EXPECT_EQ(st.buckets[b].marks_at_launch, static_cast<long>(np)) << "bucket " << b;
      if (b > 0) {
        EXPECT_LE(st.buckets[b - 1].launched, st.buckets[b].launched);
      }
    }
    EXPECT_LT(st.buckets[5].ready, st.buckets[0].ready);
    red.finalize();
    expect_values(g.specs, r, "forward order", [&](size_t p, size_t i) { return g.at(p, i); },
                  [&](size_t p, size_t i) { return avg_value(n, p, i, 1); });
  });
}

TEST_P(ReducerTest, NoSyncAccumulatesLocallyThenReducesTheSum) {
  auto [transport, n] = GetParam();
  run_ranks(n, transport, [&](ProcessGroup& pg) {
    const int r = pg.rank();
    Grads g(mixed_model());
    Reducer red(pg, g.specs, small_buckets());
    g.fill([](size_t, size_t) { return 0.0; });
    // Two local passes: the framework accumulates; the reducer only counts.
    for (int t = 0; t < 2; ++t) {
      auto guard = red.no_sync();
      red.prepare_for_backward();
      g.fill([&](size_t p, size_t i) { return g.at(p, i) + grad_value(r, p, i, t); });
      for (size_t p : shuffled(g.specs.size(), r + 10 * t)) red.mark_ready(p, g.ptr(p));
      red.finalize();
      expect_values(g.specs, r, "under no_sync", [&](size_t p, size_t i) { return g.at(p, i); },
                    [&](size_t p, size_t i) { return grad_value(r, p, i, 0) + (t ? grad_value(r, p, i, 1) : 0); });
    }
    // The synced pass reduces the accumulated sum of three passes.
    red.prepare_for_backward();
    g.fill([&](size_t p, size_t i) { return g.at(p, i) + grad_value(r, p, i, 2); });
    for (size_t p = g.specs.size(); p-- > 0;) red.mark_ready(p, g.ptr(p));
    red.finalize();
    expect_values(g.specs, r, "after no_sync", [&](size_t p, size_t i) { return g.at(p, i); },
                  [&](size_t p, size_t i) { return avg_value(n, p, i, 0) + avg_value(n, p, i, 1) + avg_value(n, p, i, 2); });
    EXPECT_EQ(red.stats().no_sync_marks, 2 * g.specs.size());
    EXPECT_EQ(red.stats().iteration, 0u);
  });
}

TEST_P(ReducerTest, FindUnusedParametersCountAsZeroOrTheirRegisteredGradient) {
  auto [transport, n] = GetParam();
  run_ranks(n, transport, [&](ProcessGroup& pg) {
    const int r = pg.rank();
    Grads g(mixed_model());
    const size_t never = 9, only_rank0 = 3, registered = 0;  // buckets 0, 4 and 5
    g.specs[never].grad = nullptr;
    g.specs[only_rank0].grad = nullptr;  // results are read from the bucket slots
    ReducerOptions o = small_buckets();
    o.find_unused_parameters = true;
    Reducer red(pg, g.specs, o);
    for (int t = 0; t < 2; ++t) {
      // Rank 0's gradient for only_rank0 is a multiple of 12, so that its
      // average over 1..4 ranks is exact.
      g.fill([&](size_t p, size_t i) { return p == only_rank0 ? 12.0 * (1 + (i + t) % 4) : grad_value(r, p, i, t); });
      for (size_t p = g.specs.size(); p-- > 0;) {
        if (p == never || p == registered || (p == only_rank0 && r != 0)) continue;
        red.mark_ready(p, g.ptr(p));
      }
      // Bucket 0 holds `never`: nothing may launch before finalize().
      for (const BucketStats& b : red.stats().buckets) EXPECT_EQ(b.marks_at_launch, -1);
      red.finalize();
      IterationStats st = red.stats();
      EXPECT_EQ(st.unused_params, r == 0 ? 2u : 3u);
      for (const BucketStats& b : st.buckets) EXPECT_TRUE(b.launched_in_finalize);
      auto got = [&](size_t p, size_t i) {
        return p == never || p == only_rank0 ? get_value(red.bucket_slot(p), i, g.specs[p].dtype) : g.at(p, i);
      };
      auto want = [&](size_t p, size_t i) {
        if (p == never) return 0.0;
        if (p == only_rank0) return 12.0 * (1 + (i + t) % 4) / n;
        return avg_value(n, p, i, t);  // `registered` contributes what its storage holds
      };
      expect_values(g.specs, r, "find_unused iteration " + std::to_string(t), got, want);
    }
  });
}

TEST_P(ReducerTest, GradientAsBucketView) {
  auto [transport, n] = GetParam();
  run_ranks(n, transport, [&](ProcessGroup& pg) {
    const int r = pg.rank();
    Grads g(mixed_model());  // registered storage: must stay untouched
    g.fill([](size_t, size_t) { return -1.0; });
    ReducerOptions o = small_buckets();
    o.gradient_as_bucket_view = true;
    Reducer red(pg, g.specs, o);
    const auto& specs = g.specs;
    auto slot_put = [&](size_t p, size_t i, double v) { put_value(red.bucket_slot(p), i, specs[p].dtype, v); };
    auto slot_at = [&](size_t p, size_t i) { return get_value(red.bucket_slot(p), i, specs[p].dtype); };

    // First pass: autograd wrote the gradients elsewhere; mark_ready copies.
    Grads first(mixed_model());
    first.fill([&](size_t p, size_t i) { return grad_value(r, p, i, 0); });
    for (size_t p = 0; p < specs.size(); ++p) red.mark_ready(p, first.ptr(p));
    red.finalize();
    expect_values(specs, r, "view, first pass", slot_at, [&](size_t p, size_t i) { return avg_value(n, p, i, 0); });

    // Now .grad is the slot itself: backward writes there (accumulating over
    // a no_sync pass), mark_ready copies nothing.
    for (size_t p = 0; p < specs.size(); ++p)
      for (size_t i = 0; i < specs[p].count; ++i) slot_put(p, i, grad_value(r, p, i, 1));
    {
      auto guard = red.no_sync();
      for (size_t p = 0; p < specs.size(); ++p) red.mark_ready(p, red.bucket_slot(p));
      red.finalize();
    }
    for (size_t p = 0; p < specs.size(); ++p)
      for (size_t i = 0; i < specs[p].count; ++i) slot_put(p, i, slot_at(p, i) + grad_value(r, p, i, 2));
    for (size_t p : shuffled(specs.size(), r)) red.mark_ready(p, p % 2 ? nullptr : red.bucket_slot(p));
    red.finalize();
    expect_values(specs, r, "view, accumulated", slot_at,
                  [&](size_t p, size_t i) { return avg_value(n, p, i, 1) + avg_value(n, p, i, 2); });
    expect_values(specs, r, "registered storage", [&](size_t p, size_t i) { return g.at(p, i); },
                  [](size_t, size_t) { return -1.0; });
  });
}

// grads_valid_until_finalize: buckets of 256 KiB and more go by single copy
// on shm, where each rank reads its own block straight from the gradients it
// was given (only the rest is copied into the bucket). The averages must be
// right whichever hook runs: the default, one that reads buffer() (it gets
// every gradient), one that communicates nothing (local gradients); and the
// gradients lent to the reducer are read, never written.
TEST_P(ReducerTest, GradientsLentUntilFinalize) {
  auto [transport, n] = GetParam();
  run_ranks(n, transport, [&](ProcessGroup& pg) {
    const int r = pg.rank();
    const std::vector<ParamSpec> model = {
        {"a", 70000, DType::F32}, {"b", 33333, DType::F32}, {"c", 5, DType::F32}, {"d", 90001, DType::F32}};
    for (const char* hook : {"default", "buffer", "none"}) {
      SCOPED_TRACE(hook);
      Grads g(model);
      ReducerOptions o;
      o.first_bucket_mb = 0.3;  // [d] [c b a]: 360 and 413 KB
      o.gradient_as_bucket_view = true;
      o.grads_valid_until_finalize = true;
      if (std::string(hook) == "buffer")
        o.comm_hook = [](GradBucket& b) -> CommFuture {
          return {b.group().allreduce(b.buffer(), {.op = ReduceOp::Avg}), nullptr};
        };
      if (std::string(hook) == "none") o.comm_hook = [](GradBucket&) -> CommFuture { return {}; };
      Reducer red(pg, g.specs, o);
      ASSERT_EQ(red.plan().size(), 2u);
      for (int t = 0; t < 2; ++t) {
        Grads fresh(model);  // autograd's new gradient tensors
        fresh.fill([&](size_t p, size_t i) { return grad_value(r, p, i, t); });
        for (size_t p : shuffled(model.size(), 10 * r + t)) red.mark_ready(p, fresh.ptr(p));
        red.finalize();
        const std::string what = std::string(hook) + " hook, iteration " + std::to_string(t);
        expect_values(
            model, r, what, [&](size_t p, size_t i) { return get_value(red.bucket_slot(p), i, model[p].dtype); },
            [&](size_t p, size_t i) {
              return std::string(hook) == "none" ? grad_value(r, p, i, t) : avg_value(n, p, i, t);
            });
        expect_values(model, r, what + ", lent gradients", [&](size_t p, size_t i) { return fresh.at(p, i); },
                      [&](size_t p, size_t i) { return grad_value(r, p, i, t); });
      }
    }
  });
}

TEST_P(ReducerTest, OnReducedReceivesEveryParameter) {
  auto [transport, n] = GetParam();
  run_ranks(n, transport, [&](ProcessGroup& pg) {
    const int r = pg.rank();
    Grads g(mixed_model());
    Grads out(mixed_model());
    std::vector<size_t> seen;
    ReducerOptions o = small_buckets();
    o.on_reduced = [&](size_t p, const void* reduced) {
      seen.push_back(p);
      if (out.specs[p].count) std::memcpy(out.ptr(p), reduced, out.specs[p].count * dtype_size(out.specs[p].dtype));
    };
    Reducer red(pg, g.specs, o);
    g.fill([&](size_t p, size_t i) { return grad_value(r, p, i, 0); });
    for (size_t p = 0; p < g.specs.size(); ++p) red.mark_ready(p, nullptr);  // nullptr: the registered storage
    red.finalize();
    std::vector<size_t> all(g.specs.size());
    for (size_t p = 0; p < all.size(); ++p) all[p] = p;
    EXPECT_EQ(seen, all);  // every parameter, in registration order
    expect_values(g.specs, r, "on_reduced", [&](size_t p, size_t i) { return out.at(p, i); },
                  [&](size_t p, size_t i) { return avg_value(n, p, i, 0); });
    expect_values(g.specs, r, "registered storage untouched", [&](size_t p, size_t i) { return g.at(p, i); },
                  [&](size_t p, size_t i) { return grad_value(r, p, i, 0); });
  });
}

TEST_P(ReducerTest, EmptyModelsAndZeroSizeParameters) {
  auto [transport, n] = GetParam();
  run_ranks(n, transport, [&](ProcessGroup& pg) {
    Reducer none(pg, {});
    none.finalize();
    Reducer zeros(pg, {{"a", 0, DType::F32}, {"b", 0, DType::F16}});
    ASSERT_EQ(zeros.plan().size(), 2u);  // one per dtype, each launching nothing
    for (int t = 0; t < 2; ++t) {
      zeros.mark_ready(1, nullptr);
      zeros.mark_ready(0, nullptr);
      zeros.finalize();
    }
    EXPECT_EQ(zeros.stats().iteration, 1u);
    pg.barrier()->wait();  // the group still agrees
  });
}

TEST_P(ReducerTest, ForwardWithoutBackwardReducesNothing) {
  auto [transport, n] = GetParam();
  run_ranks(n, transport, [&](ProcessGroup& pg) {
    const int r = pg.rank();
    Grads g(mixed_model());
    Reducer red(pg, g.specs, small_buckets());
    red.prepare_for_backward();  // e.g. a forward for logging, no backward
    red.finalize();
    red.finalize();
    red.prepare_for_backward();
    g.fill([&](size_t p, size_t i) { return grad_value(r, p, i, 0); });
    for (size_t p = 0; p < g.specs.size(); ++p) red.mark_ready(p, g.ptr(p));
    red.finalize();
    red.finalize();  // twice: harmless
    EXPECT_EQ(red.stats().iteration, 0u);
    expect_values(g.specs, r, "one reduction", [&](size_t p, size_t i) { return g.at(p, i); },
                  [&](size_t p, size_t i) { return avg_value(n, p, i, 0); });
  });
}

// ---- Errors ----

TEST_P(ReducerTest, UnreadyParameterWithoutFindUnusedNamesIt) {
  auto [transport, n] = GetParam();
  run_ranks(n, transport, [&](ProcessGroup& pg) {
    Grads g(mixed_model());
    {
      // "head.b" (index 9) is in bucket 0, so nothing launches.
      Reducer red(pg, g.specs, small_buckets());
      for (size_t p = 0; p < 9; ++p) red.mark_ready(p, g.ptr(p));
      std::string m = error_of([&] { red.finalize(); });
      EXPECT_CONTAINS(m, "'head.b'");
      EXPECT_CONTAINS(m, "1 of 10 parameters received no gradient");
      EXPECT_CONTAINS(m, "find_unused_parameters = true");
      // The iteration can never complete: later calls say so, PyTorch's way.
      m = error_of([&] { red.mark_ready(9, g.ptr(9)); });
      EXPECT_CONTAINS(m, "Expected to have finished reduction in the prior iteration before starting a new one");
      EXPECT_CONTAINS(m, "'head.b'");
      EXPECT_CONTAINS(error_of([&] { red.prepare_for_backward(); }), "Expected to have finished reduction");
    }
    {
      // "embed" (index 0) is in the last bucket: buckets 0..4 launched and
      // complete on every rank alike; the group stays usable.
      Reducer red(pg, g.specs, small_buckets());
      for (size_t p = g.specs.size(); p-- > 1;) red.mark_ready(p, g.ptr(p));
      EXPECT_CONTAINS(error_of([&] { red.finalize(); }), "'embed'");
      pg.barrier()->wait();
    }
  });
}

TEST_P(ReducerTest, MarkedTwiceIsReportedAndTheIterationGoesOn) {
  auto [transport, n] = GetParam();
  run_ranks(n, transport, [&](ProcessGroup& pg) {
    const int r = pg.rank();
    Grads g(mixed_model());
    g.fill([&](size_t p, size_t i) { return grad_value(r, p, i, 0); });
    Reducer red(pg, g.specs, small_buckets());
    red.mark_ready(4, g.ptr(4));
    std::string m = error_of([&] { red.mark_ready(4, g.ptr(4)); });
    EXPECT_CONTAINS(m, "'l2.b'");
    EXPECT_CONTAINS(m, "marked ready twice");
    for (size_t p = 0; p < g.specs.size(); ++p)
      if (p != 4) red.mark_ready(p, g.ptr(p));
    red.finalize();
    expect_values(g.specs, r, "after a double mark", [&](size_t p, size_t i) { return g.at(p, i); },
                  [&](size_t p, size_t i) { return avg_value(n, p, i, 0); });
  });
}

TEST_P(ReducerTest, NewIterationBeforeFinalizeIsReported) {
  auto [transport, n] = GetParam();
  run_ranks(n, transport, [&](ProcessGroup& pg) {
    const int r = pg.rank();
    Grads g(mixed_model());
    g.fill([&](size_t p, size_t i) { return grad_value(r, p, i, 0); });
    Reducer red(pg, g.specs, small_buckets());
    for (size_t p = 0; p < g.specs.size(); ++p) red.mark_ready(p, g.ptr(p));
    std::string m = error_of([&] { red.mark_ready(9, g.ptr(9)); });
    EXPECT_CONTAINS(m, "Expected to have finished reduction in the prior iteration before starting a new one");
    EXPECT_CONTAINS(m, "finalize()");
    EXPECT_CONTAINS(error_of([&] { red.prepare_for_backward(); }), "Expected to have finished reduction");
    red.finalize();  // nothing was disturbed
    expect_values(g.specs, r, "after the error", [&](size_t p, size_t i) { return g.at(p, i); },
                  [&](size_t p, size_t i) { return avg_value(n, p, i, 0); });

    // With prepare_for_backward, a partial pass is reported with what is missing.
    red.prepare_for_backward();
    red.mark_ready(0, g.ptr(0));
    m = error_of([&] { red.prepare_for_backward(); });
    EXPECT_CONTAINS(m, "Expected to have finished reduction in the prior iteration");
    EXPECT_CONTAINS(m, "'head.w'");
    EXPECT_CONTAINS(m, "find_unused_parameters");
    EXPECT_CONTAINS(error_of([&] { auto guard = red.no_sync(); }), "no_sync() entered while");
    for (size_t p = 1; p < g.specs.size(); ++p) red.mark_ready(p, g.ptr(p));
    red.finalize();
  });
}

TEST_P(ReducerTest, DifferentParametersOnDifferentRanksAreReported) {
  auto [transport, n] = GetParam();
  if (n == 1) GTEST_SKIP() << "needs two ranks";
  run_ranks(n, transport, [&](ProcessGroup& pg) {
    auto specs = mixed_model();
    if (pg.rank() == 1) specs.push_back({"extra", 5, DType::F32});
    std::string m;
    try {
      Reducer red(pg, specs);
    } catch (const InvalidArgument& e) {
      m = e.what();
    }
    EXPECT_CONTAINS(m, "register the same parameters");
    EXPECT_CONTAINS(m, pg.rank() == 1 ? "rank 0 registered 10 parameters" : "rank 1 registered 11 parameters");
  });
}

INSTANTIATE_TEST_SUITE_P(All, ReducerTest, ::testing::ValuesIn(configs()), config_name);

// ZeRO-2's memory (ReducerOptions::recycled_buckets): buckets borrow pool
// buffers, the hook's `then` reads each result before its buffer is reused,
// and the pool stays at K buffers when gradients come in plan order.
TEST_P(ReducerTest, RecycledBucketsHandEveryResultToTheHook) {
  auto [transport, n] = GetParam();
  run_ranks(n, transport, [&](ProcessGroup& pg) {
    const int r = pg.rank();
    Grads g(mixed_model());
    const size_t unused = 6;  // l3.b, alone in bucket 2 (mixed_model())
    ReducerOptions o = small_buckets();
    // One buffer: the 80 KB bucket is most of the model, so two would take as much as every bucket's own.
    o.recycled_buckets = 1;
    o.find_unused_parameters = true;
    Grads results(mixed_model());  // what the hook's `then` copied out of each bucket
    o.comm_hook = [&](GradBucket& b) -> CommFuture {
      WorkPtr w = b.allreduce({.op = ReduceOp::Avg});
      return {w, [&results, buffer = b.buffer(), params = std::vector<size_t>(b.params().begin(), b.params().end()),
                  offsets = std::vector<size_t>(b.offsets().begin(), b.offsets().end())] {
                for (size_t k = 0; k < params.size(); ++k) {
                  const size_t es = dtype_size(buffer.dtype), bytes = results.specs[params[k]].count * es;
                  std::memcpy(results.ptr(params[k]), static_cast<const std::byte*>(buffer.data) + offsets[k] * es,
                              bytes);
                }
              }};
    };
    Reducer red(pg, g.specs, o);
    size_t biggest = 0;  // each pool buffer's size
    for (const PlannedBucket& b : red.plan()) biggest = std::max(biggest, (b.bytes() + 63) / 64 * 64);
    EXPECT_EQ(red.bucket_memory_bytes(), 0u);  // nothing until a backward needs it
    EXPECT_THROW(red.bucket_slot(0), InvalidArgument);
    EXPECT_THROW(red.bucket_data(0), InvalidArgument);
    for (int t = 0; t < 4; ++t) {
      g.fill([&](size_t p, size_t i) { return grad_value(r, p, i, t); });
      std::vector<size_t> order;
      if (t < 2) {
        for (size_t p = g.specs.size(); p-- > 0;) order.push_back(p);  // plan order, as backward runs
      } else {
        order = shuffled(g.specs.size(), 31 * r + t);  // out of order: the pool may grow
      }
      if (t == 3) {  // a pass under no_sync takes no buffer; then a synced one that leaves `unused` out
        const size_t before = red.bucket_memory_bytes();
        auto guard = red.no_sync();
        for (size_t p : order) red.mark_ready(p, g.ptr(p));
        EXPECT_EQ(red.bucket_memory_bytes(), before);
      }
      for (size_t p : order)
        if (!(t == 3 && p == unused)) red.mark_ready(p, t == 1 && p == 8 ? nullptr : g.ptr(p));
      ASSERT_TRUE(red.finalize());
      const auto want = [&](size_t p, size_t i) {
        if (t == 1 && p == 8) return 0.0;  // marked with nullptr: zeros
        return avg_value(n, p, i, t);  // `unused` contributes its registered gradient
      };
      expect_values(g.specs, r, "recycled, iteration " + std::to_string(t),
                    [&](size_t p, size_t i) { return results.at(p, i); }, want);
      if (t < 2) {
        EXPECT_EQ(red.bucket_memory_bytes(), biggest) << "iteration " << t;
      }
    }
  });
}

TEST(ReducerArgs, RecycledBucketsRefuseWhatWouldLoseResults) {
  run_ranks(1, "shm", [&](ProcessGroup& pg) {
    const std::vector<ParamSpec> specs{{"w", 4, DType::F32}};
    ReducerOptions o;
    o.recycled_buckets = 1;  // with the default hook: its result would be dropped
    EXPECT_CONTAINS(error_of([&] { Reducer red(pg, specs, o); }), "default hook");
    o.comm_hook = allreduce_avg_hook();
    o.gradient_as_bucket_view = true;
    EXPECT_CONTAINS(error_of([&] { Reducer red(pg, specs, o); }), "gradient_as_bucket_view");
    o.gradient_as_bucket_view = false;
    o.on_reduced = [](size_t, const void*) {};
    EXPECT_CONTAINS(error_of([&] { Reducer red(pg, specs, o); }), "on_reduced");
    o.on_reduced = nullptr;
    o.comm_hook = [](GradBucket& b) -> CommFuture {
      return {b.allreduce({}), {}, [] { return CommFuture{}; }};
    };
    Reducer red(pg, specs, o);
    EXPECT_EQ(red.bucket_memory_bytes(), 64u);  // one bucket: it keeps its own buffer
    float w[4] = {1, 2, 3, 4};
    EXPECT_CONTAINS(error_of([&] { red.mark_ready(0, w); }), "CommFuture::next");
  });
}

TEST(ReducerArgs, BadCallsThrowInvalidArgument) {
  run_ranks(1, "shm", [&](ProcessGroup& pg) {
    Reducer red(pg, {{"w", 4, DType::F32}});
    EXPECT_THROW(red.mark_ready(1, nullptr), InvalidArgument);
    EXPECT_THROW(red.set_grad(1, nullptr), InvalidArgument);
    EXPECT_THROW(red.bucket_slot(7), InvalidArgument);
    std::string m = error_of([&] { red.mark_ready(0, nullptr); });  // no gradient given or registered
    EXPECT_CONTAINS(m, "'w'");
    EXPECT_CONTAINS(m, "set_grad");
    float w[4] = {1, 2, 3, 4};
    red.set_grad(0, w);
    red.mark_ready(0, nullptr);
    red.finalize();
    EXPECT_EQ(w[3], 4.0f);
    ReducerOptions o;
    o.bucket_cap_mb = -1;
    EXPECT_THROW(Reducer(pg, {}, o), InvalidArgument);
  });
}

}  // namespace
}  // namespace cohort::ddp
