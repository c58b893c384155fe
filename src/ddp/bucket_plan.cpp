// Bucket plan: which parameters share a flat buffer and one collective.
//
// Backward produces gradients roughly in reverse registration order (the last
// layer first), so the plan walks the parameters from last to first and fills
// buckets greedily. The first bucket is capped small (first_cap_bytes) so that
// the first allreduce starts early in backward; later buckets use cap_bytes,
// large enough that per-collective overhead stays small. A bucket holds one
// dtype, because its flat buffer is reduced as one typed collective.
//
// Each dtype has its own open bucket, as in PyTorch (one accumulator per
// dtype and device), so a model whose dtypes alternate (bf16 weights beside
// f32 norms) still gets few, full buckets rather than one per dtype change.
//
// Rules, applied for each parameter p in turn (its dtype's open bucket is B;
// B's cap is first_cap_bytes for the first bucket of that dtype, cap_bytes after):
//   1. B has elements and adding p (with elements) would take it past its cap:
//      close B and open a new one for p's dtype.
//   2. add p to B (zero-size parameters too: they take no space).
//   3. B reached its cap: close it. So a parameter larger than the cap ends up
//      alone in its bucket.
// At the end the open buckets are closed. A closed bucket's count is rounded
// up to count_multiple (ZeRO: the world size); the padding is never any
// parameter's and stays zero. The plan lists buckets in the order
// they complete during the walk (the position of their last parameter): a
// bucket launches only after every earlier one (reducer.cpp), so this is the
// order in which backward can start them.
//
// PyTorch differs in two details (torch/csrc/distributed/c10d/reducer.cpp,
// compute_bucket_assignment_by_size): it adds a parameter first and closes
// the bucket once it reaches the limit, so its buckets overshoot the cap by up
// to one parameter (cohort's stay within it unless a parameter alone is
// larger); and its first iteration uses one bucket for everything, rebuilding
// the buckets in the order gradients arrived after it. cohort's plan is fixed
// at construction, in reverse registration order.
#include <fmt/format.h>

#include <algorithm>
#include <map>
#include <utility>

#include "cohort/ddp.hpp"
#include "cohort/error.hpp"

namespace cohort::ddp {

BucketPlan plan_buckets(std::span<const ParamSpec> params, const BucketPlanOptions& opts) {
  struct Open {
    PlannedBucket bucket;  // open while it holds a parameter
    size_t closed = 0;     // buckets of this dtype closed so far
    size_t last_pos = 0;  // walk position of the bucket's last parameter
    size_t cap(const BucketPlanOptions& o) const { return closed == 0 ? o.first_cap_bytes : o.cap_bytes; }
  };
  std::map<DType, Open> by_dtype;
  std::vector<std::pair<size_t, PlannedBucket>> done;  // (completion position, bucket)
  const size_t multiple = std::max<size_t>(opts.count_multiple, 1);
  const auto close = [&](Open& o) {
    o.bucket.count = (o.bucket.count + multiple - 1) / multiple * multiple;
    done.emplace_back(o.last_pos, std::move(o.bucket));
    o.bucket = PlannedBucket{};
    ++o.closed;
  };

  size_t pos = 0;
  for (size_t k = params.size(); k-- > 0; ++pos) {
    const ParamSpec& p = params[k];
    if (!dtype_is_valid(p.dtype))
      throw InvalidArgument(fmt::format("parameter '{}' (index {}) has an unknown dtype (value {}); use one of f32, "
                                        "f64, f16, bf16, i8, u8, i32, i64",
                                        p.name, k, static_cast<int>(p.dtype)));
    const size_t bytes = p.count * dtype_size(p.dtype);
    Open& o = by_dtype[p.dtype];
    if (p.count > 0 && o.bucket.count > 0 && o.bucket.bytes() + bytes > o.cap(opts)) close(o);
    PlannedBucket& b = o.bucket;
    b.dtype = p.dtype;
    b.params.push_back(k);
    b.offsets.push_back(b.count);
    b.count += p.count;
    o.last_pos = pos;
    if (b.count > 0 && b.bytes() >= o.cap(opts)) close(o);
  }
  for (auto& [dtype, o] : by_dtype)
    if (!o.bucket.params.empty()) close(o);
  std::stable_sort(done.begin(), done.end(), [](const auto& x, const auto& y) { return x.first < y.first; });
  BucketPlan plan;
  plan.reserve(done.size());
  for (auto& [at, bucket] : done) plan.push_back(std::move(bucket));
  return plan;
}

}  // namespace cohort::ddp
