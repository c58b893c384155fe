// Crash safety of save_checkpoint (see the step list in src/checkpoint/save.cpp).
//
//   - A crash at EVERY mutating operation of a save (k = 0, 1, ... until the save
//     completes untouched), on the real file system: the latest valid checkpoint
//     is the previous one until the commit rename and the new one after it, no
//     visible checkpoint is ever broken, and the next save cleans up.
//   - The same with an injected I/O error (the process lives on): the save
//     throws and removes its temporary directory.
//   - The same on MemFs followed by a power loss that drops everything not
//     fsync'ed: this checks that every needed fsync is there, in order.
//   - A real child process SIGKILLed in the middle of a 200 MB save.
#include <fmt/format.h>
#include <gtest/gtest.h>
#include <poll.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <filesystem>
#include <thread>

#include "checkpoint/ckpt_test_util.hpp"
#include "checkpoint/fault_fs.hpp"
#include "checkpoint/layout.hpp"
#include "checkpoint/mem_fs.hpp"
#include "cohort/checkpoint.hpp"

using namespace cohort;
using namespace cohort::testing;
namespace fs = std::filesystem;

namespace {

using Files = std::map<std::string, std::vector<NamedTensor>>;

Files files_for(int64_t step) {
  int seed = static_cast<int>(step);
  return {{"model", {pattern_tensor("w", DType::F32, {3, 5}, seed), pattern_tensor("b", DType::BF16, {5}, seed)}},
          {"optimizer", {pattern_tensor("m", DType::F32, {3, 5}, seed + 1), pattern_tensor("t", DType::I64, {}, seed)}}};
}

Manifest manifest_for(int64_t step) {
  Manifest m;
  m.epoch = step;
  m.rng_states = {{"torch_cpu", fmt::format("rng-{}", step)}};
  return m;
}

void expect_checkpoint_is(const LoadedCheckpoint& c, int64_t step) {
  EXPECT_EQ(c.step, step);
  EXPECT_EQ(c.manifest.epoch, step);
  Files want = files_for(step);
  ASSERT_EQ(c.files.size(), want.size());
  for (const auto& [name, tensors] : want) EXPECT_TRUE(same_tensors(tensors, c.files.at(name))) << name;
}

std::vector<std::string> temp_dirs(Filesystem& fs, const std::string& dir) {
  std::vector<std::string> out;
  for (const DirEntry& e : fs.list_dir(dir))
    if (ckpt::is_temp_name(e.name)) out.push_back(e.name);
  return out;
}

// One run of the loop: a directory holding step 1 and a leftover from an
// earlier crash; a save of step 2 (keep_last = 1, so retention runs too) that
// faults at operation k. Returns the step load_latest_valid finds afterwards,
// or -1 if the save completed without reaching operation k.
struct Scenario {
  Filesystem& fs;  // the real or in-memory file system under the fault injector
  std::string dir;
  MemFs* mem = nullptr;  // set: simulate a power loss after the fault

