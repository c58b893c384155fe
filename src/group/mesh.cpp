// The device mesh: coordinates from the world rank, one sub-group per line of
// the grid, and the checks that keep a bad shape from ever reaching a step.
#include "cohort/mesh.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <map>
#include <optional>

#include "core/log.hpp"

namespace cohort {

const char* mesh_dim_name(MeshDim d) {
  switch (d) {
    case MeshDim::dp: return "dp";
    case MeshDim::tp: return "tp";
    case MeshDim::pp: return "pp";
  }
  return "?";
}

namespace {

constexpr std::array<MeshDim, 3> kDims{MeshDim::dp, MeshDim::tp, MeshDim::pp};

int degree(const MeshShape& s, int d) { return d == 0 ? s.dp : d == 1 ? s.tp : s.pp; }

// The permutation "tp,dp,pp" names, or nullopt.
std::optional<std::array<int, 3>> parse_order(const std::string& text) {
  std::array<int, 3> out{};
  std::array<bool, 3> seen{};
  size_t at = 0;
  for (int n = 0; n < 3; ++n) {
    const size_t comma = text.find(',', at);
    if ((n < 2) != (comma != std::string::npos)) return std::nullopt;  // exactly two commas
    const std::string name = text.substr(at, comma == std::string::npos ? std::string::npos : comma - at);
    int d = -1;
    for (MeshDim m : kDims)
      if (name == mesh_dim_name(m)) d = static_cast<int>(m);
    if (d < 0 || seen[d]) return std::nullopt;
    seen[d] = true;
    out[n] = d;
    at = comma + 1;
  }
  return out;
}

// The order as a small number that every rank can compare (0..5; -1 invalid).
int order_code(const std::optional<std::array<int, 3>>& o) { return o ? (*o)[0] * 3 + (*o)[1] : -1; }

int env_int(const char* name) {
  const char* v = std::getenv(name);
  if (!v || !*v) return -1;
  char* end = nullptr;
  const long x = std::strtol(v, &end, 10);
  return (*end || x < 0) ? -1 : static_cast<int>(x);
}

// What every rank says about the mesh it builds: its shape, its order, its node.
struct Claim {
  int32_t dp, tp, pp, order, node;
};

// Every rank's claim, over `world` or, when it moves GPU memory only (nccl),
// over `host` (a group of the same ranks that moves host memory) or else the
// world's own host_group().
std::vector<Claim> exchange(ProcessGroup& world, ProcessGroup* host, const Claim& mine) {
  std::vector<Claim> all(world.size(), mine);
  if (world.size() == 1) return all;
  ProcessGroup* via = world.cuda_device() < 0 ? &world : host ? host : &world.host_group();
  if (via->size() != world.size() || via->rank() != world.rank())
    throw InvalidArgument("Mesh: MeshOptions::host_group must hold the world's ranks in the world's order");
  Claim send = mine;
  via->allgather(Buffer{&send, 5, DType::I32}, Buffer{all.data(), all.size() * 5, DType::I32})->wait();
  return all;
}

std::string shape_text(const Claim& c) { return fmt::format("dp {} x tp {} x pp {}", c.dp, c.tp, c.pp); }

void check_claims(const std::vector<Claim>& all, const MeshOptions& opts, int world_size) {
  const Claim& mine = all[0];
  for (size_t r = 1; r < all.size(); ++r) {
    const Claim& c = all[r];
    if (c.dp != mine.dp || c.tp != mine.tp || c.pp != mine.pp)
      throw InvalidArgument(fmt::format("Mesh: rank 0 asked for {} but rank {} for {}; every rank must build the same "
                                        "mesh (pass the same --dp/--tp/--pp everywhere)",
                                        shape_text(mine), r, shape_text(c)));
    if (c.order != mine.order)
      throw InvalidArgument(fmt::format("Mesh: rank {} passed another order than rank 0; every rank must pass the same "
                                        "MeshOptions::order",
                                        r));
  }
  if (mine.order < 0)
    throw InvalidArgument(fmt::format("Mesh: order \"{}\" is not a permutation of tp, dp and pp; use e.g. \"tp,dp,pp\" "
                                      "(innermost first)",
                                      opts.order));
  for (MeshDim d : kDims) {
    const int n = degree({mine.dp, mine.tp, mine.pp}, static_cast<int>(d));
    if (n < 1)
      throw InvalidArgument(fmt::format("Mesh: the {} degree is {}; every degree must be at least 1", mesh_dim_name(d), n));
  }
  const int64_t product = int64_t{mine.dp} * mine.tp * mine.pp;
  if (product != world_size) {
    const int64_t model = int64_t{mine.tp} * mine.pp;
    throw InvalidArgument(fmt::format(
        "Mesh: {} = {} ranks, but the world has {}; choose degrees whose product is the world size ({})",
        shape_text(mine), product, world_size,
        world_size % model == 0
            ? fmt::format("with tp {} and pp {}: dp {}", mine.tp, mine.pp, world_size / model)
            : fmt::format("{} ranks do not divide by tp {} x pp {}: change tp or pp, or the process count",
                          world_size, mine.tp, mine.pp)));
  }
}

}  // namespace

int Mesh::size(MeshDim d) const { return degree(shape_, static_cast<int>(d)); }

int Mesh::world_rank(int dp, int tp, int pp) const {
  const std::array<int, 3> c{dp, tp, pp};
  int rank = 0;
  for (int i = 2; i >= 0; --i) {
    const int d = order_[i];
    if (c[d] < 0 || c[d] >= degree(shape_, d))
      throw InvalidArgument(fmt::format("Mesh::world_rank: {} coordinate {} is out of range 0..{}",
                                        mesh_dim_name(static_cast<MeshDim>(d)), c[d], degree(shape_, d) - 1));
    rank = rank * degree(shape_, d) + c[d];
  }
  return rank;
}

std::array<int, 3> Mesh::coords_of(int world_rank) const {
  if (world_rank < 0 || world_rank >= world_->size())
    throw InvalidArgument(fmt::format("Mesh::coords_of: rank {} is out of range 0..{}", world_rank, world_->size() - 1));
  std::array<int, 3> c{};
  for (int i = 0; i < 3; ++i) {
    const int d = order_[i];
    c[d] = world_rank % degree(shape_, d);
    world_rank /= degree(shape_, d);
  }
  return c;
}

Mesh::Mesh(std::shared_ptr<ProcessGroup> world, MeshShape shape, MeshOptions opts)
    : world_(std::move(world)), shape_(shape) {
  if (!world_) throw InvalidArgument("Mesh: the world group is null");
  const auto order = parse_order(opts.order);
  const std::vector<Claim> all = exchange(*world_, opts.host_group.get(),
                                          Claim{shape.dp, shape.tp, shape.pp, order_code(order), env_int("GROUP_RANK")});
  check_claims(all, opts, world_->size());
  order_ = *order;
  coord_ = coords_of(world_->rank());

  // A tp group that spans nodes, where the launcher says which node each rank is on.
  if (shape_.tp > 1 && !opts.allow_tp_across_nodes) {
    for (int r = 0; r < world_->size(); ++r) {
      const auto c = coords_of(r);
      const int first = world_rank(c[0], 0, c[2]);
      if (all[r].node < 0 || all[first].node < 0 || all[r].node == all[first].node) continue;
      throw InvalidArgument(fmt::format(
          "Mesh: the tp group of rank {} spans nodes {} and {} (GROUP_RANK): its allreduce in every block would cross "
          "the network; choose a tp that divides the processes per node (LOCAL_WORLD_SIZE), put tp innermost in "
          "MeshOptions::order, or set MeshOptions::allow_tp_across_nodes",
          r, all[first].node, all[r].node));
    }
  }

  // One new_group per line of the grid, every rank in the same order.
  for (MeshDim d : kDims) {
    const int di = static_cast<int>(d);
    std::map<std::array<int, 3>, std::vector<int>> lines;  // the other two coordinates -> ranks along d
    for (int r = 0; r < world_->size(); ++r) {
      auto key = coords_of(r);
      key[di] = 0;
      lines[key].push_back(r);  // r ascending: ranks along d in coordinate order
    }
    for (const auto& [key, ranks] : lines)
      if (auto g = world_->new_group(ranks)) groups_[di] = std::move(g);
  }
  for (int dp = 0; dp < shape_.dp; ++dp) {
    std::vector<int> ranks;
    for (int pp = 0; pp < shape_.pp; ++pp)
      for (int tp = 0; tp < shape_.tp; ++tp) ranks.push_back(world_rank(dp, tp, pp));
    if (auto g = world_->new_group(ranks)) model_parallel_ = std::move(g);
  }
  if (world_->rank() == 0) COHORT_INFO(kInit, "mesh: {}", describe());
}

std::string Mesh::describe() const {
  return fmt::format("dp {} x tp {} x pp {} (order {}{}{}): rank {} is dp {}, tp {}, pp {}", shape_.dp, shape_.tp,
                     shape_.pp, mesh_dim_name(static_cast<MeshDim>(order_[0])),
                     std::string(",") + mesh_dim_name(static_cast<MeshDim>(order_[1])),
                     std::string(",") + mesh_dim_name(static_cast<MeshDim>(order_[2])), world_->rank(), coord_[0],
                     coord_[1], coord_[2]);
}

}  // namespace cohort
