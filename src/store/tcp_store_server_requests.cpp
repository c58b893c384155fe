// TcpStoreServer's side of the protocol: the handshake, the meaning of each
// request (KvTable does the table work), and the waiters of GET and WAIT.
// Runs on the server's loop thread only; see tcp_store_server.cpp.
//
// Waiters. A GET or WAIT whose keys are missing parks its connection, listed
// under one key it still misses. A write to that key makes the waiter look
// again: it gets its answer, or moves to the list of its next missing key. So
// a write wakes only its own key's waiters, and every waiter sits in exactly
// one list (unlist() is then one erase). CANCEL answers a parked waiter at
// once, with the keys it still misses.
#include <fmt/format.h>

#include "cohort/error.hpp"
#include "core/log.hpp"
#include "store/tcp_store_server_impl.hpp"

namespace cohort {

using store::Op;
using store::Response;

// Returns the bytes the Hello took, or 0 when more must arrive (or c was dropped or refused).
size_t TcpStoreServer::Impl::parse_hello(Conn& c, const uint8_t* p, size_t avail) {
  using store::HelloVerdict;
  store::HelloCheck h = store::check_hello(p, avail, secret, c.nonce);
  switch (h.verdict) {
    case HelloVerdict::NeedMore: return 0;
    case HelloVerdict::Ok: c.greeted = true; reply(c, store::encode_welcome(store::WelcomeStatus::Ok)); return h.used;
    case HelloVerdict::BadMagic:
      drop(c, fmt::format("not a cohort store client (first bytes {:02x} {:02x} {:02x} {:02x})", p[0], p[1], p[2], p[3]), true);
      return 0;
    case HelloVerdict::BadVersion:
      COHORT_WARN(kStore, "store server {}: refused {}: protocol version {} (this server speaks {}); "
                  "HINT: run the same cohort version in every process", where, c.peer, h.version, store::kVersion);
      c.close_after_flush = true;
      reply(c, store::encode_welcome(store::WelcomeStatus::BadVersion));
      return 0;
    case HelloVerdict::BadSecret:
      COHORT_WARN(kStore, "store server {}: refused {}: it does not know the job secret (its proof "
                  "does not match); HINT: every process of the job needs the same COHORT_SECRET (or COHORT_SECRET_FILE)", where, c.peer);
      c.close_after_flush = true;
      reply(c, store::encode_welcome(store::WelcomeStatus::BadSecret));
      return 0;
  }
  return 0;
}

void TcpStoreServer::Impl::handle(Conn& c, Request&& req) {
  if (req.op == Op::Cancel) {  // late cancels (the answer already went out) are expected and ignored
    if (!c.waiting) return;
    unlist(c);
    c.waiting = false;
    Response r;
    r.status = store::Status::Cancelled;
    r.missing = table.missing(c.pending.keys);
    return reply(c, store::encode_response(c.pending.op, r));
  }
  if (c.busy())
    return drop(c, fmt::format("sent {} before reading the reply to its previous request (one request at a time)",
                               store::op_name(req.op)), true);
  Response r;
  switch (req.op) {
    case Op::Set:
      table.set(req.keys[0], std::move(req.value));
      reply(c, store::encode_response(req.op, r));
      return wake(req.keys[0]);
    case Op::Get:
    case Op::Wait:
      c.pending = std::move(req);
      c.waiting = true;
      return try_answer(c);
    case Op::Add:
      try {
        r.number = table.add(req.keys[0], req.delta);
      } catch (const InvalidArgument& e) {
        r.status = store::Status::Error;
        r.message = e.what();
        return reply(c, store::encode_response(req.op, r));
      }
      reply(c, store::encode_response(req.op, r));
      return wake(req.keys[0]);
    case Op::CompareSet: {
      bool stored = false;
      r.value = table.compare_set(req.keys[0], req.expected, req.value, &stored);
      reply(c, store::encode_response(req.op, r));
      if (stored) wake(req.keys[0]);
      return;
    }
    case Op::Check: r.flag = table.first_missing(req.keys) == nullptr; break;
    case Op::Delete: r.flag = table.erase(req.keys[0]); break;
    case Op::NumKeys: r.number = table.size(); break;
    case Op::Cancel: break;
  }
  reply(c, store::encode_response(req.op, r));
}

// c.waiting and c is in no list: answer it, or list it under a key it misses.
void TcpStoreServer::Impl::try_answer(Conn& c) {
  if (const std::string* missing = table.first_missing(c.pending.keys)) {
    c.waiting_on = *missing;
    waiters[*missing].push_back(&c);
    return;
  }
  c.waiting = false;
  Response r;
  if (c.pending.op == Op::Get) r.value = *table.find(c.pending.keys[0]);
  Op op = c.pending.op;
  c.pending = Request{};
  reply(c, store::encode_response(op, r));
}

void TcpStoreServer::Impl::wake(const std::string& key) {
  auto it = waiters.find(key);
  if (it == waiters.end()) return;
  std::vector<Conn*> listed = std::move(it->second);
  waiters.erase(it);
  for (Conn* c : listed)
    if (!c->dead && c->waiting) try_answer(*c);
}

void TcpStoreServer::Impl::unlist(Conn& c) {
  auto it = waiters.find(c.waiting_on);
  if (it == waiters.end()) return;
  std::erase(it->second, &c);
  if (it->second.empty()) waiters.erase(it);
}

}  // namespace cohort
