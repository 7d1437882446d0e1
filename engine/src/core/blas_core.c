/* blas_core.c: which OpenBLAS kernels run, chosen from the CPU's features rather than its model number.
 *
 * OpenBLAS (DYNAMIC_ARCH) picks its kernels when the library loads, before main, from OPENBLAS_CORETYPE or else
 * from the CPU's vendor, family and model.  A CPU newer than the OpenBLAS build (an Intel Xeon of family 6 model
 * 207 under 0.3.21, some AMD parts) gets the generic Prescott kernels, sgemm about 4x slower than SkylakeX.  The
 * engine host calls eng_blas_core_select() first thing in main: it reads CPUID and the OS's XSAVE state (XGETBV)
 * itself, and when OpenBLAS picked a weaker class of core than the features allow (an SSE-class core on an AVX2+FMA
 * CPU, an AVX2-class one on an AVX-512 CPU), it asks the host to re-execute once with OPENBLAS_CORETYPE set to the
 * best core for those features: SapphireRapids (AMX-BF16 and AMX-TILE enabled by the OS), Cooperlake (AVX-512 BF16),
 * SkylakeX (AVX-512 F/BW/VL/DQ), Haswell (AVX2+FMA).  A name this OpenBLAS does not know (it falls back to its own
 * choice) is detected after the re-exec, openblas_get_corename() differing from the name asked, and the next best is
 * tried, as long as it would improve on what runs.  ENGINE_BLAS_REEXEC marks a re-executed process (the step of
 * the list it asked for, what OpenBLAS had picked, the preset) so nothing loops; ENGINE_BLAS_NOBETTER remembers,
 * for child processes, that no name helped.  ENGINE_BLAS_CORETYPE overrides: "auto" (the default), "keep" (leave
 * OpenBLAS's choice and OPENBLAS_CORETYPE alone) or a core name (used as OPENBLAS_CORETYPE, unless the CPU lacks
 * the features it needs: then as "auto", saying so).  eng_blas_core_reason() says why the core in use runs (docs/design.md, "BLAS kernels"). */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include <errno.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include "eng/base.h"
#if defined(__x86_64__) && defined(__GNUC__)
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

extern char* openblas_get_corename(void);

typedef struct {
  int avx2_fma; /* AVX2 and FMA, AVX state enabled by the OS */
  int avx512;   /* AVX-512 F, DQ, BW and VL, opmask/ZMM state enabled by the OS */
  int bf16;     /* AVX-512 BF16 (with avx512) */
  int amx;      /* AMX-BF16 and AMX-TILE, tile state enabled by the OS (with bf16) */
} cpu_caps;

static cpu_caps cpu_features(void) {
  cpu_caps c = {0, 0, 0, 0};
#if defined(__x86_64__) && defined(__GNUC__)
  unsigned a, b, cx, d;
  if (!__get_cpuid(1, &a, &b, &cx, &d)) return c;
  int fma = (cx >> 12) & 1, osxsave = (cx >> 27) & 1, avx = (cx >> 28) & 1;
  if (!osxsave || !avx) return c;
  unsigned xlo, xhi;
  __asm__ volatile("xgetbv" : "=a"(xlo), "=d"(xhi) : "c"(0));
  uint64_t xcr0 = ((uint64_t)xhi << 32) | xlo;
  if ((xcr0 & 0x6) != 0x6) return c; /* XMM and YMM state */
  unsigned max7, b7, c7, d7;
  if (!__get_cpuid_count(7, 0, &max7, &b7, &c7, &d7)) return c;
  c.avx2_fma = fma && ((b7 >> 5) & 1);
  const unsigned f_dq_bw_vl = (1u << 16) | (1u << 17) | (1u << 30) | (1u << 31);
  c.avx512 = c.avx2_fma && (b7 & f_dq_bw_vl) == f_dq_bw_vl && (xcr0 & 0xe0) == 0xe0; /* opmask, ZMM_Hi256, Hi16_ZMM */
  if (c.avx512 && max7 >= 1) {
    unsigned a1, b1, c1, d1;
    if (__get_cpuid_count(7, 1, &a1, &b1, &c1, &d1)) c.bf16 = (a1 >> 5) & 1;
  }
  c.amx = c.bf16 && ((d7 >> 22) & 1) && ((d7 >> 24) & 1) && (xcr0 & 0x60000) == 0x60000; /* XTILECFG, XTILEDATA */
#ifdef SYS_arch_prctl
  if (c.amx) { /* Linux enables tile data per process on request: the kernel must offer it (ARCH_GET_XCOMP_SUPP) */
    unsigned long supp = 0;
    if (syscall(SYS_arch_prctl, 0x1022, &supp) == 0 && !(supp & (1ul << 18))) c.amx = 0;
  }
#endif
#endif
  return c;
}

