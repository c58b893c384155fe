// cohort/mesh.hpp: the device mesh of 3D parallelism (docs/parallelism.md).
//
// The world's ranks form a grid of three named dimensions:
//   tp  tensor parallelism: the ranks that hold slices of the same layers and
//       run an allreduce (or reduce-scatter/allgather) inside every block;
//   dp  data parallelism: the ranks that hold the same slice of the model and
//       average its gradients (DistributedDataParallel, ZeRO);
//   pp  pipeline parallelism: the ranks that hold consecutive stages of the
//       model and pass activations with send/recv.
// A rank's coordinates come from its world rank, innermost dimension first; the
// default order "tp,dp,pp" (Megatron-LM's) makes tp vary fastest, so that with
// `cohort run --nproc-per-node G` and tp dividing G every tp group lies inside
// one node, where its per-block collectives are cheap, and pp varies slowest,
// across nodes, where only activations travel:
//   world rank = tp_rank + tp * (dp_rank + dp * pp_rank).
//
//   auto world = cohort::init_process_group();
//   cohort::Mesh mesh(world, {.dp = 2, .tp = 2, .pp = 2});   // 8 ranks
//   mesh.tp().allreduce(...);          // my tensor-parallel group
//   mesh.coord(cohort::MeshDim::pp);   // my stage
#pragma once

#include <array>
#include <memory>
#include <string>
#include <vector>

#include "cohort/export.hpp"
#include "cohort/process_group.hpp"

namespace cohort {

enum class MeshDim : int { dp = 0, tp = 1, pp = 2 };

// The degree of each dimension; their product is the world size.
struct MeshShape {
  int dp = 1;
  int tp = 1;
  int pp = 1;
};

struct MeshOptions {
  // The dimensions, innermost (fastest-varying rank) first: a permutation of
  // "tp", "dp", "pp" separated by commas.
  std::string order = "tp,dp,pp";
  // When the launcher says which node each rank is on (GROUP_RANK, set by
  // `cohort run` and torchrun), a tp group that spans nodes is refused unless
  // this is true: its allreduces per block would cross the network.
  bool allow_tp_across_nodes = false;
  // When the world group moves GPU memory only (nccl), a group of the same
  // ranks that moves host memory (a native group) over which the ranks
  // compare their shapes and nodes. Unset: the world's host_group().
  std::shared_ptr<ProcessGroup> host_group;
};

class COHORT_API Mesh {
 public:
  // Collective over `world`: every rank tells every other its shape, order
  // and node first (over MeshOptions::host_group on an nccl world), so a bad
  // shape (a degree below 1, a product that is not the world size), a bad
  // order, ranks that disagree or a tp group across nodes is the same
  // InvalidArgument on every rank before any sub-group exists. Then creates
  // every sub-group once, in the same order on every rank.
  Mesh(std::shared_ptr<ProcessGroup> world, MeshShape shape, MeshOptions opts = {});

  const MeshShape& shape() const { return shape_; }
  int size(MeshDim d) const;
  // This rank's index along `d` (its rank in that group).
  int coord(MeshDim d) const { return coord_[static_cast<int>(d)]; }
  // The world rank at the given coordinates.
  int world_rank(int dp, int tp, int pp) const;
  // The coordinates {dp, tp, pp} of a world rank.
  std::array<int, 3> coords_of(int world_rank) const;

  ProcessGroup& world() const { return *world_; }
  // This rank's group along one dimension (of size 1 when its degree is 1).
  ProcessGroup& group(MeshDim d) const { return *groups_[static_cast<int>(d)]; }
  std::shared_ptr<ProcessGroup> group_ptr(MeshDim d) const { return groups_[static_cast<int>(d)]; }
  ProcessGroup& tp() const { return group(MeshDim::tp); }
  ProcessGroup& dp() const { return group(MeshDim::dp); }
  ProcessGroup& pp() const { return group(MeshDim::pp); }
  // The ranks that together hold one replica of the model (tp x pp, same dp
  // coordinate): where the global gradient norm of that replica is summed.
  ProcessGroup& model_parallel() const { return *model_parallel_; }
  std::shared_ptr<ProcessGroup> model_parallel_ptr() const { return model_parallel_; }

  // "dp 2 x tp 2 x pp 2 (order tp,dp,pp): rank 5 is dp 0, tp 1, pp 1".
  std::string describe() const;

 private:
  std::shared_ptr<ProcessGroup> world_;
  MeshShape shape_;
  std::array<int, 3> order_{};   // dimensions innermost first
  std::array<int, 3> coord_{};   // by MeshDim
  std::array<std::shared_ptr<ProcessGroup>, 3> groups_;
  std::shared_ptr<ProcessGroup> model_parallel_;
};

// "tp" for MeshDim::tp, ...
COHORT_API const char* mesh_dim_name(MeshDim d);

}  // namespace cohort
