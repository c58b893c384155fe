// save_checkpoint_sharded: every rank's files in one atomic checkpoint; bad
// input on any rank refused on all before anything is written; a rank that
// fails (an I/O error) or dies (SIGKILL under `cohort run`) before the commit
// leaves the previous checkpoint the newest valid one.
#include <gtest/gtest.h>

#include <atomic>
#include <cstring>
#include <filesystem>

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

}  // namespace
