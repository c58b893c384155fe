// save_checkpoint_sharded: every rank's files in one atomic checkpoint; bad
// input on any rank refused on all before anything is written; a rank that
// fails (an I/O error) or dies (SIGKILL under `cohort run`) before the commit
// leaves the previous checkpoint the newest valid one.
#include <gtest/gtest.h>

#include <atomic>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <optional>

#include "checkpoint/fault_fs.hpp"
#include "cohort/checkpoint.hpp"
#include "launch_harness.hpp"
#include "test_util.hpp"

namespace {

namespace fs = std::filesystem;
using cohort::testing::run_ranks;
using Files = std::map<std::string, std::vector<cohort::NamedTensor>>;

// Rank r's file at `step`: 100 + 7r values of step*100 + r.
Files part(int rank, int step) {
  std::vector<float> v(100 + 7 * rank, static_cast<float>(step * 100 + rank));
  return {{"part.rank" + std::to_string(rank), {cohort::make_tensor("values", {static_cast<int64_t>(v.size())}, v)}}};
}

float first_value(const cohort::LoadedCheckpoint& c, int rank) {
  const auto& t = c.files.at("part.rank" + std::to_string(rank)).at(0);
  float v;
  std::memcpy(&v, t.bytes.data(), sizeof v);
  return v;
}

struct TempDir {
  std::string path = fs::temp_directory_path() / ("cohort_sharded_" + std::to_string(::getpid()) + "_" +
                                                  std::to_string(counter++));
  TempDir() { fs::remove_all(path); }
  ~TempDir() { fs::remove_all(path); }
  static inline int counter = 0;
};

bool has_temp_dirs(const std::string& dir) {
  for (const auto& e : fs::directory_iterator(dir))
    if (e.path().filename().string().find(".tmp-") != std::string::npos) return true;
  return false;
}

// The ranks agree over group.host_group(): a host group is its own (nccl's
// is a native twin, tests/nccl_backend_test.cpp on a GPU).
TEST(CheckpointSharded, AHostGroupIsItsOwnHostGroup) {
  run_ranks(2, "shm", [&](cohort::ProcessGroup& pg) { EXPECT_EQ(&pg.host_group(), &pg); });
}

TEST(CheckpointSharded, EveryRanksFilesInOneCheckpoint) {
  TempDir d;
  std::vector<std::string> paths(3);
  run_ranks(3, "shm", [&](cohort::ProcessGroup& pg) {
    cohort::Manifest m;
    m.world_size = 3;
    m.epoch = pg.rank() == 0 ? 4 : 99;  // only rank 0's manifest counts
    paths[pg.rank()] = cohort::save_checkpoint_sharded(pg, d.path, 7, part(pg.rank(), 7), m);
  });
  EXPECT_EQ(paths[0], paths[1]);
  EXPECT_EQ(paths[0], paths[2]);
  const auto all = cohort::load_checkpoint(paths[0]);
  EXPECT_EQ(all.step, 7);
  EXPECT_EQ(all.manifest.epoch, 4);
  ASSERT_EQ(all.files.size(), 3u);
  for (int r = 0; r < 3; ++r) {
    EXPECT_EQ(first_value(all, r), 700.0f + r);
    EXPECT_EQ(all.files.at("part.rank" + std::to_string(r)).at(0).numel(), 100u + 7 * r);
  }
  const auto one = cohort::load_checkpoint(paths[0], {.only_files = {"part.rank1"}});
  ASSERT_EQ(one.files.size(), 1u);
  EXPECT_EQ(first_value(one, 1), 701.0f);
  EXPECT_THROW(cohort::load_checkpoint(paths[0], {.only_files = {"part.rank3"}}), cohort::FormatError);
  EXPECT_FALSE(has_temp_dirs(d.path));
}

TEST(CheckpointSharded, BadInputOnOneRankIsRefusedOnAllBeforeWriting) {
  TempDir d;
  run_ranks(3, "shm", [&](cohort::ProcessGroup& pg) {
    Files mine = part(pg.rank(), 1);
    if (pg.rank() == 2) mine = {{"bad/name", mine.begin()->second}};
    try {
      cohort::save_checkpoint_sharded(pg, d.path, 1, mine, {});
      ADD_FAILURE() << "rank " << pg.rank() << ": no error";
    } catch (const cohort::InvalidArgument& e) {
      const std::string what = e.what();
      EXPECT_NE(what.find(pg.rank() == 2 ? "bad/name" : "rank 2 failed"), std::string::npos) << what;
    }
    // Two ranks naming a file alike: every rank names both.
    try {
      cohort::save_checkpoint_sharded(pg, d.path, 1, pg.rank() == 0 ? part(1, 1) : part(pg.rank(), 1), {});
      ADD_FAILURE() << "rank " << pg.rank() << ": no error";
    } catch (const cohort::InvalidArgument& e) {
      EXPECT_NE(std::string(e.what()).find("ranks 0 and 1 both pass a file named \"part.rank1\""), std::string::npos)
          << e.what();
    }
  });
  EXPECT_FALSE(fs::exists(d.path));  // nothing written, not even the directory
}

// An I/O error at each of a rank's operations in turn, on rank 1 (its file)
// and on rank 0 (the directory, the lock, the manifest, the commit): every
// rank throws, the previous step stays the newest valid one and no temporary
// directory is left; once the fault is past the last operation, the save commits.
TEST(CheckpointSharded, AnIoErrorOnAnyRankKeepsThePreviousCheckpoint) {
  for (int failing : {1, 0}) {
    bool committed = false;
    for (long k = 0; !committed && k < 60; ++k) {
      TempDir d;
      std::atomic<int> threw{0};
      run_ranks(2, "shm", [&](cohort::ProcessGroup& pg) {
        cohort::save_checkpoint_sharded(pg, d.path, 1, part(pg.rank(), 1), {});
        cohort::testing::FaultFs faulty(cohort::posix_filesystem(), k, cohort::testing::FaultFs::Mode::Fail);
        cohort::SaveOptions o;
        if (pg.rank() == failing) o.fs = &faulty;
        try {
          cohort::save_checkpoint_sharded(pg, d.path, 2, part(pg.rank(), 2), {}, o);
        } catch (const cohort::IoError&) {
          ++threw;
        }
      });
      const auto latest = cohort::load_latest_valid(d.path);
      ASSERT_TRUE(latest) << "rank " << failing << " failing at operation " << k;
      if (threw == 0) {
        committed = true;
        EXPECT_EQ(latest->step, 2);
        EXPECT_EQ(first_value(*latest, 1), 201.0f);
      } else {
        EXPECT_EQ(threw, 2) << "every rank throws: rank " << failing << " failing at operation " << k;
        // Step 1, or (a failure after the commit's rename, in the fsync that makes it durable) a complete step 2.
        EXPECT_TRUE(latest->step == 1 || (latest->step == 2 && first_value(*latest, 1) == 201.0f))
            << "rank " << failing << " failing at operation " << k << ": step " << latest->step;
        EXPECT_FALSE(has_temp_dirs(d.path)) << "rank " << failing << " failing at operation " << k;
      }
    }
    EXPECT_TRUE(committed) << "rank " << failing << ": the save never got past its faults";
  }
}

// A rank SIGKILLed after writing its file of step 2, before the commit: the
// job fails, step 1 stays the newest valid checkpoint with both ranks' files,
// and the next save clears whatever the dead save left.
TEST(CheckpointSharded, ARankKilledMidSaveLeavesThePreviousCheckpoint) {
  TempDir d;
  auto r = launch_test::Proc({"run", "--standalone", "--nproc-per-node", "2", launch_test::prog("sharded_save_worker"),
                              d.path, "3", "1", "2"})
               .wait(60);
  EXPECT_NE(r.status, 0) << r.out << r.err;
  EXPECT_NE(r.out.find("step_000000001"), std::string::npos) << r.out << r.err;
  const auto latest = cohort::load_latest_valid(d.path);
  ASSERT_TRUE(latest);
  EXPECT_EQ(latest->step, 1);
  EXPECT_EQ(first_value(*latest, 0), 100.0f);
  EXPECT_EQ(first_value(*latest, 1), 101.0f);
  run_ranks(2, "shm", [&](cohort::ProcessGroup& pg) { cohort::save_checkpoint_sharded(pg, d.path, 2, part(pg.rank(), 2), {}); });
  EXPECT_FALSE(has_temp_dirs(d.path));
  EXPECT_EQ(cohort::load_latest_valid(d.path)->step, 2);
}

// posix_filesystem(), counting the bytes each thread (each rank of
// run_ranks) reads from files.
class CountingFs final : public cohort::Filesystem {
 public:
  static inline thread_local uint64_t read_bytes = 0;
  std::unique_ptr<cohort::WritableFile> create_file(const std::string& p) override { return real().create_file(p); }
  std::unique_ptr<cohort::ReadableFile> open_file(const std::string& p) override {
    struct Counted final : cohort::ReadableFile {
      std::unique_ptr<cohort::ReadableFile> f;
      uint64_t size() override { return f->size(); }
      void read_at(uint64_t off, void* out, size_t n) override {
        read_bytes += n;
        f->read_at(off, out, n);
      }
    };
    auto c = std::make_unique<Counted>();
    c->f = real().open_file(p);
    return c;
  }
  void create_dir(const std::string& p) override { real().create_dir(p); }
  void sync_dir(const std::string& p) override { real().sync_dir(p); }
  void rename(const std::string& a, const std::string& b) override { real().rename(a, b); }
  void remove_file(const std::string& p) override { real().remove_file(p); }
  void remove_dir(const std::string& p) override { real().remove_dir(p); }
  std::vector<cohort::DirEntry> list_dir(const std::string& p) override { return real().list_dir(p); }
  bool exists(const std::string& p) override { return real().exists(p); }
  bool is_dir(const std::string& p) override { return real().is_dir(p); }

