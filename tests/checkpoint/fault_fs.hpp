// FaultFs: a Filesystem wrapper that makes the k-th mutating operation go wrong.
//
// Mutating operations are counted from 0: create_file, append, sync, close,
// create_dir, sync_dir, rename, remove_file, remove_dir. Reads, listings and
// existence checks are not counted.
//   Mode::Crash  the k-th operation and every later one (reads included) throw
//                SimulatedCrash: the process "died" there. An append that
//                crashes writes the first half of its bytes first (a torn write).
//   Mode::Fail   only the k-th operation throws IoError (an append writes half
//                first, like a disk filling up); later operations work, so the
//                code under test gets to clean up.
#pragma once

#include <memory>
#include <stdexcept>
#include <string>

#include <fmt/format.h>

#include "cohort/error.hpp"
#include "cohort/filesystem.hpp"

namespace cohort::testing {

struct SimulatedCrash : std::runtime_error {
  using std::runtime_error::runtime_error;
};

class FaultFs final : public Filesystem {
 public:
  enum class Mode { Crash, Fail };

  FaultFs(Filesystem& base, long fault_at, Mode mode) : base_(base), fault_at_(fault_at), mode_(mode) {}

  long ops() const { return ops_; }
  bool triggered() const { return triggered_; }
  const std::string& fault_op() const { return fault_op_; }  // "rename a -> b", ...

  std::unique_ptr<WritableFile> create_file(const std::string& path) override {
    step("create_file " + path);
    return std::make_unique<File>(*this, base_.create_file(path), path);
  }
  std::unique_ptr<ReadableFile> open_file(const std::string& path) override {
    check_alive();
    return base_.open_file(path);
  }
  void create_dir(const std::string& path) override {
    step("create_dir " + path);
    base_.create_dir(path);
  }
  void sync_dir(const std::string& path) override {
    step("sync_dir " + path);
    base_.sync_dir(path);
  }
  void rename(const std::string& from, const std::string& to) override {
    step("rename " + from + " -> " + to);
    base_.rename(from, to);
  }
  void remove_file(const std::string& path) override {
    step("remove_file " + path);
    base_.remove_file(path);
  }
  void remove_dir(const std::string& path) override {
    step("remove_dir " + path);
    base_.remove_dir(path);
  }
  std::vector<DirEntry> list_dir(const std::string& path) override {
    check_alive();
    return base_.list_dir(path);
  }
  bool exists(const std::string& path) override {
    check_alive();
    return base_.exists(path);
  }
  bool is_dir(const std::string& path) override {
    check_alive();
    return base_.is_dir(path);
  }
  bool is_symlink(const std::string& path) override {
    check_alive();
    return base_.is_symlink(path);
  }

 private:
  class File final : public WritableFile {
   public:
    File(FaultFs& fs, std::unique_ptr<WritableFile> f, std::string path)
        : fs_(fs), f_(std::move(f)), path_(std::move(path)) {}
    void append(const void* data, size_t n) override {
      if (fs_.is_fault_next()) f_->append(data, n / 2);  // torn write before the fault
      fs_.step("append " + path_);
      f_->append(data, n);
    }
    void sync() override {
      fs_.step("sync " + path_);
      f_->sync();
    }
    void close() override {
      fs_.step("close " + path_);
      f_->close();
    }

   private:
    FaultFs& fs_;
    std::unique_ptr<WritableFile> f_;
    std::string path_;
  };

  bool is_fault_next() const { return !dead_ && ops_ == fault_at_; }

  void check_alive() const {
    if (dead_) throw SimulatedCrash("simulated crash: the process is dead");
  }

  void step(const std::string& what) {
    check_alive();
    long index = ops_++;
    if (index != fault_at_) return;
    triggered_ = true;
    fault_op_ = what;
    if (mode_ == Mode::Crash) {
      dead_ = true;
      throw SimulatedCrash(fmt::format("simulated crash at operation {} ({})", index, what));
    }
    throw IoError(fmt::format("injected failure at operation {} ({})", index, what));
  }

  Filesystem& base_;
  long fault_at_;
  Mode mode_;
  long ops_ = 0;
  bool triggered_ = false;
  bool dead_ = false;
  std::string fault_op_;
};

}  // namespace cohort::testing
