#include "core/input_pieces.hpp"

#include <cstddef>
#include <cstring>

namespace cohort::core {

void copy_pieces(Buffer buf, std::span<const InputPiece> pieces) {
  const size_t es = dtype_size(buf.dtype);
  auto* base = static_cast<std::byte*>(buf.data);
  for (const InputPiece& p : pieces)
    if (p.count > 0 && p.data != base + p.offset * es) std::memcpy(base + p.offset * es, p.data, p.count * es);
}

}  // namespace cohort::core
