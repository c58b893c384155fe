// Bucket plan: which parameters share a flat buffer and one collective.
//
// Backward produces gradients roughly in reverse registration order (the last
// layer first), so the plan walks the parameters from last to first and fills
// buckets greedily. The first bucket is capped small (first_cap_bytes) so that
// the first allreduce starts early in backward; later buckets use cap_bytes,
// large enough that per-collective overhead stays small. A bucket holds one
// dtype, because its flat buffer is reduced as one typed collective.
//
// Rules, applied for each parameter p in turn:
//   1. p has no elements: it joins the current bucket (opening one if there is
//      none) whatever its dtype; it takes no space.
//   2. the current bucket has elements and (its dtype differs from p's, or
//      adding p would take it past its cap): close it.
//   3. add p to the current bucket (a bucket holding only zero-size parameters
//      takes p's dtype).
//   4. the bucket reached its cap: close it. So a parameter larger than the cap
//      ends up alone in its bucket.
#include <fmt/format.h>

#include "cohort/ddp.hpp"
#include "cohort/error.hpp"

namespace cohort::ddp {

BucketPlan plan_buckets(std::span<const ParamSpec> params, const BucketPlanOptions& opts) {
  BucketPlan plan;
  bool open = false;  // plan.back() still takes parameters
  auto cap_of = [&](size_t bucket_index) { return bucket_index == 0 ? opts.first_cap_bytes : opts.cap_bytes; };

  for (size_t k = params.size(); k-- > 0;) {
    const ParamSpec& p = params[k];
    if (!dtype_is_valid(p.dtype))
      throw InvalidArgument(fmt::format("parameter '{}' (index {}) has an unknown dtype (value {}); use one of f32, "
                                        "f64, f16, bf16, i8, u8, i32, i64",
                                        p.name, k, static_cast<int>(p.dtype)));
    const size_t bytes = p.count * dtype_size(p.dtype);
    if (open && p.count > 0) {
      const PlannedBucket& cur = plan.back();
      if (cur.count > 0 && (cur.dtype != p.dtype || cur.bytes() + bytes > cap_of(plan.size() - 1))) open = false;
    }
    if (!open) {
      plan.push_back(PlannedBucket{.dtype = p.dtype});
      open = true;
    }
    PlannedBucket& b = plan.back();
    if (b.count == 0) b.dtype = p.dtype;
    b.params.push_back(k);
    b.offsets.push_back(b.count);
    b.count += p.count;
    if (b.count > 0 && b.bytes() >= cap_of(plan.size() - 1)) open = false;
  }
  return plan;
}

}  // namespace cohort::ddp
