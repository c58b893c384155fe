#include "transport/transport.hpp"

#include <cstring>

#include <fmt/format.h>

#include "core/reduce.hpp"

namespace cohort::transport {

void Connection::read_remote(uint64_t, void*, size_t) {
  throw InvalidArgument(fmt::format("{}: this connection cannot access the peer's memory (single copy needs a "
                                    "shared-memory peer and process_vm_readv)",
                                    describe()));
}

void Connection::write_remote(uint64_t remote, const void*, size_t bytes) {
  read_remote(remote, nullptr, bytes);  // the same error
}

uint8_t* Connection::map_remote(const SharedRef&, uint64_t, size_t, std::string* why) {
  *why = "not a shared-memory peer";
  return nullptr;
}

const char* kind_name(Kind k) { return k == Kind::Shm ? "shm" : "tcp"; }

void Sink::deliver(const uint8_t* data, size_t offset, size_t len) const {
  if (len == 0) return;
  if (mode == Copy) {
    std::memcpy(dst + offset, data, len);
  } else {
    size_t esize = dtype_size(dtype);
    core::reduce(dst + offset, other + offset, data, len / esize, dtype, op);
    if (avg_div > 1) core::scale_avg(dst + offset, len / esize, dtype, avg_div);
  }
}

}  // namespace cohort::transport
