// MemFs: an in-memory Filesystem that models what survives a power loss.
//
// Each file has its current bytes and its durable bytes (as of its last sync).
// Each directory has its current entries and its durable entries (as of its
// last sync_dir). power_loss() throws away everything not durable: every
// directory reverts to its durable entries and every file to its durable bytes,
// so a file that was fsync'ed but whose directory entry was not vanishes, and a
// rename that was not followed by sync_dir of the directory is undone. This is
// the contract POSIX gives (and ext4/xfs are close to it), without the luck of
// a journal that happens to commit more. Paths are absolute ("/ckpt/step_1").
#pragma once

#include <cstring>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "cohort/error.hpp"
#include "cohort/filesystem.hpp"

namespace cohort::testing {

class MemFs final : public Filesystem {
 public:
  MemFs() : root_(std::make_shared<Node>(true)) {}

  // Drops everything that was not made durable by sync / sync_dir.
  void power_loss() {
    std::set<Node*> seen;
    revert(root_, seen);
  }

  // Overwrites one byte of a file (current and durable): disk corruption.
  void corrupt(const std::string& path, size_t offset) {
    auto n = find(path);
    n->data.at(offset) ^= 0x01;
    n->durable_data = n->data;
  }

  std::unique_ptr<WritableFile> create_file(const std::string& path) override {
    auto [parent, leaf] = parent_of(path);
    auto& slot = parent->kids[leaf];
    if (slot && slot->dir) throw IoError("memfs: create_file on a directory: " + path);
    if (!slot) slot = std::make_shared<Node>(false);
    slot->data.clear();
    return std::make_unique<File>(slot);
  }
  std::unique_ptr<ReadableFile> open_file(const std::string& path) override {
    auto n = find(path);
    if (n->dir) throw IoError("memfs: open_file on a directory: " + path);
    return std::make_unique<Reader>(n->data, path);
  }
  void create_dir(const std::string& path) override {
    auto [parent, leaf] = parent_of(path);
    if (parent->kids.count(leaf)) throw IoError("memfs: create_dir: exists: " + path);
    parent->kids[leaf] = std::make_shared<Node>(true);
  }
  void sync_dir(const std::string& path) override {
    auto n = find(path);
    if (!n->dir) throw IoError("memfs: sync_dir on a file: " + path);
    n->durable_kids = n->kids;
  }
  void rename(const std::string& from, const std::string& to) override {
    auto [fp, fl] = parent_of(from);
    auto [tp, tl] = parent_of(to);
    auto it = fp->kids.find(fl);
    if (it == fp->kids.end()) throw IoError("memfs: rename: no such entry: " + from);
    auto existing = tp->kids.find(tl);
    if (existing != tp->kids.end() && existing->second->dir && !existing->second->kids.empty())
      throw IoError("memfs: rename: target directory not empty: " + to);
    auto node = it->second;
    fp->kids.erase(it);
    tp->kids[tl] = node;
  }
  void remove_file(const std::string& path) override {
    auto [parent, leaf] = parent_of(path);
    auto it = parent->kids.find(leaf);
    if (it == parent->kids.end() || it->second->dir) throw IoError("memfs: remove_file: no such file: " + path);
    parent->kids.erase(it);
  }
  void remove_dir(const std::string& path) override {
    auto [parent, leaf] = parent_of(path);
    auto it = parent->kids.find(leaf);
    if (it == parent->kids.end() || !it->second->dir || !it->second->kids.empty())
      throw IoError("memfs: remove_dir: missing or not empty: " + path);
    parent->kids.erase(it);
  }
  std::vector<DirEntry> list_dir(const std::string& path) override {
    auto n = find(path);
    std::vector<DirEntry> out;
    for (const auto& [name, kid] : n->kids) out.push_back({name, kid->dir});
    return out;
  }
  bool exists(const std::string& path) override { return lookup(path) != nullptr; }
  bool is_dir(const std::string& path) override {
    auto n = lookup(path);
    return n && n->dir;
  }

 private:
  struct Node {
    explicit Node(bool d) : dir(d) {}
    bool dir;
    std::string data, durable_data;
    std::map<std::string, std::shared_ptr<Node>> kids, durable_kids;
  };

  class File final : public WritableFile {
   public:
    explicit File(std::shared_ptr<Node> n) : n_(std::move(n)) {}
    void append(const void* data, size_t n) override { n_->data.append(static_cast<const char*>(data), n); }
    void sync() override { n_->durable_data = n_->data; }
    void close() override {}

   private:
    std::shared_ptr<Node> n_;
  };

  class Reader final : public ReadableFile {
   public:
    Reader(std::string data, std::string path) : data_(std::move(data)), path_(std::move(path)) {}
    uint64_t size() override { return data_.size(); }
    void read_at(uint64_t offset, void* out, size_t n) override {
      if (offset > data_.size() || n > data_.size() - offset) throw IoError("memfs: short read: " + path_);
      if (n) std::memcpy(out, data_.data() + offset, n);
    }

   private:
    std::string data_, path_;
  };

  static void revert(const std::shared_ptr<Node>& n, std::set<Node*>& seen) {
    if (!seen.insert(n.get()).second) return;
    n->data = n->durable_data;
    n->kids = n->durable_kids;
    for (auto& [name, kid] : n->kids) revert(kid, seen);
  }

  std::shared_ptr<Node> lookup(const std::string& path) const {
    if (path.empty() || path[0] != '/') return nullptr;
    auto n = root_;
    size_t pos = 1;
    while (pos < path.size()) {
      size_t slash = path.find('/', pos);
      std::string part = path.substr(pos, slash == std::string::npos ? std::string::npos : slash - pos);
      pos = slash == std::string::npos ? path.size() : slash + 1;
      if (part.empty()) continue;
      if (!n->dir) return nullptr;
      auto it = n->kids.find(part);
      if (it == n->kids.end()) return nullptr;
      n = it->second;
    }
    return n;
  }

  std::shared_ptr<Node> find(const std::string& path) const {
    auto n = lookup(path);
    if (!n) throw IoError("memfs: no such file or directory: " + path);
    return n;
  }

  std::pair<std::shared_ptr<Node>, std::string> parent_of(const std::string& path) const {
    auto slash = path.find_last_of('/');
    if (slash == std::string::npos || slash + 1 == path.size()) throw IoError("memfs: bad path: " + path);
    auto parent = find(slash == 0 ? "/" : path.substr(0, slash));
    if (!parent->dir) throw IoError("memfs: not a directory: " + path.substr(0, slash));
    return {parent, path.substr(slash + 1)};
  }

  std::shared_ptr<Node> root_;
};

}  // namespace cohort::testing
