// core::Fd: owns one file descriptor and closes it exactly once, whatever
// path leaves the scope (a throw included). Every descriptor cohort opens
// (sockets, files, memfds, eventfds) is held in one of these or in an object
// whose destructor closes it.
#pragma once

namespace cohort::core {

class Fd {
 public:
  Fd() = default;
  explicit Fd(int fd) : fd_(fd) {}
  ~Fd() { reset(); }
  Fd(Fd&& o) noexcept : fd_(o.release()) {}
  Fd& operator=(Fd&& o) noexcept {
    if (this != &o) reset(o.release());
    return *this;
  }
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;

  int get() const { return fd_; }
  bool valid() const { return fd_ >= 0; }
  // Gives the descriptor up without closing it.
  int release() {
    const int f = fd_;
    fd_ = -1;
    return f;
  }
  // Closes the held descriptor (if any) and holds `fd` instead.
  void reset(int fd = -1);

 private:
  int fd_ = -1;
};

}  // namespace cohort::core