/* The class of an OpenBLAS core: 4 AMX, 3 AVX-512 BF16, 2 AVX-512, 1 AVX2+FMA, 0 older or unknown. */
static int core_level(const char* name) {
  static const struct { const char* name; int level; } k[] = {
    {"SapphireRapids", 4}, {"Cooperlake", 3}, {"SkylakeX", 2}, {"Haswell", 1}, {"Zen", 1}, {"Excavator", 1},
  };
  for (size_t i = 0; i < sizeof k / sizeof k[0]; i++)
    if (!strcasecmp(name, k[i].name)) return k[i].level;
  return 0;
}
/* What sgemm gains from: the AVX-512 cores share their sgemm kernels (2), AVX2+FMA (1), older (0). */
static int sgemm_class(int level) { return level >= 2 ? 2 : level; }
static int caps_level(cpu_caps c) { return c.amx ? 4 : c.bf16 ? 3 : c.avx512 ? 2 : c.avx2_fma ? 1 : 0; }

static const char* caps_text(cpu_caps c) {
  return c.amx ? "AVX-512, AVX-512 BF16 and AMX" : c.bf16 ? "AVX-512 and AVX-512 BF16" : c.avx512 ? "AVX-512"
       : c.avx2_fma ? "AVX2+FMA" : "neither AVX2+FMA nor AVX-512";
}
static const char* level_text(int level) {
  return level >= 4 ? "AMX" : level == 3 ? "AVX-512 BF16" : level == 2 ? "AVX-512" : "AVX2+FMA";
}

/* The cores to ask for, best first. */
static int candidates(cpu_caps c, const char** out) {
  int n = 0;
  if (c.amx) out[n++] = "SapphireRapids";
  if (c.bf16) out[n++] = "Cooperlake";
  if (c.avx512) out[n++] = "SkylakeX";
  if (c.avx2_fma) out[n++] = "Haswell";
  return n;
}

static char g_reason[384];
static int g_selected;
static char g_want[64];
static char g_preset[128];
static int g_had_preset;

static const char* corename(void) {
  const char* s = openblas_get_corename();
  return s ? s : "?";
}

static const char* reexec(const char* want, const char* marker, const char* preset) {
  g_had_preset = preset != NULL;
  snprintf(g_preset, sizeof g_preset, "%s", preset ? preset : "");
  snprintf(g_want, sizeof g_want, "%s", want);
  setenv("OPENBLAS_CORETYPE", g_want, 1);
  setenv("ENGINE_BLAS_REEXEC", marker, 1);
  return g_want;
}

static const char* select_auto(cpu_caps c, const char* got, const char* cur, const char* marker) {
  const char* cand[4];
  int n = candidates(c, cand);
  int need = sgemm_class(caps_level(c));
  char mark[256];
  if (marker) { /* a re-executed process: "step:picked:preset" */
    int step = atoi(marker);
    const char* p1 = strchr(marker, ':');
    const char* p2 = p1 ? strchr(p1 + 1, ':') : NULL;
    char picked[64], preset[128];
    snprintf(picked, sizeof picked, "%.*s", p1 && p2 ? (int)(p2 - p1 - 1) : 1, p1 && p2 ? p1 + 1 : "?");
    snprintf(preset, sizeof preset, "%s", p2 ? p2 + 1 : "");
    char from[192], skipped[160] = "";
    if (*preset) snprintf(from, sizeof from, ", from OPENBLAS_CORETYPE=%s", preset);
    else from[0] = 0;
    unsetenv("ENGINE_BLAS_REEXEC");
    if (step < 0 || step >= n) step = n - 1;
    for (int i = 0; i < step; i++)
      snprintf(skipped + strlen(skipped), sizeof skipped - strlen(skipped), "%s%s", i ? ", " : "", cand[i]);
    if (step >= 0 && !strcasecmp(got, cand[step])) {
      snprintf(g_reason, sizeof g_reason, "CPU has %s; OpenBLAS picked %s%s%s%s", caps_text(c), picked, from,
               *skipped ? "; this OpenBLAS has no " : "", skipped);
      return NULL;
    }
    /* The name asked is not one this OpenBLAS knows: the next best that would improve on what runs now. */
    int have = sgemm_class(core_level(got));
    if (step + 1 < n && sgemm_class(core_level(cand[step + 1])) > have) { /* the list falls in class: one look */
      snprintf(mark, sizeof mark, "%d:%s:%s", step + 1, picked, preset);
      return reexec(cand[step + 1], mark, *preset ? preset : NULL);
    }
    snprintf(skipped + strlen(skipped), sizeof skipped - strlen(skipped), "%s%s", step > 0 ? ", " : "",
             step >= 0 ? cand[step] : "?");
    if (have >= need) { /* e.g. no SapphireRapids, but OpenBLAS's own fallback is an AVX-512 core: keep it */
      setenv("OPENBLAS_CORETYPE", got, 1);
      snprintf(g_reason, sizeof g_reason, "CPU has %s; this OpenBLAS has no %s; OpenBLAS picked %s%s", caps_text(c),
               skipped, picked, from);
    } else {
      if (*preset) setenv("OPENBLAS_CORETYPE", preset, 1);
      else unsetenv("OPENBLAS_CORETYPE");
      setenv("ENGINE_BLAS_NOBETTER", got, 1);
      snprintf(g_reason, sizeof g_reason, "OpenBLAS's choice: CPU has %s but this OpenBLAS has no %s", caps_text(c),
               skipped);
    }
    return NULL;
  }
  if (sgemm_class(core_level(got)) >= need) {
    if (cur && !strcasecmp(cur, got))
      snprintf(g_reason, sizeof g_reason, "OPENBLAS_CORETYPE=%s; CPU has %s", cur, caps_text(c));
    else if (cur)
      snprintf(g_reason, sizeof g_reason, "OpenBLAS's choice, OPENBLAS_CORETYPE=%s not being a core it has; CPU has %s",
               cur, caps_text(c));
    else snprintf(g_reason, sizeof g_reason, "OpenBLAS's choice; CPU has %s", caps_text(c));
    return NULL;
  }
  const char* nobetter = getenv("ENGINE_BLAS_NOBETTER");
  if (nobetter && !strcasecmp(nobetter, got)) {
    snprintf(g_reason, sizeof g_reason, "OpenBLAS's choice: CPU has %s but this OpenBLAS has no core for it",
             caps_text(c));
    return NULL;
  }
  snprintf(mark, sizeof mark, "0:%s:%s", got, cur ? cur : "");
  return reexec(cand[0], mark, cur);
}