 private:
  static cohort::Filesystem& real() { return cohort::posix_filesystem(); }
};

// find_latest_valid: the ranks verify a sharded checkpoint together, each
// checksumming only its share of the files, and all choose the same one: a
// file damaged in one rank's share, or a checkpoint `refuse` turns down,
// sends every rank to the same older one.
TEST(CheckpointSharded, FindLatestValidSplitsTheChecksumsAndAgrees) {
  TempDir d;
  constexpr int64_t kValues = 1 << 18;  // 1 MiB per file: the manifests' reads are small beside it
  const auto big = [&](int rank, int step) {
    std::vector<float> v(kValues, static_cast<float>(step * 100 + rank));
    return Files{{"part.rank" + std::to_string(rank), {cohort::make_tensor("values", {kValues}, v)}}};
  };
  for (int step = 1; step <= 3; ++step)
    run_ranks(3, "shm", [&](cohort::ProcessGroup& pg) { cohort::save_checkpoint_sharded(pg, d.path, step, big(pg.rank(), step), {}); });
  // part.rank1 is the manifest's second file: rank 1 checks it.
  {
    std::fstream f(d.path + "/step_000000003/part.rank1.safetensors", std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(-5, std::ios::end);
    f.put('\x7f');
  }
  CountingFs counting;
  std::vector<std::optional<cohort::LoadedCheckpoint>> got(3), refused(3);
  std::vector<uint64_t> read(3);
  run_ranks(3, "shm", [&](cohort::ProcessGroup& pg) {
    const int r = pg.rank();
    CountingFs::read_bytes = 0;
    got[r] = cohort::find_latest_valid(pg, d.path, {}, {.fs = &counting});
    read[r] = CountingFs::read_bytes;
    refused[r] = cohort::find_latest_valid(pg, d.path, [](const cohort::LoadedCheckpoint& c) {
      return c.step == 2 ? std::string("written by another run") : std::string();
    });
  });
  const uint64_t file_bytes = got[0] ? got[0]->file_info.at("part.rank0").size : 0;
  for (int r = 0; r < 3; ++r) {
    ASSERT_TRUE(got[r]) << "rank " << r;
    EXPECT_EQ(got[r]->step, 2) << "rank " << r;
    EXPECT_TRUE(got[r]->files.empty());
    EXPECT_EQ(got[r]->file_info.size(), 3u);
    ASSERT_EQ(got[r]->skipped.size(), 1u);
    EXPECT_NE(got[r]->skipped[0].find("step_000000003: "), std::string::npos) << got[r]->skipped[0];
    EXPECT_NE(got[r]->skipped[0].find("part.rank1.safetensors"), std::string::npos) << got[r]->skipped[0];
    EXPECT_NE(got[r]->skipped[0].find("CRC32C"), std::string::npos) << got[r]->skipped[0];
    // One file's checksum in each of the two checkpoints, not three.
    EXPECT_GE(read[r], 2 * file_bytes) << "rank " << r;
    EXPECT_LT(read[r], 2 * file_bytes + (256u << 10)) << "rank " << r;
    ASSERT_TRUE(refused[r]);
    EXPECT_EQ(refused[r]->step, 1);
    ASSERT_EQ(refused[r]->skipped.size(), 2u);
    EXPECT_EQ(refused[r]->skipped[1], "step_000000002: written by another run");
  }
  // What each rank then reads of the chosen one is the saved data.
  const auto mine = cohort::load_checkpoint(got[0]->path, {.only_files = {"part.rank2"}});
  EXPECT_EQ(first_value(mine, 2), 202.0f);

  // No directory: nothing, on every rank alike.
  run_ranks(2, "shm", [&](cohort::ProcessGroup& pg) {
    EXPECT_FALSE(cohort::find_latest_valid(pg, d.path + "/absent")) << "rank " << pg.rank();
  });
}

}  // namespace
