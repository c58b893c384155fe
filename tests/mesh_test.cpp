// The device mesh: every rank's coordinates and groups follow the documented
// order, each group sums over exactly its line of the grid, and a bad shape is
// refused on every rank, by name, before any group exists. Ranks run as
// threads over a MemoryStore.
#include <gtest/gtest.h>

#include <mutex>
#include <set>

#include "cohort/mesh.hpp"
#include "test_util.hpp"

namespace {

using cohort::Buffer;
using cohort::DType;
using cohort::InvalidArgument;
using cohort::Mesh;
using cohort::MeshDim;
using cohort::MeshShape;
using cohort::ProcessGroup;
using cohort::testing::run_ranks;

// A ProcessGroup& from run_ranks as the shared_ptr Mesh takes (the group outlives it).
std::shared_ptr<ProcessGroup> borrow(ProcessGroup& pg) { return {&pg, [](ProcessGroup*) {}}; }

// The sum over `g` of the world ranks: which ranks the group really spans.
int sum_of_world_ranks(ProcessGroup& g, int world_rank) {
  int32_t v = world_rank, out = 0;
  g.allreduce(Buffer{&v, 1, DType::I32}, Buffer{&out, 1, DType::I32})->wait();
  return out;
}

TEST(Mesh, CoordinatesAndGroupsFollowTheDefaultOrder) {
  std::mutex mu;
  std::set<std::vector<int>> tp_groups, dp_groups, pp_groups, mp_groups;
  run_ranks(8, "", [&](ProcessGroup& world) {
    Mesh mesh(borrow(world), {.dp = 2, .tp = 2, .pp = 2});
    const int r = world.rank();
    // world rank = tp + 2 * (dp + 2 * pp)
    EXPECT_EQ(mesh.coord(MeshDim::tp), r % 2);
    EXPECT_EQ(mesh.coord(MeshDim::dp), (r / 2) % 2);
    EXPECT_EQ(mesh.coord(MeshDim::pp), r / 4);
    EXPECT_EQ(mesh.world_rank(mesh.coord(MeshDim::dp), mesh.coord(MeshDim::tp), mesh.coord(MeshDim::pp)), r);
    EXPECT_EQ(mesh.tp().rank(), mesh.coord(MeshDim::tp));
    EXPECT_EQ(mesh.pp().rank(), mesh.coord(MeshDim::pp));
    EXPECT_EQ(mesh.model_parallel().size(), 4);
    // Each group sums over exactly the ranks its world_ranks() names.
    for (ProcessGroup* g : {&mesh.tp(), &mesh.dp(), &mesh.pp(), &mesh.model_parallel()}) {
      int want = 0;
      for (int w : g->world_ranks()) want += w;
      EXPECT_EQ(sum_of_world_ranks(*g, r), want);
    }
    std::lock_guard lock(mu);
    tp_groups.insert(mesh.tp().world_ranks());
    dp_groups.insert(mesh.dp().world_ranks());
    pp_groups.insert(mesh.pp().world_ranks());
    mp_groups.insert(mesh.model_parallel().world_ranks());
  });
  EXPECT_EQ(tp_groups, (std::set<std::vector<int>>{{0, 1}, {2, 3}, {4, 5}, {6, 7}}));
  EXPECT_EQ(dp_groups, (std::set<std::vector<int>>{{0, 2}, {1, 3}, {4, 6}, {5, 7}}));
  EXPECT_EQ(pp_groups, (std::set<std::vector<int>>{{0, 4}, {1, 5}, {2, 6}, {3, 7}}));
  EXPECT_EQ(mp_groups, (std::set<std::vector<int>>{{0, 1, 4, 5}, {2, 3, 6, 7}}));
}

TEST(Mesh, AnotherOrderPutsDpInnermost) {
  run_ranks(4, "", [&](ProcessGroup& world) {
    Mesh mesh(borrow(world), {.dp = 2, .tp = 2, .pp = 1}, {.order = "dp,tp,pp"});
    EXPECT_EQ(mesh.coord(MeshDim::dp), world.rank() % 2);
    EXPECT_EQ(mesh.coord(MeshDim::tp), world.rank() / 2);
    EXPECT_EQ(mesh.dp().world_ranks(), (std::vector<int>{world.rank() / 2 * 2, world.rank() / 2 * 2 + 1}));
    EXPECT_EQ(mesh.pp().size(), 1);
    EXPECT_NE(mesh.describe().find("order dp,tp,pp"), std::string::npos) << mesh.describe();
  });
}

// Every rank throws the same named error (none waits for a peer that gave up).
void expect_refused(int world, const std::function<MeshShape(int)>& shape, const std::string& order,
                    const std::string& needle) {
  std::mutex mu;
  int refused = 0;
  run_ranks(world, "", [&](ProcessGroup& pg) {
    try {
      Mesh mesh(borrow(pg), shape(pg.rank()), {.order = order});
      ADD_FAILURE() << "rank " << pg.rank() << " built " << mesh.describe();
    } catch (const InvalidArgument& e) {
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
      std::lock_guard lock(mu);
      ++refused;
    }
  });
  EXPECT_EQ(refused, world);
}

TEST(Mesh, ProductThatIsNotTheWorldSizeIsRefused) {
  expect_refused(4, [](int) { return MeshShape{.dp = 2, .tp = 3, .pp = 1}; }, "tp,dp,pp",
                 "dp 2 x tp 3 x pp 1 = 6 ranks, but the world has 4; choose degrees whose product is the world size "
                 "(4 ranks do not divide by tp 3 x pp 1");
  expect_refused(4, [](int) { return MeshShape{.dp = 1, .tp = 2, .pp = 1}; }, "tp,dp,pp", "with tp 2 and pp 1: dp 2");
}

TEST(Mesh, ZeroDegreeIsRefused) {
  expect_refused(2, [](int) { return MeshShape{.dp = 2, .tp = 1, .pp = 0}; }, "tp,dp,pp",
                 "the pp degree is 0");
}

TEST(Mesh, BadOrderIsRefused) {
  expect_refused(2, [](int) { return MeshShape{.dp = 2}; }, "tp,dp,dp", "not a permutation of tp, dp and pp");
  expect_refused(2, [](int) { return MeshShape{.dp = 2}; }, "tp,dp", "not a permutation");
  expect_refused(2, [](int) { return MeshShape{.dp = 2}; }, "tp,dp,pp,xyz", "not a permutation");
  expect_refused(2, [](int) { return MeshShape{.dp = 2}; }, "tp,dp,pp,", "not a permutation");
}

TEST(Mesh, RanksThatDisagreeAreNamed) {
  expect_refused(4, [](int r) { return r == 3 ? MeshShape{.dp = 1, .tp = 4} : MeshShape{.dp = 2, .tp = 2}; },
                 "tp,dp,pp", "rank 0 asked for dp 2 x tp 2 x pp 1 but rank 3 for dp 1 x tp 4 x pp 1");
}

TEST(Mesh, OutOfRangeCoordinatesAreRefused) {
  run_ranks(2, "", [&](ProcessGroup& world) {
    Mesh mesh(borrow(world), {.dp = 1, .tp = 2});
    EXPECT_THROW(mesh.world_rank(0, 2, 0), InvalidArgument);
    EXPECT_THROW(mesh.coords_of(2), InvalidArgument);
  });
}

}  // namespace
