/* profiler.h: per-op time (torch.profiler's key averages).
 *
 * While enabled, every op the Lua API calls (the functions of the op headers, the collectives, redistribute, the
 * device copies; ENGINE_PROFILE=1 or engine.profiler.enable() installs the wrapper) and every autograd node's
 * backward (its name, e.g. "MmBackward") is timed: host time from entry to return, and on a CUDA machine the GPU
 * time between two events recorded on the compute stream around it (resolved when the events complete, without
 * waiting, or at the report).  Entries are keyed by name; nested ops count in their own entry and in the caller's.
 * The report lists them by total time (GPU time where there is any, else host time). */
#ifndef ENG_PROFILER_H
#define ENG_PROFILER_H
#include <stdint.h>
#include <stddef.h>
#include "tensor.h"

typedef struct eng_profile_entry {
  char name[64];
  int64_t calls;
  int64_t host_ns;   /* summed host time */
  int64_t gpu_ns;    /* summed GPU time (resolved events) */
  int64_t gpu_calls; /* calls whose GPU time is in gpu_ns */
  int64_t bytes;     /* summed bytes of the results (tensors returned) */
} eng_profile_entry;

/* on: start (1) or stop (0) recording; print_at_exit: print the report (rank 0, or every rank with
 * ENGINE_PROFILE=all) when the process exits. */
int eng_profiler_enable(int on, int print_at_exit);
int eng_profiler_enabled(void);
void eng_profiler_reset(void);
/* A timed region: begin returns a token for end (-1 when disabled or too deeply nested). */
int64_t eng_profiler_begin(const char* name);
void eng_profiler_end(int64_t token, int64_t bytes);
/* The entries so far (pending GPU times resolved first, waiting for them), sorted by total time; returns the
 * number of entries (at most cap copied). */
int eng_profiler_entries(eng_profile_entry* out, int cap);
/* The report as text into buf (truncated to cap); returns the length it needs. */
int64_t eng_profiler_report(char* buf, int64_t cap);

#endif
