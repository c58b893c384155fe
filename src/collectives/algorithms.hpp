// Every collective algorithm, one per file in this folder. Each takes a Comm
// whose key and deadline are set, raw byte pointers and counts that the group
// layer has validated, and blocks until this rank's part is done.
// ReduceOp::Avg arrives here as Sum; the group layer divides afterwards, except
// for the ring algorithms, which take avg_div (the group size for Avg, else 0)
// and divide each piece of the result as its last reduction lands.
#pragma once

#include <span>
#include <vector>

#include <cstddef>
#include <cstdint>

#include "collectives/comm.hpp"

namespace cohort::collectives {

// allreduce
void allreduce_ring(Comm& c, const uint8_t* send, uint8_t* recv, size_t count, DType t, ReduceOp op, int avg_div = 0);
// Every peer over shm with single copy (ShmTransport::single_copy): one copy per byte.
// With shared_only it runs only if every rank's buffers are shared buffers (all
// ranks see the same swapped addresses, so all agree) and otherwise returns
// false having moved no data: the caller then runs another algorithm.
// `pieces` (in place only: send == recv) are input elements still outside the
// buffer (ProcessGroup::allreduce_gathered): those in this rank's own block are
// read where they are, the rest are copied in before any peer may read them;
// when it returns false, all of them are in the buffer.
bool allreduce_single_copy(Comm& c, const uint8_t* send, uint8_t* recv, size_t count, DType t, ReduceOp op,
                           int avg_div = 0, bool shared_only = false, std::span<const InputPiece> pieces = {});
// The ring's two halves, for algorithms built from them: after the first,
// chunk ring_owned_chunk(rank, n) of `count` (cut by chunk_off / chunk_len) of
// recv holds the reduction over all ranks (divided by avg_div when it is not
// 0); the second sends every rank's owned chunk to every rank.
void ring_reduce_scatter_phase(Comm& c, const uint8_t* send, uint8_t* recv, size_t count, DType t, ReduceOp op,
                               int avg_div = 0);
void ring_allgather_phase(Comm& c, uint8_t* recv, size_t count, DType t);
inline int ring_owned_chunk(int rank, int n) { return (rank + 1) % n; }
// Node-aware: the ring's reduce-scatter among the ranks of this host (`local`,
// shared memory), an allreduce of this rank's chunk among the ranks with the
// same local index on every host (`cross`: recursive doubling up to
// cross_rd_max bytes, the ring above), then the ring's allgather on the host.
// Only 1/L of the buffer crosses between hosts per rank (L ranks per host),
// where a flat ring sends 2 (n-1)/n of it over each link it crosses.
// With try_single_copy (the host's shm links allow single copy) the local
// ranks swap their buffers' addresses first: when all of them are shared
// buffers the host's two phases load and store the peers' buffers directly
// instead of passing through shm slots (every local rank sees the same
// answer); otherwise the ring's halves as above. True when the host's phases
// ran by single copy.
bool allreduce_hierarchical(Comm& local, Comm& cross, const uint8_t* send, uint8_t* recv, size_t count, DType t,
                            ReduceOp op, int avg_div, size_t cross_rd_max, bool try_single_copy = false);
// The same structure for the other collectives (allreduce_hierarchical.cpp
// says why), on views local and cross as above; members[h][j] is the group
// rank at local index j of host h (HostLayout::members). Each sends its data
// across hosts once, among the ranks of one local index:
//   allgather: allgather across hosts, then on the host an allgather per host's blocks, each
//     block received where it lies in the output (no staging, no reordering);
//   reduce_scatter: on the host a reduce-scatter per host's blocks, read where they lie in the
//     input, into an H-block bundle; then a reduce-scatter of the bundle across hosts;
//   broadcast: the root's local index broadcasts across hosts, then every host broadcasts inside
//   (binomial up to binomial_max bytes, the pipelined chain above).
using Members = std::vector<std::vector<int>>;
// With try_single_copy, allgather (on shared outputs) and reduce_scatter (on
// shared inputs) run the host's phase by single copy as allreduce_hierarchical
// does (hierarchical_others.cpp), and return true when they did.
bool allgather_hierarchical(Comm& local, Comm& cross, const Members& members, const uint8_t* send, uint8_t* recv,
                            size_t bytes_per_rank, bool try_single_copy = false);
bool reduce_scatter_hierarchical(Comm& local, Comm& cross, const Members& members, const uint8_t* send, uint8_t* recv,
                                 size_t count_per_rank, DType t, ReduceOp op, int avg_div, bool try_single_copy = false);
void broadcast_hierarchical(Comm& local, Comm& cross, const Members& members, uint8_t* buf, size_t bytes, int root,
                            size_t binomial_max, size_t segment);
void allreduce_recursive_doubling(Comm& c, const uint8_t* send, uint8_t* recv, size_t count, DType t, ReduceOp op);

// broadcast
void broadcast_binomial(Comm& c, uint8_t* buf, size_t bytes, int root);
void broadcast_pipeline(Comm& c, uint8_t* buf, size_t bytes, int root, size_t segment);

// reduce
void reduce_binomial(Comm& c, const uint8_t* send, uint8_t* recv, size_t count, DType t, ReduceOp op, int root);

// allgather / reduce_scatter
void allgather_ring(Comm& c, const uint8_t* send, uint8_t* recv, size_t bytes_per_rank);
void allgather_direct(Comm& c, const uint8_t* send, uint8_t* recv, size_t bytes_per_rank);
void reduce_scatter_ring(Comm& c, const uint8_t* send, uint8_t* recv, size_t count_per_rank, DType t, ReduceOp op,
                         int avg_div = 0);
// The same rings over blocks anywhere in one buffer: rank r's block starts at
// byte offsets[r] (of recv for allgather, where this rank's own block must
// already be; of send for reduce_scatter). The node-aware algorithms use them
// to move blocks straight between their places in rank order.
void allgather_ring_blocks(Comm& c, uint8_t* recv, std::span<const size_t> offsets, size_t bytes_per_rank);
void reduce_scatter_ring_blocks(Comm& c, const uint8_t* send, std::span<const size_t> offsets, uint8_t* recv,
                                size_t count_per_rank, DType t, ReduceOp op, int avg_div = 0);
// Every peer over shm with single copy: each byte crosses once, pulled by the
// rank that needs it (in place as allgather_ring / reduce_scatter_ring take it);
// allgather into shared outputs of at least allgather_push_min() bytes in all
// pushes instead (each rank writes its block into every output). With shared_only they run only when every rank's input is a shared buffer
// (all ranks agree) and otherwise return false having moved no data: the
// caller then runs the ring.
bool allgather_single_copy(Comm& c, const uint8_t* send, uint8_t* recv, size_t bytes_per_rank,
                           bool shared_only = false);
// COHORT_ALLGATHER_PUSH_BYTES of this process (SIZE_MAX when set to 0: never).
size_t allgather_push_min();
bool reduce_scatter_single_copy(Comm& c, const uint8_t* send, uint8_t* recv, size_t count_per_rank, DType t,
                                ReduceOp op, int avg_div = 0, bool shared_only = false);

// rooted and personalised
void gather_linear(Comm& c, const uint8_t* send, uint8_t* recv, size_t bytes_per_rank, int root);
void scatter_linear(Comm& c, const uint8_t* send, uint8_t* recv, size_t bytes_per_rank, int root);
void alltoall_direct(Comm& c, const uint8_t* send, uint8_t* recv, size_t bytes_per_rank);

// synchronisation
void barrier_dissemination(Comm& c);

}  // namespace cohort::collectives
