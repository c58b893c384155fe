// cohort/store.hpp: the key-value store ranks use to find each other.
//
// Like c10d's Store: a rendezvous point, not a database. Every blocking call
// has a deadline (the store's timeout unless given) and a TimeoutError names
// the keys it waited for. Implementations are safe to call from any thread.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>
#include "cohort/export.hpp"

namespace cohort {

using Bytes = std::vector<uint8_t>;
using Millis = std::chrono::milliseconds;

class COHORT_API Store {
 public:
  virtual ~Store() = default;

  virtual void set(const std::string& key, const Bytes& value) = 0;
  // Blocks until `key` exists (up to timeout), then returns its value.
  virtual Bytes get(const std::string& key, Millis timeout) = 0;
  // Atomically adds delta to the integer stored at key (missing = 0); returns the new value.
  virtual int64_t add(const std::string& key, int64_t delta) = 0;
  // If key is missing and expected is empty, or key holds expected: store desired.
  // Returns the value now stored (desired on success, the current one on a mismatch;
  // expected when the key is missing and expected is not empty), as c10d does.
  virtual Bytes compare_set(const std::string& key, const Bytes& expected, const Bytes& desired) = 0;
  // Blocks until every key exists or the timeout passes (TimeoutError naming the missing keys).
  virtual void wait(const std::vector<std::string>& keys, Millis timeout) = 0;
  // True if every key exists now. Never blocks on the keys.
  virtual bool check(const std::vector<std::string>& keys) = 0;
  // Returns true if the key existed.
  virtual bool delete_key(const std::string& key) = 0;
  virtual int64_t num_keys() = 0;

  // Conveniences on top of the calls above.
  Bytes get(const std::string& key) { return get(key, timeout_); }
  void wait(const std::vector<std::string>& keys) { wait(keys, timeout_); }
  void set_string(const std::string& key, const std::string& value) { set(key, Bytes(value.begin(), value.end())); }
  std::string get_string(const std::string& key) { auto b = get(key); return std::string(b.begin(), b.end()); }
  std::string get_string(const std::string& key, Millis timeout) { auto b = get(key, timeout); return std::string(b.begin(), b.end()); }

  Millis timeout() const { return timeout_; }
  void set_timeout(Millis t) { timeout_ = t; }

 protected:
  Millis timeout_{std::chrono::minutes(5)};
};

// In-process store for tests: ranks run as threads and share one instance.
class COHORT_API MemoryStore : public Store {
 public:
  MemoryStore();
  ~MemoryStore() override;
  void set(const std::string& key, const Bytes& value) override;
  Bytes get(const std::string& key, Millis timeout) override;
  int64_t add(const std::string& key, int64_t delta) override;
  Bytes compare_set(const std::string& key, const Bytes& expected, const Bytes& desired) override;
  void wait(const std::vector<std::string>& keys, Millis timeout) override;
  bool check(const std::vector<std::string>& keys) override;
  bool delete_key(const std::string& key) override;
  int64_t num_keys() override;
  using Store::get;
  using Store::wait;

 private:
  struct State;
  std::unique_ptr<State> state_;
};

// Namespaces every key with "prefix/" on top of another store (sub-groups, restarts).
class COHORT_API PrefixStore : public Store {
 public:
  PrefixStore(std::string prefix, std::shared_ptr<Store> base);
  void set(const std::string& key, const Bytes& value) override;
  Bytes get(const std::string& key, Millis timeout) override;
  int64_t add(const std::string& key, int64_t delta) override;
  Bytes compare_set(const std::string& key, const Bytes& expected, const Bytes& desired) override;
  void wait(const std::vector<std::string>& keys, Millis timeout) override;
  bool check(const std::vector<std::string>& keys) override;
  bool delete_key(const std::string& key) override;
  int64_t num_keys() override;  // counts the base store's keys (as c10d does)
  using Store::get;
  using Store::wait;
  const std::shared_ptr<Store>& base() const { return base_; }

 private:
  std::string k(const std::string& key) const { return prefix_ + "/" + key; }
  std::vector<std::string> k(const std::vector<std::string>& keys) const;
  std::string prefix_;
  std::shared_ptr<Store> base_;
};

// The server half of TcpStore: an event loop on its own thread. Owned by the
// launcher, or by rank 0 when a program starts without the launcher.
class COHORT_API TcpStoreServer {
 public:
  // Binds host:port (port 0 picks a free one; see port()). Throws IoError with
  // the address when the port is taken.
  TcpStoreServer(const std::string& host, uint16_t port);
  ~TcpStoreServer();  // stops the loop and closes every connection
  TcpStoreServer(const TcpStoreServer&) = delete;
  TcpStoreServer& operator=(const TcpStoreServer&) = delete;
  uint16_t port() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

struct COHORT_API TcpStoreOptions {
  std::string host = "127.0.0.1";
  uint16_t port = 29500;
  bool is_server = false;      // also run a TcpStoreServer in this process
  Millis timeout{std::chrono::minutes(5)};
  Millis connect_timeout{std::chrono::seconds(60)};  // keep retrying while the server starts
  // Where the in-process server listens when is_server: every IPv4 interface by
  // default, as c10d does. `host` is how other machines reach this one; bound
  // here it could catch the wrong interface (a hostname that /etc/hosts maps
  // to 127.0.1.1, say).
  std::string server_host = "0.0.0.0";
};

// The client. One TCP connection; calls from several threads are serialised.
class COHORT_API TcpStore : public Store {
 public:
  explicit TcpStore(TcpStoreOptions opts);
  ~TcpStore() override;
  void set(const std::string& key, const Bytes& value) override;
  Bytes get(const std::string& key, Millis timeout) override;
  int64_t add(const std::string& key, int64_t delta) override;
  Bytes compare_set(const std::string& key, const Bytes& expected, const Bytes& desired) override;
  void wait(const std::vector<std::string>& keys, Millis timeout) override;
  bool check(const std::vector<std::string>& keys) override;
  bool delete_key(const std::string& key) override;
  int64_t num_keys() override;
  using Store::get;
  using Store::wait;
  uint16_t port() const;  // the server's port (useful with port 0 and is_server)

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace cohort
