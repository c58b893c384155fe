// cohort/cohort.hpp: everything a training program needs.
#pragma once

#include "cohort/data.hpp"           // DistributedSampler, Loader, read_idx, FashionMnist
#include "cohort/checkpoint.hpp"     // save_checkpoint, load_latest_valid, safetensors files
#include "cohort/error.hpp"          // Error, TimeoutError, PeerError, InvalidArgument, IoError, FormatError
#include "cohort/metrics.hpp"        // StepMetrics: compute / exposed communication / data wait per step
#include "cohort/process_group.hpp"  // init_process_group, ProcessGroup, Work, options
#include "cohort/stop_signal.hpp"    // StopSignal: save and stop at a step every rank agrees on, on SIGTERM
#include "cohort/store.hpp"          // Store, TcpStore, MemoryStore, PrefixStore
#include "cohort/timeline.hpp"       // timeline::Span: your own phases on the COHORT_TIMELINE trace
#include "cohort/types.hpp"          // DType, ReduceOp, Buffer
