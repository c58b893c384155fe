// store/tcp_store_server_impl.hpp: the state of a TcpStoreServer, shared by
// its two source files: tcp_store_server.cpp (the event loop, sockets,
// buffers) and tcp_store_server_requests.cpp (handshake, requests, waiters).
// After the constructor, everything here belongs to the loop thread.
#pragma once

#include <sys/epoll.h>

#include <memory>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include "cohort/store.hpp"
#include "store/kv_table.hpp"
#include "store/net.hpp"
#include "store/tcp_protocol.hpp"

namespace cohort {
namespace store {

using Nonce = std::array<uint8_t, kNonceBytes>;

constexpr size_t kReadChunk = 256 * 1024;  // one recv() at most

// One client connection.
struct Conn {
  net::Fd fd;
  std::string peer;
  bool greeted = false;
  Nonce nonce{};                   // this connection's challenge
  bool dead = false;               // dropped; closed at the end of this epoll batch
  bool close_after_flush = false;  // refused handshake: close once the Welcome is out
  Bytes in;                        // unparsed bytes: at most one partial frame
  Bytes out;                       // the response being written
  size_t out_off = 0;
  uint32_t events = 0;             // what epoll watches for this socket
  bool waiting = false;            // a GET/WAIT is parked (pending, listed under waiting_on)
  Request pending;
  std::string waiting_on;

  bool busy() const { return waiting || out_off < out.size(); }
};

}  // namespace store

struct COHORT_HIDDEN TcpStoreServer::Impl {
  using Conn = store::Conn;
  using Request = store::Request;

  std::string host;
  uint16_t port = 0;
  std::string where;  // "host:port" for every message
  std::string secret = store::configured_secret();
  uint64_t max_frame = store::configured_max_frame();
  store::net::Fd listen_fd, epoll_fd, wake_fd;
  std::thread loop;

  // Owned by the loop thread once it runs.
  store::KvTable table;
  std::unordered_map<int, std::unique_ptr<Conn>> conns;
  std::unordered_map<std::string, std::vector<Conn*>> waiters;  // missing key -> parked connections
  std::vector<int> doomed;
  Bytes scratch = Bytes(store::kReadChunk);
  bool accept_paused = false;

  // tcp_store_server.cpp: the loop and the sockets.
  void run();
  void accept_all();
  void on_event(Conn& c, uint32_t ev);
  void read_some(Conn& c);
  void parse(Conn& c);  // splits c.in into the Hello and frames; calls parse_hello / handle
  void reply(Conn& c, Bytes frame);
  void flush(Conn& c);
  void watch(Conn& c, uint32_t events);
  void drop(Conn& c, const std::string& why, bool warn);  // marks c; reap() closes it
  void reap();

  // tcp_store_server_requests.cpp: what the bytes mean.
  size_t parse_hello(Conn& c, const uint8_t* p, size_t avail);
  void handle(Conn& c, Request&& req);
  void try_answer(Conn& c);
  void wake(const std::string& key);
  void unlist(Conn& c);
};

}  // namespace cohort
