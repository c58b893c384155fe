// Tensor helpers of the LibTorch adapter: dtype mapping, broadcasts, and the
// check that every rank built the same model.
#include <fmt/format.h>

#include <map>
#include <optional>
#include <sstream>

#include "cohort/torch.hpp"
#include "device.hpp"

namespace cohort::torch {

namespace {
std::optional<DType> known_dtype(::torch::ScalarType t) {
  switch (t) {
    case ::torch::kFloat: return DType::F32;
    case ::torch::kDouble: return DType::F64;
    case ::torch::kHalf: return DType::F16;
    case ::torch::kBFloat16: return DType::BF16;
    case ::torch::kChar: return DType::I8;
    case ::torch::kByte: return DType::U8;
    case ::torch::kInt: return DType::I32;
    case ::torch::kLong: return DType::I64;
    default: return std::nullopt;
  }
}
}  // namespace

DType to_dtype(::torch::ScalarType t) {
  if (auto d = known_dtype(t)) return *d;
  throw InvalidArgument(fmt::format("tensor dtype {} cannot be communicated; use float, double, half, bfloat16 or an "
                                    "integer type",
                                    c10::toString(t)));
}

void broadcast_tensors(ProcessGroup& group, const std::vector<::torch::Tensor>& tensors, int root) {
  std::vector<WorkPtr> works;
  // (original, contiguous copy in the group's memory): a strided tensor, or a
  // GPU tensor on a host group (staged through the CPU), or the reverse.
  std::vector<std::pair<::torch::Tensor, ::torch::Tensor>> copies;
  const int gpu = group.cuda_device();  // GPU collectives start after LibTorch's current stream there
  CudaStreamScope scope(gpu >= 0 ? current_stream_handle(::torch::Device(::torch::kCUDA, static_cast<c10::DeviceIndex>(gpu)))
                                 : CudaStreamScope::current());
  for (const auto& t : tensors) {
    if (t.numel() == 0) continue;
    ::torch::Tensor c = in_group_memory(group, t);
    if (!c.is_same(t)) copies.emplace_back(t, c);
    // A broadcast reduces nothing: bool, int16, complex, ... travel as their bytes.
    const std::optional<DType> d = known_dtype(c.scalar_type());
    const Buffer buf = d ? Buffer{c.data_ptr(), static_cast<size_t>(c.numel()), *d}
                         : Buffer{c.data_ptr(), static_cast<size_t>(c.nbytes()), DType::U8};
    works.push_back(group.broadcast(buf, {.root = root}));
  }
  try {
    for (auto& w : works) w->wait();
  } catch (...) {
    // A broadcast may still write into the copies: never free them under it.
    (void)new std::vector<std::pair<::torch::Tensor, ::torch::Tensor>>(std::move(copies));
    throw;
  }
  ::torch::NoGradGuard no_grad;
  for (auto& [orig, c] : copies) orig.copy_(c);
}

namespace {

std::string signature(const std::string& name, const ::torch::Tensor& t) {
  std::ostringstream s;
  s << name << " [";
  for (int64_t d = 0; d < t.dim(); ++d) s << (d ? ", " : "") << t.size(d);
  // Any dtype (a bool mask buffer too): the name is all the check needs.
  const std::optional<DType> d = known_dtype(t.scalar_type());
  s << "] " << (d ? std::string(dtype_name(*d)) : std::string(c10::toString(t.scalar_type())));
  return s.str();
}

}  // namespace

void check_same_parameters(ProcessGroup& group, const std::vector<std::string>& names,
                           const std::vector<::torch::Tensor>& tensors, std::string_view what) {
  std::vector<std::string> mine;
  std::string joined;
  for (size_t i = 0; i < names.size(); ++i) {
    mine.push_back(signature(names[i], tensors[i]));
    joined += mine.back() + "\n";
  }
  // Rank 0's list travels to everyone; each rank compares its own with it.
  const std::string root = broadcast_string(group, joined, 0);
  std::vector<std::string> theirs;
  std::istringstream in(root);
  for (std::string line; std::getline(in, line);) theirs.push_back(line);

  // By name first (what is missing where, what differs), then the order.
  const auto name_of = [](const std::string& sig) { return sig.substr(0, sig.rfind(" [")); };
  std::map<std::string, std::string> mine_by_name, theirs_by_name;
  for (const auto& m : mine) mine_by_name[name_of(m)] = m;
  for (const auto& t : theirs) theirs_by_name[name_of(t)] = t;
  const int me = group.rank();
  std::string problem;
  for (const auto& t : theirs)
    if (problem.empty() && !mine_by_name.count(name_of(t)))
      problem = fmt::format("rank 0 has a {} '{}' that rank {} does not have", what, t, me);
  for (const auto& m : mine)
    if (problem.empty() && !theirs_by_name.count(name_of(m)))
      problem = fmt::format("rank {} has a {} '{}' that rank 0 does not have", me, what, m);
  for (const auto& t : theirs) {
    auto it = mine_by_name.find(name_of(t));
    if (problem.empty() && it != mine_by_name.end() && it->second != t)
      problem = fmt::format("{} '{}' is '{}' on rank 0 but '{}' on rank {}", what, name_of(t), t, it->second, me);
  }
  for (size_t i = 0; i < mine.size() && i < theirs.size() && problem.empty(); ++i)
    if (mine[i] != theirs[i])
      problem = fmt::format("the {}s are registered in another order: #{} is '{}' on rank 0 but '{}' on rank {}", what,
                            i, name_of(theirs[i]), name_of(mine[i]), me);

  std::vector<int32_t> flags(group.size());
  int32_t bad_here = problem.empty() ? 0 : 1;
  host_collective(group, {{&bad_here, 1, DType::I32}, {flags.data(), flags.size(), DType::I32}},
                  [&](const std::vector<Buffer>& b) { return group.allgather(b[0], b[1]); });
  std::string bad;
  for (int r = 0; r < group.size(); ++r)
    if (flags[r]) bad += fmt::format("{}{}", bad.empty() ? "" : ",", r);
  if (bad.empty()) return;
  throw InvalidArgument(fmt::format(
      "DistributedDataParallel: ranks [{}] have different {}s than rank 0{}; HINT: every rank must build the same "
      "model (same layers in the same order, same sizes and dtypes, the same parameters frozen) before wrapping it",
      bad, what, problem.empty() ? "" : ": " + problem));
}

double allreduce_scalar(ProcessGroup& group, double value, ReduceOp op) {
  host_collective(group, {{&value, 1, DType::F64}},
                  [&](const std::vector<Buffer>& b) { return group.allreduce(b[0], {.op = op}); });
  return value;
}

std::string broadcast_string(ProcessGroup& group, std::string value, int root) {
  int64_t n = static_cast<int64_t>(value.size());
  host_collective(group, {{&n, 1, DType::I64}},
                  [&](const std::vector<Buffer>& b) { return group.broadcast(b[0], {.root = root}); });
  value.resize(static_cast<size_t>(n));
  if (n > 0)
    host_collective(group, {{value.data(), static_cast<size_t>(n), DType::U8}},
                    [&](const std::vector<Buffer>& b) { return group.broadcast(b[0], {.root = root}); });
  return value;
}

}  // namespace cohort::torch