  int64_t run(long k, FaultFs::Mode mode, std::string* fault_op) {
    save_checkpoint(dir, 1, files_for(1), manifest_for(1), {.fs = &fs});
    std::string leftover = dir + "/" + ckpt::temp_dir_name(9, 99999);
    fs.create_dir(leftover);
    fs.create_file(leftover + "/model.safetensors")->append("junk", 4);
    fs.sync_dir(dir);

    FaultFs faulty(fs, k, mode);
    try {
      save_checkpoint(dir, 2, files_for(2), manifest_for(2), {.keep_last = 1, .fs = &faulty});
    } catch (const SimulatedCrash&) {
      EXPECT_EQ(mode, FaultFs::Mode::Crash);
    } catch (const IoError& e) {
      EXPECT_EQ(mode, FaultFs::Mode::Fail) << e.what();
    }
    if (!faulty.triggered()) return -1;
    *fault_op = faulty.fault_op();
    SCOPED_TRACE(fmt::format("fault at operation {}: {}", k, *fault_op));
    if (mem) mem->power_loss();

    auto latest = load_latest_valid(dir, {.fs = &fs});
    if (!latest) {
      ADD_FAILURE() << "no valid checkpoint after a fault at " << *fault_op;
      return 0;
    }
    EXPECT_TRUE(latest->skipped.empty()) << "a broken checkpoint became visible: " << latest->skipped[0];
    expect_checkpoint_is(*latest, latest->step);

    // The next save succeeds, removes every leftover, and is itself durable.
    save_checkpoint(dir, 3, files_for(3), manifest_for(3), {.fs = &fs});
    EXPECT_TRUE(temp_dirs(fs, dir).empty()) << "leftover: " << temp_dirs(fs, dir)[0];
    if (mem) mem->power_loss();
    auto after = load_latest_valid(dir, {.fs = &fs});
    EXPECT_TRUE(after && after->step == 3) << "a completed save did not survive";
    return latest->step;
  }
};

// Runs the scenario for k = 0, 1, ... and checks the commit point is one place:
// step 1 before it, step 2 from it on (faults while removing the leftover aside).
void fault_at_every_operation(FaultFs::Mode mode, bool power_loss) {
  long k = 0;
  long first_new = -1;
  for (;; ++k) {
    std::unique_ptr<TempDir> tmp;
    std::unique_ptr<MemFs> mem;
    std::string dir;
    if (power_loss) {
      mem = std::make_unique<MemFs>();
      dir = "/ckpt";
    } else {
      tmp = std::make_unique<TempDir>();
      dir = *tmp / "ckpt";
    }
    Scenario s{mem ? static_cast<Filesystem&>(*mem) : posix_filesystem(), dir, mem.get()};
    std::string op;
    int64_t step = s.run(k, mode, &op);
    if (step == -1) break;
    ASSERT_TRUE(step == 1 || step == 2) << "fault at operation " << k << ": " << op;
    if (op.find(ckpt::temp_dir_name(9, 99999)) != std::string::npos) {
      // Removing the leftover failed: an I/O error there is logged and the save goes on.
      EXPECT_EQ(step, mode == FaultFs::Mode::Fail ? 2 : 1) << "fault at operation " << k << ": " << op;
      continue;
    }
    if (step == 2 && first_new < 0) first_new = k;
    if (first_new >= 0) {
      EXPECT_EQ(step, 2) << "the new checkpoint appeared, then vanished: fault at " << k << ": " << op;
    }
  }
  EXPECT_GT(k, 25) << "a save should take dozens of operations";
  EXPECT_GT(first_new, 0) << "the previous checkpoint never survived a fault";
  std::printf("  %ld operations per save; the new checkpoint is the latest from operation %ld on\n", k, first_new);
}

TEST(CheckpointCrash, CrashAtEveryOperationKeepsAValidLatest) { fault_at_every_operation(FaultFs::Mode::Crash, false); }

TEST(CheckpointCrash, IoErrorAtEveryOperationKeepsAValidLatest) { fault_at_every_operation(FaultFs::Mode::Fail, false); }

TEST(CheckpointCrash, CrashAndPowerLossAtEveryOperationKeepsAValidLatest) {
  fault_at_every_operation(FaultFs::Mode::Crash, true);
}

TEST(CheckpointCrash, MemFsForgetsWhatWasNotSynced) {
  MemFs m;
  m.create_dir("/d");
  m.sync_dir("/");
  auto f = m.create_file("/d/a");
  f->append("hello", 5);
  f->sync();
  m.power_loss();
  EXPECT_FALSE(m.exists("/d/a")) << "the file was synced but its directory entry was not";
  f = m.create_file("/d/a");
  f->append("hello", 5);
  m.sync_dir("/d");
  f->append(" world", 6);
  f->sync();
  m.rename("/d/a", "/d/b");
  m.power_loss();
  EXPECT_TRUE(m.exists("/d/a"));
  EXPECT_FALSE(m.exists("/d/b")) << "the rename was not synced";
  EXPECT_EQ(m.open_file("/d/a")->size(), 11u);
}

// ---- a real process killed mid-save ---------------------------------------

// Passes everything through; once `pause_after` bytes were appended, tells the
// parent through `ready_fd` and blocks forever (the parent then SIGKILLs us).
class PausingFs final : public Filesystem {
 public:
  PausingFs(uint64_t pause_after, int ready_fd) : pause_after_(pause_after), ready_fd_(ready_fd) {}
  std::unique_ptr<WritableFile> create_file(const std::string& p) override {
    return std::make_unique<File>(*this, base().create_file(p));
  }
  std::unique_ptr<ReadableFile> open_file(const std::string& p) override { return base().open_file(p); }
  void create_dir(const std::string& p) override { base().create_dir(p); }
  void sync_dir(const std::string& p) override { base().sync_dir(p); }
  void rename(const std::string& a, const std::string& b) override { base().rename(a, b); }
  void remove_file(const std::string& p) override { base().remove_file(p); }
  void remove_dir(const std::string& p) override { base().remove_dir(p); }
  std::vector<DirEntry> list_dir(const std::string& p) override { return base().list_dir(p); }
  bool exists(const std::string& p) override { return base().exists(p); }
  bool is_dir(const std::string& p) override { return base().is_dir(p); }
  std::unique_ptr<DirLock> lock_dir(const std::string& d) override { return base().lock_dir(d); }

