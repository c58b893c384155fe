#include "core/fd.hpp"

#include <unistd.h>

namespace cohort::core {

void Fd::reset(int fd) {
  if (fd_ >= 0) ::close(fd_);
  fd_ = fd;
}

}  // namespace cohort::core
