// Saves sharded checkpoints under `cohort run` for checkpoint_sharded_test:
//   sharded_save_worker DIR STEPS [KILL_RANK KILL_STEP]
// Every rank writes "part.rank<r>" (a tensor of its rank's values) at steps
// 1..STEPS with save_checkpoint_sharded. With KILL_RANK, that rank SIGKILLs
// itself at step KILL_STEP right after its file is fsync'ed and closed, before
// rank 0 can commit: the crash the test checks the previous step survives.
#include <signal.h>

#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>
#include <vector>

#include "cohort/checkpoint.hpp"
#include "cohort/cohort.hpp"

namespace {

// The posix file system, except that closing a file kills the process when armed.
class KillOnClose final : public cohort::Filesystem {
 public:
  bool armed = false;
  std::unique_ptr<cohort::WritableFile> create_file(const std::string& path) override {
    struct File final : cohort::WritableFile {
      std::unique_ptr<cohort::WritableFile> f;
      const bool* armed;
      void append(const void* data, size_t n) override { f->append(data, n); }
      void sync() override { f->sync(); }
      void close() override {
        f->close();
        if (*armed) raise(SIGKILL);
      }
    };
    auto out = std::make_unique<File>();
    out->f = base().create_file(path);
    out->armed = &armed;
    return out;
  }
  std::unique_ptr<cohort::ReadableFile> open_file(const std::string& p) override { return base().open_file(p); }
  void create_dir(const std::string& p) override { base().create_dir(p); }
  void sync_dir(const std::string& p) override { base().sync_dir(p); }
  void rename(const std::string& a, const std::string& b) override { base().rename(a, b); }
  void remove_file(const std::string& p) override { base().remove_file(p); }
  void remove_dir(const std::string& p) override { base().remove_dir(p); }
  std::vector<cohort::DirEntry> list_dir(const std::string& p) override { return base().list_dir(p); }
  bool exists(const std::string& p) override { return base().exists(p); }
  bool is_dir(const std::string& p) override { return base().is_dir(p); }
  bool is_symlink(const std::string& p) override { return base().is_symlink(p); }
  std::unique_ptr<cohort::DirLock> lock_dir(const std::string& p) override { return base().lock_dir(p); }

 private:
  static cohort::Filesystem& base() { return cohort::posix_filesystem(); }
};

}  // namespace

int main(int argc, char** argv) {
  if (argc != 3 && argc != 5) {
    std::fprintf(stderr, "usage: sharded_save_worker DIR STEPS [KILL_RANK KILL_STEP]\n");
    return 2;
  }
  const std::string dir = argv[1];
  const int steps = std::atoi(argv[2]);
  const int kill_rank = argc == 5 ? std::atoi(argv[3]) : -1;
  const int kill_step = argc == 5 ? std::atoi(argv[4]) : -1;
  auto pg = cohort::init_process_group();
  KillOnClose fs;
  for (int step = 1; step <= steps; ++step) {
    std::vector<float> values(1000 + 17 * pg->rank(), static_cast<float>(step * 100 + pg->rank()));
    cohort::Manifest m;
    m.world_size = pg->size();
    fs.armed = pg->rank() == kill_rank && step == kill_step;
    const std::string path = cohort::save_checkpoint_sharded(
        *pg, dir, step,
        {{"part.rank" + std::to_string(pg->rank()),
          {cohort::make_tensor("values", {static_cast<int64_t>(values.size())}, values)}}},
        m, {.fs = &fs});
    if (pg->rank() == 0) {
      std::printf("saved %s\n", path.c_str());
      std::fflush(stdout);
    }
  }
  pg->shutdown();
  return 0;
}