const char* eng_blas_core_select(void) {
  g_selected = 1;
  const char* got = corename();
  cpu_caps c = cpu_features();
  const char* pref = getenv("ENGINE_BLAS_CORETYPE");
  const char* cur = getenv("OPENBLAS_CORETYPE");
  const char* marker = getenv("ENGINE_BLAS_REEXEC");
  if (pref && (!*pref || !strcasecmp(pref, "auto"))) pref = NULL;
  if (cur && !*cur) cur = NULL;
  if (marker && !*marker) marker = NULL;
  int lv = pref ? core_level(pref) : 0;
  if (lv > caps_level(c)) { /* its kernels would not run here (SIGILL): choose as "auto" does, and say so */
    const char* want = select_auto(c, got, cur, marker);
    char why[sizeof g_reason];
    snprintf(why, sizeof why, "ENGINE_BLAS_CORETYPE=%s ignored, the CPU lacks %s; %s", pref, level_text(lv), g_reason);
    snprintf(g_reason, sizeof g_reason, "%s", why);
    return want;
  }
  if (!pref) return select_auto(c, got, cur, marker);
  if (marker) unsetenv("ENGINE_BLAS_REEXEC");
  if (!strcasecmp(pref, "keep")) {
    if (cur) snprintf(g_reason, sizeof g_reason, "ENGINE_BLAS_CORETYPE=keep; OPENBLAS_CORETYPE=%s", cur);
    else snprintf(g_reason, sizeof g_reason, "ENGINE_BLAS_CORETYPE=keep; OpenBLAS's choice");
    return NULL;
  }
  if (!strcasecmp(got, pref)) {
    snprintf(g_reason, sizeof g_reason, "ENGINE_BLAS_CORETYPE=%s", pref);
    return NULL;
  }
  if (marker || (cur && !strcasecmp(cur, pref))) { /* asked already: not a name this OpenBLAS knows */
    snprintf(g_reason, sizeof g_reason, "ENGINE_BLAS_CORETYPE=%s is not a core of this OpenBLAS; OpenBLAS's choice",
             pref);
    return NULL;
  }
  return reexec(pref, "x", cur);
}

void eng_blas_core_exec_failed(int err) {
  if (g_had_preset) setenv("OPENBLAS_CORETYPE", g_preset, 1);
  else unsetenv("OPENBLAS_CORETYPE");
  unsetenv("ENGINE_BLAS_REEXEC");
  snprintf(g_reason, sizeof g_reason, "re-executing with OPENBLAS_CORETYPE=%s failed (%s); OpenBLAS's choice",
           g_want, strerror(err));
}

const char* eng_blas_core_reason(void) {
  if (!g_selected) {
    snprintf(g_reason, sizeof g_reason, "OpenBLAS's choice (not started by the engine host); CPU has %s",
             caps_text(cpu_features()));
    g_selected = 1;
  }
  return g_reason;
}
