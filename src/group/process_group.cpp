// ProcessGroup's default members (backends override what they can do better).
#include <cstring>
#include <new>

#include "cohort/process_group.hpp"
#include "core/input_pieces.hpp"
#include "group/op.hpp"

namespace cohort {

std::shared_ptr<std::byte[]> ProcessGroup::allocate_buffer(size_t bytes) {
  constexpr std::align_val_t kAlign{64};
  auto* p = static_cast<std::byte*>(::operator new(std::max<size_t>(bytes, 1), kAlign));
  std::memset(p, 0, bytes);
  return std::shared_ptr<std::byte[]>(p, [](std::byte* q) { ::operator delete(q, kAlign); });
}

WorkPtr ProcessGroup::allreduce_gathered(Buffer buf, std::vector<InputPiece> pieces, AllreduceOptions opts) {
  group::check_pieces(buf, pieces);
  core::copy_pieces(buf, pieces);
  return allreduce(buf, buf, opts);
}

std::pair<size_t, size_t> ProcessGroup::allreduce_direct_block(size_t, DType) const { return {0, 0}; }

const char* version() { return COHORT_VERSION; }

}  // namespace cohort

namespace cohort {
namespace {
thread_local void* current_cuda_stream = nullptr;
}  // namespace

CudaStreamScope::CudaStreamScope(void* cuda_stream) : previous_(current_cuda_stream) {
  current_cuda_stream = cuda_stream;
}
CudaStreamScope::~CudaStreamScope() { current_cuda_stream = previous_; }
void* CudaStreamScope::current() { return current_cuda_stream; }

}  // namespace cohort
