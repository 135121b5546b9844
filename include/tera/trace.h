/* The timeline (src/obs/trace.c, docs/MONITORING.md): with logging.trace = PATH, the steps of the
 * window logging.trace_steps = "FIRST:COUNT" are recorded as Chrome trace-event "X" (complete)
 * events: pid = world rank; tid 0 the compute thread (steps, profiled operations, optimizer, data
 * waits, checkpoint pauses), 1 comm (collectives issued by the compute thread, waits on non-blocking
 * ones), 2 the checkpoint writer, 3 the data prefetcher. Events go into a ring allocated at start
 * (a claimed slot index, one atomic add; nothing is allocated while recording); when it is full,
 * later events are counted as dropped. At the end every rank writes its part and world rank 0
 * merges them into PATH (written to a temporary name and renamed), sorted per thread by start. */
#ifndef TERA_TRACE_H
#define TERA_TRACE_H

#include <stdint.h>

#include "tera/comm.h"
#include "tera/config.h"
#include "tera/status.h"

enum { TERA_TRACE_COMPUTE = 0, TERA_TRACE_COMM = 1, TERA_TRACE_CKPT = 2, TERA_TRACE_DATA = 3, TERA_TRACE_NTIDS = 4 };

/* 1 while the current step is inside the window (read by the hooks; a relaxed check) */
extern volatile int tera_trace_active;

/* Parses logging.trace_steps and allocates the ring (events per step estimated from the model's
 * layer count). logging.trace = "": nothing (every hook is a no-op). Errors name the key. */
tera_status tera_trace_start(const tera_logging_config *lc, int n_layers, int world_rank, int world_size);
/* The step loop: turns recording on at the window's first step and off after its last one. */
void tera_trace_step_begin(int64_t step);
/* One complete event of [t0, t1] (tera_now() seconds) on thread `tid`; `name` must be a string
 * literal or otherwise live to the end (it is stored as a pointer). arg >= 0 is shown as args.layer
 * (args.bytes for the comm category). Any thread; recorded while the window is open, or when it
 * began before the window closed (a background write ending later); not after tera_trace_finish. */
void tera_trace_event(int tid, const char *name, const char *cat, double t0, double t1, int64_t arg);
/* A collective issued by this process's compute thread (other threads' collectives are not drawn). */
void tera_trace_comm(const char *name, double t0, double t1, int64_t bytes);
/* Collective over `world` (every rank calls it at the same point, after the last step): writes this
 * rank's part, and world rank 0 merges every part into logging.trace. No-op when off. */
tera_status tera_trace_finish(tera_comm *world);
/* Frees the ring (no output); safe when off or after finish. Call it once every thread that records
 * (the prefetcher, the checkpoint writer) has stopped. */
void tera_trace_stop(void);
/* Events recorded and dropped so far (tests). */
int64_t tera_trace_recorded(void);
int64_t tera_trace_dropped(void);

#endif
