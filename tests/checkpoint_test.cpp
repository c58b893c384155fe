// Checkpoint directories (src/checkpoint/save.cpp, load.cpp): round trip with
// every manifest field, load_latest_valid's choice and fallback, keep_last,
// corruption and truncation naming the file, argument checks. Crashes and
// kills are in checkpoint_crash_test.cpp.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "checkpoint/ckpt_test_util.hpp"
#include "checkpoint/layout.hpp"
#include "cohort/checkpoint.hpp"
#include "test_deps.hpp"

using namespace cohort;
using namespace cohort::testing;
namespace fs = std::filesystem;

namespace {

using Files = std::map<std::string, std::vector<NamedTensor>>;

Files sample_files(int seed) {
  return {{"model",
           {pattern_tensor("layer1.weight", DType::F32, {4, 3}, seed), pattern_tensor("layer1.bias", DType::BF16, {4}, seed),
            pattern_tensor("scale", DType::F64, {}, seed), pattern_tensor("unused", DType::F16, {0, 3}, seed)}},
          {"optimizer",
           {pattern_tensor("layer1.weight.exp_avg", DType::F32, {4, 3}, seed + 1),
            pattern_tensor("step", DType::I64, {}, seed)}}};
}

Manifest sample_manifest(int seed) {
  Manifest m;
  m.epoch = 3 + seed;
  m.sampler_position = 4096;
  m.world_size = 8;
  m.rng_states = {{"torch_cpu", std::string("\x00\x01\xff\xfe binary", 11)}, {"cuda:0", "state"}};
  m.lr_schedule = R"({"base_lrs":[0.1],"last_epoch":7})";
  m.config = fmt::format(R"({{"lr":0.1,"model":{{"layers":[64,32]}},"seed":{}}})", seed);
  return m;
}

void expect_same_files(const Files& want, const std::map<std::string, std::vector<NamedTensor>>& got) {
  ASSERT_EQ(want.size(), got.size());
  for (const auto& [name, tensors] : want) EXPECT_TRUE(same_tensors(tensors, got.at(name))) << name;
}

// A manifest edited by a test, with its manifest_crc32c made to match again
// (the CRC32C of the text with those 8 digits written as zeros).
std::string signed_manifest(nlohmann::json j) {
  j["manifest_crc32c"] = "00000000";
  std::string text = j.dump(2) + "\n";
  const size_t at = text.find("\"manifest_crc32c\": \"00000000\"") + std::string("\"manifest_crc32c\": \"").size();
  const std::string crc = fmt::format("{:08x}", crc32c(text.data(), text.size(), 0));
  return text.replace(at, 8, crc);
}

// The names in a directory, sorted.
std::vector<std::string> entries(const fs::path& dir) {
  std::vector<std::string> v;
  for (const auto& e : fs::directory_iterator(dir)) v.push_back(e.path().filename().string());
  std::sort(v.begin(), v.end());
  return v;
}

std::string load_error(const std::string& path) {
  try {
    load_checkpoint(path);
  } catch (const FormatError& e) {
    return e.what();
  }
  return "(no error)";
}

TEST(Checkpoint, RoundTripWithEveryManifestField) {
  TempDir dir;
  std::string path = save_checkpoint(dir / "run/ckpts", 1234, sample_files(0), sample_manifest(0));
  EXPECT_EQ(path, dir / "run/ckpts/step_000001234");
  EXPECT_EQ(list_checkpoint_steps(dir / "run/ckpts"), std::vector<int64_t>{1234});

  LoadedCheckpoint c = load_checkpoint(path);
  EXPECT_EQ(c.path, path);
  EXPECT_EQ(c.step, 1234);
  EXPECT_EQ(c.format_version, 2);
  Manifest want = sample_manifest(0);
  EXPECT_EQ(c.manifest.epoch, want.epoch);
  EXPECT_EQ(c.manifest.sampler_position, want.sampler_position);
  EXPECT_EQ(c.manifest.world_size, want.world_size);
  EXPECT_EQ(c.manifest.rng_states, want.rng_states);
  EXPECT_EQ(nlohmann::json::parse(c.manifest.lr_schedule), nlohmann::json::parse(want.lr_schedule));
  EXPECT_EQ(nlohmann::json::parse(c.manifest.config), nlohmann::json::parse(want.config));
  expect_same_files(sample_files(0), c.files);
  EXPECT_TRUE(c.skipped.empty());

  // The manifest on disk: sizes and checksums an independent reader can check.
  std::ifstream in(path + "/manifest.json");
  auto j = nlohmann::json::parse(in);
  EXPECT_EQ(j["complete"], true);
  EXPECT_EQ(j["format"], "cohort-checkpoint");
  for (const char* name : {"model", "optimizer"}) {
    std::vector<uint8_t> bytes = read_bytes(fmt::format("{}/{}.safetensors", path, name));
    auto entry = j["files"][std::string(name) + ".safetensors"];
    EXPECT_EQ(entry["size"], bytes.size());
    EXPECT_EQ(entry["crc32c"], fmt::format("{:08x}", crc32c(bytes.data(), bytes.size())));
    EXPECT_EQ(c.file_info.at(name).size, bytes.size());
  }
  EXPECT_EQ(entries(dir / "run/ckpts"), (std::vector<std::string>{".cohort-save.lock", "step_000001234"}))
      << "only the step directory (and the writer lock's file) remains";
}

TEST(Checkpoint, ManifestOnlyCheckpoint) {
  TempDir dir;
  save_checkpoint(dir.path(), 0, {}, Manifest{});
  auto c = load_latest_valid(dir.path());
  ASSERT_TRUE(c);
  EXPECT_EQ(c->step, 0);
  EXPECT_TRUE(c->files.empty());
}

TEST(Checkpoint, LatestIsTheHighestStepNumerically) {
  TempDir dir;
  for (int64_t step : {int64_t{999'999'999}, int64_t{2}, int64_t{1'000'000'000}})
    save_checkpoint(dir.path(), step, sample_files(static_cast<int>(step % 7)), sample_manifest(0));
  EXPECT_EQ(list_checkpoint_steps(dir.path()), (std::vector<int64_t>{2, 999'999'999, 1'000'000'000}));
  auto c = load_latest_valid(dir.path());
  ASSERT_TRUE(c);
  EXPECT_EQ(c->step, 1'000'000'000);
  EXPECT_EQ(fs::path(c->path).filename(), "step_1000000000");
}

TEST(Checkpoint, NoCheckpointIsAnEmptyResultNotAnError) {
  TempDir dir;
  EXPECT_FALSE(load_latest_valid(dir / "missing"));
  EXPECT_FALSE(load_latest_valid(dir.path()));
  fs::create_directories(dir / "step_000000009.tmp-4242");  // a crashed save is not a checkpoint
  fs::create_directories(dir / "notes");
  EXPECT_FALSE(load_latest_valid(dir.path()));
  fs::create_directories(dir / "step_000000003");  // no manifest: skipped, still no exception
  EXPECT_FALSE(load_latest_valid(dir.path()));
}

TEST(Checkpoint, KeepLastDeletesOlderCompleteCheckpoints) {
  TempDir dir;
  for (int64_t step = 1; step <= 5; ++step) save_checkpoint(dir.path(), step * 10, sample_files(0), Manifest{}, {.keep_last = 2});
  EXPECT_EQ(list_checkpoint_steps(dir.path()), (std::vector<int64_t>{40, 50}));
  save_checkpoint(dir.path(), 60, sample_files(0), Manifest{});  // keep_last = 0: keep all
  EXPECT_EQ(list_checkpoint_steps(dir.path()), (std::vector<int64_t>{40, 50, 60}));
  // A save below existing steps (a rollback) never deletes the newer ones, nor itself.
  save_checkpoint(dir.path(), 45, sample_files(1), Manifest{}, {.keep_last = 1});
  EXPECT_EQ(list_checkpoint_steps(dir.path()), (std::vector<int64_t>{45, 50, 60}));
  for (const auto& e : fs::directory_iterator(dir.path()))
    EXPECT_FALSE(ckpt::is_temp_name(e.path().filename().string())) << e.path();
}

// keep_last_among: a run saving beside an earlier run's checkpoints (another
// run id in the config) keeps N of its own and deletes none of the other's,
// whatever their steps; without it every checkpoint counts, as before.
TEST(Checkpoint, KeepLastAmongCountsAndDeletesOnlyTheCheckpointsItAccepts) {
  TempDir dir;
  const auto of_run = [](const std::string& run) {
    Manifest m;
    m.config = "{\"run\": \"" + run + "\"}";
    return m;
  };
  for (int64_t step : {5, 10, 15, 20}) save_checkpoint(dir.path(), step, sample_files(0), of_run("earlier"));
  SaveOptions mine{.keep_last = 2};
  mine.keep_last_among = [](const Manifest& m) { return m.config.find("\"now\"") != std::string::npos; };
  for (int64_t step : {4, 8, 12}) save_checkpoint(dir.path(), step, sample_files(1), of_run("now"), mine);
  EXPECT_EQ(list_checkpoint_steps(dir.path()), (std::vector<int64_t>{5, 8, 10, 12, 15, 20}));
  // A predicate that throws keeps the checkpoint (when in doubt, keep it).
  SaveOptions throwing{.keep_last = 1};
  throwing.keep_last_among = [](const Manifest&) -> bool { throw std::runtime_error("cannot tell"); };
  save_checkpoint(dir.path(), 16, sample_files(1), of_run("now"), throwing);
  EXPECT_EQ(list_checkpoint_steps(dir.path()), (std::vector<int64_t>{5, 8, 10, 12, 15, 16, 20}));
  // Without it, every checkpoint at or below the step counts.
  save_checkpoint(dir.path(), 17, sample_files(1), of_run("now"), {.keep_last = 2});
  EXPECT_EQ(list_checkpoint_steps(dir.path()), (std::vector<int64_t>{16, 17, 20}));
}

TEST(Checkpoint, RetentionPlanIsAPureFunction) {
  using S = ckpt::StepState;
  EXPECT_EQ(ckpt::steps_to_delete({{1, true}, {2, true}, {3, true}}, 3, 2), std::vector<int64_t>{1});
  EXPECT_TRUE(ckpt::steps_to_delete({{1, true}, {2, true}}, 2, 0).empty());
  // Invalid ones do not count toward keep_last, and go once they are past the horizon.
  EXPECT_EQ(ckpt::steps_to_delete({S{1, true}, S{2, false}, S{3, true}, S{4, false}, S{5, true}}, 5, 2),
            (std::vector<int64_t>{2, 1}));
  // Fewer valid than keep_last: nothing is old enough.
  EXPECT_TRUE(ckpt::steps_to_delete({S{1, false}, S{2, true}}, 2, 2).empty());
  // Steps above the saved one are never deleted.
  EXPECT_EQ(ckpt::steps_to_delete({S{1, true}, S{5, true}, S{9, true}}, 5, 1), std::vector<int64_t>{1});
  // Not ours: neither counted nor deleted.
  EXPECT_EQ(ckpt::steps_to_delete({S{1, true, true}, S{2, true, false}, S{3, true, true}, S{4, true, false}}, 4, 1),
            std::vector<int64_t>{1});
}

TEST(Checkpoint, SavingTheSameStepAgainReplacesIt) {
  TempDir dir;
  save_checkpoint(dir.path(), 7, sample_files(0), sample_manifest(0));
  save_checkpoint(dir.path(), 7, sample_files(3), sample_manifest(3));
  auto c = load_latest_valid(dir.path());
  ASSERT_TRUE(c);
  expect_same_files(sample_files(3), c->files);
  EXPECT_EQ(c->manifest.epoch, 6);
  EXPECT_EQ(entries(dir.path()), (std::vector<std::string>{".cohort-save.lock", "step_000000007"}));
}

// A save into a directory whose lock is held is refused with the holder
// named, and leaves nothing of its own there; once the lock is released saves
// go on. Here the holder is a second open of the lock file in this process
// (flock conflicts between open file descriptions); another process holding
// it is in checkpoint_crash_test.cpp.
TEST(Checkpoint, ASecondWriterIsRefusedWhileASaveHoldsTheDirectory) {
  TempDir dir;
  save_checkpoint(dir.path(), 1, sample_files(1), sample_manifest(1));
  {
    auto held = posix_filesystem().lock_dir(dir.path());
    ASSERT_TRUE(held);
    try {
      save_checkpoint(dir.path(), 2, sample_files(2), sample_manifest(2));
      ADD_FAILURE() << "a second writer saved while the directory was locked";
    } catch (const IoError& e) {
      const std::string msg = e.what();
      EXPECT_NE(msg.find("this process holds its lock"), std::string::npos) << msg;
      EXPECT_NE(msg.find("HINT: save from one thread at a time"), std::string::npos) << msg;
    }
    EXPECT_EQ(entries(dir.path()), (std::vector<std::string>{".cohort-save.lock", "step_000000001"}));
  }
  save_checkpoint(dir.path(), 2, sample_files(2), sample_manifest(2));
  EXPECT_EQ(list_checkpoint_steps(dir.path()), (std::vector<int64_t>{1, 2}));
}

TEST(Checkpoint, EveryCorruptByteIsCaughtNamingTheFile) {
  TempDir dir;
  save_checkpoint(dir.path(), 1, sample_files(1), sample_manifest(1));
  std::string step2 = save_checkpoint(dir.path(), 2, sample_files(2), sample_manifest(2));
  std::string victim = step2 + "/optimizer.safetensors";
  std::vector<uint8_t> good = read_bytes(victim);
  for (size_t i = 0; i < good.size(); ++i) {  // the length field, the JSON, the padding, the data
    std::vector<uint8_t> bad = good;
    bad[i] ^= 0x20;
    write_bytes(victim, bad);
    std::string msg = load_error(step2);
    EXPECT_NE(msg.find(victim), std::string::npos) << "byte " << i << ": " << msg;
    EXPECT_NE(msg.find("CRC32C"), std::string::npos) << "byte " << i << ": " << msg;
  }
  auto c = load_latest_valid(dir.path());
  ASSERT_TRUE(c);
  EXPECT_EQ(c->step, 1);
  expect_same_files(sample_files(1), c->files);
  ASSERT_EQ(c->skipped.size(), 1u);
  EXPECT_NE(c->skipped[0].find("step_000000002"), std::string::npos) << c->skipped[0];
  EXPECT_NE(c->skipped[0].find("optimizer.safetensors"), std::string::npos) << c->skipped[0];
  // Without checksum verification the damaged data loads (sizes are still checked).
  EXPECT_EQ(load_checkpoint(step2, {.verify_checksums = false}).step, 2);
}

TEST(Checkpoint, TruncatedOrMissingFilesAreNamed) {
  TempDir dir;
  save_checkpoint(dir.path(), 1, sample_files(1), sample_manifest(1));
  std::string step2 = save_checkpoint(dir.path(), 2, sample_files(2), sample_manifest(2));
  std::string model = step2 + "/model.safetensors";
  fs::resize_file(model, fs::file_size(model) / 2);
  std::string msg = load_error(step2);
  EXPECT_NE(msg.find(model), std::string::npos) << msg;
  EXPECT_NE(msg.find("truncated"), std::string::npos) << msg;
  EXPECT_EQ(load_latest_valid(dir.path())->step, 1);

  fs::remove(model);
  EXPECT_NE(load_error(step2).find("listed in the manifest but missing"), std::string::npos);
  fs::remove(step2 + "/manifest.json");
  EXPECT_NE(load_error(step2).find("has no manifest.json"), std::string::npos);
  auto c = load_latest_valid(dir.path());
  ASSERT_TRUE(c);
  EXPECT_EQ(c->step, 1);
  EXPECT_EQ(c->skipped.size(), 1u);
}

TEST(Checkpoint, ManifestProblemsAreNamed) {
  TempDir dir;
  std::string path = save_checkpoint(dir.path(), 5, sample_files(0), sample_manifest(0));
  std::string manifest = path + "/manifest.json";
  std::ifstream in(manifest);
  const auto good = nlohmann::json::parse(in);
  auto expect_error = [&](nlohmann::json j, const std::string& want) {
    std::ofstream(manifest) << signed_manifest(j);  // so that the edit itself is what gets reported
    std::string msg = load_error(path);
    EXPECT_NE(msg.find(want), std::string::npos) << msg;
    EXPECT_NE(msg.find(manifest), std::string::npos) << msg;
  };
  auto j = good;
  j["complete"] = false;
  expect_error(j, "did not finish");
  j = good;
  j["format_version"] = 99;
  expect_error(j, "upgrade cohort");
  j = good;
  j.erase("world_size");
  expect_error(j, "\"world_size\" is missing");
  j = good;
  j["files"]["../../etc/passwd.safetensors"] = {{"size", 1}, {"crc32c", "00000000"}};
  expect_error(j, "not a <name>.safetensors file name");
  j = good;
  j["rng_states"]["torch_cpu"] = "not base64!";
  expect_error(j, "not a base64 string");
  j = good;
  j["sampler_position"] = -640;  // refused at save time; must be refused at load time too
  expect_error(j, "sampler_position (-640) must be >= 0");
  j = good;
  nlohmann::json deep = 0;
  for (int i = 0; i < 100; ++i) deep = nlohmann::json::array({deep});
  j["lr_schedule"] = deep;
  expect_error(j, "nests deeper than 64 levels");
  std::ofstream(manifest) << "{ \"truncated\": ";
  EXPECT_NE(load_error(path).find("not a JSON object"), std::string::npos);
}

TEST(Checkpoint, TheManifestCarriesItsOwnChecksum) {
  TempDir dir;
  save_checkpoint(dir.path(), 4, sample_files(0), sample_manifest(0));
  std::string path = save_checkpoint(dir.path(), 5, sample_files(1), sample_manifest(1));
  const std::string manifest = path + "/manifest.json";
  std::string text;
  {
    std::ifstream in(manifest);
    text.assign(std::istreambuf_iterator<char>(in), {});
  }
  // One flipped bit in a field no other check covers: the epoch 4 -> 5.
  const size_t at = text.find("\"epoch\": 4");
  ASSERT_NE(at, std::string::npos) << text;
  text[at + 9] ^= 0x01;
  std::ofstream(manifest) << text;
  const std::string msg = load_error(path);
  EXPECT_NE(msg.find("its CRC32C is"), std::string::npos) << msg;
  EXPECT_EQ(load_latest_valid(dir.path())->step, 4);  // falls back past it

  // A NUL byte in a manifest is damage too (a JSON parser may stop there).
  text[at + 9] ^= 0x01;
  text.insert(text.size() - 2, std::string("\0junk", 5));
  std::ofstream(manifest) << text;
  EXPECT_NE(load_error(path).find("NUL byte"), std::string::npos);
}

TEST(Checkpoint, AStepMovedAsideByACrashedResaveIsFoundAndRestored) {
  // A re-save of step 20 renames the committed step_20 to step_20.tmp-<pid>-old
  // and then the new copy into place; a crash between the two leaves both
  // under temporary names. Reproduce that state by hand.
  TempDir dir;
  save_checkpoint(dir.path(), 20, sample_files(2), sample_manifest(2));
  const std::string aside = dir.path() + "/" + ckpt::temp_dir_name(20, 4242, "old");
  fs::rename(dir.path() + "/step_000000020", aside);
  fs::create_directory(dir.path() + "/" + ckpt::temp_dir_name(20, 4242));  // the unfinished new copy
  auto c = load_latest_valid(dir.path());
  ASSERT_TRUE(c) << "the committed step 20 must still count";
  EXPECT_EQ(c->step, 20);
  EXPECT_EQ(c->path, aside);
  expect_same_files(sample_files(2), c->files);
  // The next save (keep_last 1, as the example can run) puts it back rather than deleting it.
  save_checkpoint(dir.path(), 10, sample_files(1), sample_manifest(1), {.keep_last = 1});
  EXPECT_TRUE(fs::is_directory(dir.path() + "/step_000000020"));
  EXPECT_FALSE(fs::exists(aside));
  EXPECT_EQ(load_latest_valid(dir.path())->step, 20);
}

TEST(Checkpoint, OnlyCanonicalStepNamesCount) {
  TempDir dir;
  save_checkpoint(dir.path(), 10, sample_files(1), sample_manifest(1));
  fs::copy(dir.path() + "/step_000000010", dir.path() + "/step_11");  // a hand-made name
  EXPECT_EQ(list_checkpoint_steps(dir.path()), std::vector<int64_t>{10});
}

TEST(Checkpoint, RetentionCountsOnlyCheckpointsWhoseFilesAreThere) {
  TempDir dir;
  save_checkpoint(dir.path(), 10, sample_files(1), sample_manifest(1));
  std::string step20 = save_checkpoint(dir.path(), 20, sample_files(2), sample_manifest(2));
  fs::resize_file(step20 + "/model.safetensors", 10);  // its manifest still parses
  save_checkpoint(dir.path(), 30, sample_files(3), sample_manifest(3), {.keep_last = 2});
  // Two loadable checkpoints are kept: 30 and 10 (20 is damaged, not counted).
  EXPECT_TRUE(fs::exists(dir.path() + "/step_000000010"));
  fs::remove_all(dir.path() + "/step_000000030");
  EXPECT_EQ(load_latest_valid(dir.path())->step, 10);
}

TEST(Checkpoint, ResavingAStepThatIsASymlinkRemovesTheLinkNotItsTarget) {
  TempDir dir, archive;
  std::string kept = save_checkpoint(archive.path(), 10, sample_files(1), sample_manifest(1));
  fs::create_directories(dir.path());
  fs::create_directory_symlink(kept, dir.path() + "/step_000000010");
  save_checkpoint(dir.path(), 10, sample_files(2), sample_manifest(2));
  expect_same_files(sample_files(1), load_checkpoint(kept).files);  // the archive is intact
  expect_same_files(sample_files(2), load_checkpoint(dir.path() + "/step_000000010").files);
}

TEST(Checkpoint, BadArgumentsThrowBeforeWritingAnything) {
  TempDir dir;
  auto bad_tensor = sample_files(0);
  bad_tensor["model"][0].bytes.resize(3);
  Manifest no_world, bad_config, bad_lr;
  no_world.world_size = 0;
  bad_config.config = "[1, 2]";
  bad_lr.lr_schedule = "{oops";
  const std::tuple<int64_t, Files, Manifest, int, std::string> cases[] = {
      {-1, sample_files(0), Manifest{}, 0, "step is -1"},
      {1, {{"../model", {}}}, Manifest{}, 0, "not allowed"},
      {1, {{"manifest", {}}}, Manifest{}, 0, "not allowed"},
      {1, {{"", {}}}, Manifest{}, 0, "not allowed"},
      {1, bad_tensor, Manifest{}, 0, "file \"model\": safetensors: tensor \"layer1.weight\" (f32 [4, 3]) needs 48 bytes"},
      {1, sample_files(0), no_world, 0, "world_size is 0"},
      {1, sample_files(0), bad_config, 0, "config must be the text of a JSON object"},
      {1, sample_files(0), bad_lr, 0, "lr_schedule must be JSON text"},
      {1, sample_files(0), Manifest{}, -1, "keep_last is -1"},
  };
  for (const auto& [step, files, manifest, keep, want] : cases) {
    try {
      save_checkpoint(dir / "ckpt", step, files, manifest, {.keep_last = keep});
      ADD_FAILURE() << "accepted: " << want;
    } catch (const InvalidArgument& e) {
      EXPECT_NE(std::string(e.what()).find(want), std::string::npos) << e.what();
    }
  }
  EXPECT_FALSE(fs::exists(dir / "ckpt"));
}

TEST(Checkpoint, PlainPythonVerifiesAndReadsACheckpoint) {
  if (std::system("command -v python3 >/dev/null 2>&1") != 0) COHORT_MISSING_DEP("python3 not found");
  TempDir dir;
  std::string path = save_checkpoint(dir.path(), 12, sample_files(0), sample_manifest(0));
  std::string script = (fs::path(__FILE__).parent_path() / "checkpoint" / "read_safetensors.py").string();
  std::string out_file = dir / "out.txt";
  ASSERT_EQ(std::system(fmt::format("python3 '{}' '{}' > '{}'", script, path, out_file).c_str()), 0);
  std::ifstream in(out_file);
  std::string out((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  EXPECT_NE(out.find("step 12 epoch 3 world_size 8"), std::string::npos) << out;
  EXPECT_NE(out.find("file model.safetensors size"), std::string::npos) << out;
  EXPECT_NE(out.find("ok\n"), std::string::npos) << out;
  NamedTensor w = sample_files(0)["model"][0];
  EXPECT_NE(out.find(fmt::format("model/layer1.weight F32 [4, 3] {:.6f}", pattern_sum(w, 0))), std::string::npos) << out;
  // A corrupt byte makes the independent CRC32C disagree too.
  std::vector<uint8_t> bytes = read_bytes(path + "/model.safetensors");
  bytes.back() ^= 1;
  write_bytes(path + "/model.safetensors", bytes);
  EXPECT_NE(std::system(fmt::format("python3 '{}' '{}' > /dev/null 2>&1", script, path).c_str()), 0);
}

}  // namespace

TEST(Checkpoint, ACheckpointWithoutARequiredFileIsSkipped) {
  TempDir dir;
  save_checkpoint(dir.path(), 1, sample_files(1), sample_manifest(1));
  std::string two = save_checkpoint(dir.path(), 2, {{"model", sample_files(2).at("model")}}, sample_manifest(2));
  const LoadOptions need{.required_files = {"model", "optimizer"}};
  try {
    load_checkpoint(two, need);
    ADD_FAILURE() << "loaded a checkpoint without optimizer.safetensors";
  } catch (const FormatError& e) {
    EXPECT_NE(std::string(e.what()).find("has no optimizer.safetensors (its manifest lists: model.safetensors)"),
              std::string::npos)
        << e.what();
  }
  EXPECT_EQ(load_latest_valid(dir.path(), need)->step, 1);
  EXPECT_EQ(load_latest_valid(dir.path())->step, 2);
}