 private:
  static Filesystem& base() { return posix_filesystem(); }
  class File final : public WritableFile {
   public:
    File(PausingFs& fs, std::unique_ptr<WritableFile> f) : fs_(fs), f_(std::move(f)) {}
    void append(const void* data, size_t n) override {
      const auto* p = static_cast<const uint8_t*>(data);
      while (n > 0) {  // in 8 MiB pieces, so the pause lands inside a tensor
        size_t piece = std::min<size_t>(n, size_t{8} << 20);
        f_->append(p, piece);
        p += piece;
        n -= piece;
        fs_.written_ += piece;
        if (fs_.written_ >= fs_.pause_after_) {
          char c = 'k';
          (void)!::write(fs_.ready_fd_, &c, 1);
          for (;;) ::pause();
        }
      }
    }
    void sync() override { f_->sync(); }
    void close() override { f_->close(); }

   private:
    PausingFs& fs_;
    std::unique_ptr<WritableFile> f_;
  };
  uint64_t pause_after_;
  int ready_fd_;
  uint64_t written_ = 0;
};

TEST(CheckpointCrash, ChildKilledInTheMiddleOfA200MBSave) {
  TempDir tmp;
  std::string dir = tmp / "ckpt";
  save_checkpoint(dir, 1, files_for(1), manifest_for(1));
  int pipefd[2];
  ASSERT_EQ(::pipe(pipefd), 0);
  pid_t child = ::fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    ::close(pipefd[0]);
    Files big = files_for(2);
    big["model"].push_back(pattern_tensor("embedding", DType::F32, {25 << 20, 2}));  // 200 MiB
    PausingFs pausing(uint64_t{100} << 20, pipefd[1]);
    try {
      save_checkpoint(dir, 2, big, manifest_for(2), {.fs = &pausing});
    } catch (...) {
    }
    ::_exit(3);  // only reached if the pause never came
  }
  ::close(pipefd[1]);
  pollfd pfd{pipefd[0], POLLIN, 0};
  int ready = ::poll(&pfd, 1, 120'000);
  // While the child is in the middle of its save, a save from here is refused
  // naming it (the directory's writer lock), and deletes nothing of the child's.
  std::string refused;
  if (ready == 1) {
    try {
      save_checkpoint(dir, 4, files_for(4), manifest_for(4));
    } catch (const IoError& e) {
      refused = e.what();
    }
  }
  ::kill(child, SIGKILL);
  int status = 0;
  ::waitpid(child, &status, 0);
  ::close(pipefd[0]);
  ASSERT_EQ(ready, 1) << "the child never reached the middle of its save";
  ASSERT_TRUE(WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL) << "status " << status;
  EXPECT_NE(refused.find("another save into it is in progress (last recorded holder of '" + dir +
                         "/.cohort-save.lock': pid " + std::to_string(child) + " on "),
            std::string::npos)
      << refused;

  // The torn save is in a temporary directory the loader ignores.
  std::vector<std::string> leftovers = temp_dirs(posix_filesystem(), dir);
  ASSERT_EQ(leftovers.size(), 1u);
  uintmax_t partial = fs::file_size(dir + "/" + leftovers[0] + "/model.safetensors");
  EXPECT_GE(partial, uintmax_t{100} << 20);
  EXPECT_LT(partial, uintmax_t{200} << 20);
  auto latest = load_latest_valid(dir);
  ASSERT_TRUE(latest);
  EXPECT_TRUE(latest->skipped.empty());
  expect_checkpoint_is(*latest, 1);

  save_checkpoint(dir, 3, files_for(3), manifest_for(3));
  EXPECT_TRUE(temp_dirs(posix_filesystem(), dir).empty());
  EXPECT_EQ(load_latest_valid(dir)->step, 3);
}

}  // namespace
