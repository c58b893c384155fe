// cohort/cohort.hpp: everything a training program needs.
#pragma once

#include "cohort/data.hpp"           // DistributedSampler, Loader, read_idx, FashionMnist
#include "cohort/error.hpp"          // Error, TimeoutError, PeerError, InvalidArgument, IoError
#include "cohort/process_group.hpp"  // init_process_group, ProcessGroup, Work, options
#include "cohort/store.hpp"          // Store, TcpStore, MemoryStore, PrefixStore
#include "cohort/types.hpp"          // DType, ReduceOp, Buffer
