/* fuzz_redistribute.c: libFuzzer target for the redistribute planner and the
 * shard math (engine/src/dtensor/spec.c: eng_redistribute_plan,
 * eng_local_shape_and_offset, eng_local_shard_runs, eng_shard_size_and_offset;
 * engine/src/dtensor/resharding.c: eng_shard_boxes_overlap,
 * eng_shard_overlap_region), on simulated ranks, without MPI.
 *
 * The input picks a mesh (1-3 dims of 1-4), a global shape (0-4 dims of 0-7),
 * source and target placements (Replicate, Shard, Partial with one reduce op,
 * _StridedShard with split factor 1-3).  Then, with plain C arrays:
 * 1. every rank's shard of both layouts from an independent oracle (per dim,
 *    the list of global indices a rank holds, placements applied left to
 *    right with torch.chunk) must equal the engine's local shape, offset and
 *    runs;
 * 2. every rank's plan must issue the same steps (mesh dim, source, target)
 *    as every other rank, with the same logical shape within each group;
 * 3. the plan's steps, applied to the source shards with each transition's
 *    collective semantics (all_gather, all_reduce, reduce_scatter,
 *    all_to_all, local chunking), and the engine's own checks of the local
 *    sizes against the step's logical shape, must give every rank the shard
 *    of the target layout that distributing the full tensor directly gives
 *    (Partial compared after reducing); a plan that cannot run (Shard ->
 *    Partial, ...) must be one whose layouts ask for it;
 * 4. the overlap of every source box with every target box (resharding math)
 *    must equal the intersection of the index ranges.
 * Inputs whose first byte has its top bit set are "raw": out-of-range dims,
 * split factors, mesh sizes and coordinates; the functions must then return
 * an error or a result, never crash (no semantic checks).
 *   make fuzz-build && build-fuzz/fuzz/fuzz_redistribute spec/fuzz/corpus/redistribute */
#include <engine.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define FAIL(...) do { fprintf(stderr, "fuzz_redistribute: "); fprintf(stderr, __VA_ARGS__); fprintf(stderr, "\n"); dump(); abort(); } while (0)
#define CHECK(c) do { if (!(c)) FAIL("check failed: %s (line %d)", #c, __LINE__); } while (0)

#define MAXR 64   /* ranks */
#define MAXE 512  /* elements of the global tensor */
#define MAXSTEPS 16

/* ------------------------------------------------------------------ input */
typedef struct { const uint8_t* p; size_t n, i; } rd;
static unsigned byte(rd* r) { return r->i < r->n ? r->p[r->i++] : 0; }

static int MND, ND, NR, OP, RAW;
static int64_t MS[8], SHAPE[8];
static eng_placement SRC[8], DST[8];

static void dump(void) {
  char a[64];
  fprintf(stderr, "  mesh");
  for (int i = 0; i < MND; i++) fprintf(stderr, " %lld", (long long)MS[i]);
  fprintf(stderr, ", shape [");
  for (int d = 0; d < ND; d++) fprintf(stderr, "%s%lld", d ? "," : "", (long long)SHAPE[d]);
  fprintf(stderr, "]\n  src");
  for (int i = 0; i < MND; i++) fprintf(stderr, " %s", eng_placement_describe(&SRC[i], a, sizeof a));
  fprintf(stderr, "\n  dst");
  for (int i = 0; i < MND; i++) fprintf(stderr, " %s", eng_placement_describe(&DST[i], a, sizeof a));
  fprintf(stderr, "\n");
}

static eng_placement placement(rd* r) {
  eng_placement p;
  memset(&p, 0, sizeof p);
  unsigned b = byte(r), x = byte(r);
  p.kind = (int32_t)(b % 4);
  if (RAW && (b & 0x80)) p.kind = (int32_t)(b % 7);
  if (p.kind == ENG_PLACEMENT_SHARD || p.kind == ENG_PLACEMENT_STRIDED_SHARD) {
    if (RAW) p.dim = (int32_t)(int8_t)x;
    else if (ND == 0) p.kind = ENG_PLACEMENT_REPLICATE;
    else p.dim = (int32_t)(x % ND) - ((x & 0x80) ? ND : 0); /* negative dims count from the end */
  }
  if (p.kind == ENG_PLACEMENT_STRIDED_SHARD) {
    unsigned s = byte(r);
    p.split_factor = RAW ? (s & 0x80 ? (int32_t)(s & 0x7f) * 16777216 + (int32_t)(s & 1) * 16777215 : (int32_t)(int8_t)s) : (int32_t)(1 + s % 3);
  }
  if (p.kind == ENG_PLACEMENT_PARTIAL) p.op = OP;
  return p;
}

/* ------------------------------------------------------------------ oracle */
static void chunk(int64_t n, int64_t k, int64_t idx, int64_t* size, int64_t* off) {
  int64_t full = (n + k - 1) / k, o = idx * full;
  if (o > n) o = n;
  *size = n - o < full ? n - o : full;
  *off = o;
}

/* _StridedShard(sf) on k: piece j of sf (torch.chunk), then its sub-piece idx of k (torch.chunk again). */
static void nested(int64_t n, int64_t k, int64_t sf, int64_t idx, int64_t j, int64_t* size, int64_t* off) {
  int64_t psz, poff;
  chunk(n, sf, j, &psz, &poff);
  chunk(psz, k, idx, size, off);
  *off += poff;
}

static int shard_like(const eng_placement* p) {
  return p->kind == ENG_PLACEMENT_SHARD || p->kind == ENG_PLACEMENT_STRIDED_SHARD;
}
static int pdim(const eng_placement* p) { return p->dim < 0 ? p->dim + ND : p->dim; }

static void coord_of(int r, int* c) {
  for (int i = MND - 1; i >= 0; i--) { c[i] = r % (int)MS[i]; r /= (int)MS[i]; }
}
static int rank_of(const int* c) {
  int r = 0;
  for (int i = 0; i < MND; i++) r = r * (int)MS[i] + c[i];
  return r;
}

/* Global indices rank c holds on dim d under placements pl (oracle). */
static int held(const eng_placement* pl, const int* c, int d, int64_t* out) {
  int64_t cur[MAXE], nxt[MAXE];
  int n = (int)SHAPE[d];
  for (int j = 0; j < n; j++) cur[j] = j;
  for (int i = 0; i < MND; i++) {
    if (!shard_like(&pl[i]) || pdim(&pl[i]) != d) continue;
    int64_t k = MS[i], sf = pl[i].kind == ENG_PLACEMENT_STRIDED_SHARD ? pl[i].split_factor : 1;
    int m = 0;
    for (int64_t j = 0; j < sf; j++) {
      int64_t sz, off;
      nested(n, k, sf, c[i], j, &sz, &off);
      for (int64_t q = 0; q < sz; q++) nxt[m++] = cur[off + q];
    }
    memcpy(cur, nxt, sizeof(int64_t) * (size_t)m);
    n = m;
  }
  memcpy(out, cur, sizeof(int64_t) * (size_t)n);
  return n;
}

/* ------------------------------------------------------------------ local tensors */
typedef struct { int64_t shape[8]; int64_t numel; int64_t v[MAXE]; } local;

static int64_t numel_of(const int64_t* s) {
  int64_t n = 1;
  for (int d = 0; d < ND; d++) n *= s[d];
  return n;
}
static int64_t gval(int64_t g) { return (int64_t)((uint64_t)g * 2654435761u % 1000003u) - 500000; }
static int64_t mix(uint64_t a, uint64_t b) { uint64_t h = a * 0x9E3779B97F4A7C15ull ^ (b + 0x632BE59BD9B4E019ull); h ^= h >> 29; return (int64_t)(h % 7) + 1; }

/* Element e of x at multi-index idx. */
static int64_t lin(const int64_t* shape, const int64_t* idx) {
  int64_t o = 0;
  for (int d = 0; d < ND; d++) o = o * shape[d] + idx[d];
  return o;
}
static int next_idx(const int64_t* shape, int64_t* idx) {
  for (int d = ND - 1; d >= 0; d--) { if (++idx[d] < shape[d]) return 1; idx[d] = 0; }
  return 0;
}

/* The direct distribution: rank c's shard of the global tensor under pl, values
 * only (a Partial mesh dim holds the full value, as Replicate). */
static void direct(const eng_placement* pl, const int* c, local* out) {
  static int64_t ix[8][MAXE];
  for (int d = 0; d < ND; d++) out->shape[d] = held(pl, c, d, ix[d]);
  out->numel = numel_of(out->shape);
  if (out->numel == 0) return;
  int64_t idx[8] = {0};
  do {
    int64_t g = 0;
    for (int d = 0; d < ND; d++) g = g * SHAPE[d] + ix[d][idx[d]];
    out->v[lin(out->shape, idx)] = gval(g);
  } while (next_idx(out->shape, idx));
}

/* Share of value v at element e held by rank c for the Partial mesh dims of pl
 * (op OP): reducing over those dims in any order gives v back. */
static int64_t share(const eng_placement* pl, const int* c, int64_t e, int64_t v) {
  int zero = 1;
  uint64_t prod = 1, sum = 0;
  int any = 0;
  for (int i = 0; i < MND; i++) {
    if (pl[i].kind != ENG_PLACEMENT_PARTIAL) continue;
    any = 1;
    if (c[i]) zero = 0;
    int64_t h = mix((uint64_t)e, (uint64_t)i);
    prod *= (uint64_t)(c[i] == 0 ? -(MS[i] - 1) * h : h);
    sum += c[i] ? (uint64_t)h : 0;
  }
  if (!any) return v;
  switch (OP) {
    case ENG_REDUCE_SUM: return (int64_t)((zero ? (uint64_t)v : 0) + prod);
    case ENG_REDUCE_AVG: return (int64_t)((uint64_t)v + prod);
    case ENG_REDUCE_MAX: return (int64_t)((uint64_t)v - sum);
    case ENG_REDUCE_MIN: return (int64_t)((uint64_t)v + sum);
    default: return zero ? v : 1;
  }
}

static int64_t reduce2(int64_t a, int64_t b) {
  switch (OP) {
    case ENG_REDUCE_SUM: case ENG_REDUCE_AVG: return (int64_t)((uint64_t)a + (uint64_t)b);
    case ENG_REDUCE_MAX: return a > b ? a : b;
    case ENG_REDUCE_MIN: return a < b ? a : b;
    default: return (int64_t)((uint64_t)a * (uint64_t)b);
  }
}

static local L[MAXR], T[MAXR];

static void narrow_into(const local* x, int d, int64_t off, int64_t len, local* out, int64_t at, int64_t out_len) {
  /* out (dim d of length out_len) rows [at, at+len) = x rows [off, off+len) */
  if (x->numel == 0 || len == 0) return;
  int64_t idx[8] = {0};
  do {
    if (idx[d] < off || idx[d] >= off + len) continue;
    int64_t o[8];
    memcpy(o, idx, sizeof o);
    o[d] = idx[d] - off + at;
    int64_t os[8];
    memcpy(os, x->shape, sizeof os);
    os[d] = out_len;
    out->v[lin(os, o)] = x->v[lin(x->shape, idx)];
  } while (next_idx(x->shape, idx));
}

static void take(const local* x, int d, const int64_t* offs, const int64_t* lens, int n, local* out) {
  int64_t total = 0;
  for (int j = 0; j < n; j++) total += lens[j];
  local tmp;
  memcpy(tmp.shape, x->shape, sizeof tmp.shape);
  tmp.shape[d] = total;
  tmp.numel = numel_of(tmp.shape);
  int64_t at = 0;
  for (int j = 0; j < n; j++) { narrow_into(x, d, offs[j], lens[j], &tmp, at, total); at += lens[j]; }
  *out = tmp;
}

/* Rank m of k's pieces of a dim of length n under Shard (sf 0) or _StridedShard(sf). */
static int pieces(int64_t n, int64_t k, int64_t sf, int64_t m, int64_t* offs, int64_t* lens) {
  if (sf == 0) { chunk(n, k, m, &lens[0], &offs[0]); return 1; }
  for (int64_t j = 0; j < sf; j++) nested(n, k, sf, m, j, &lens[j], &offs[j]);
  return (int)sf;
}

static int same_other_dims(const local* a, const local* b, int d1, int d2) {
  for (int d = 0; d < ND; d++) if (d != d1 && d != d2 && a->shape[d] != b->shape[d]) return 0;
  return 1;
}

/* Gathers the group's shards along d (Shard: sf 0) into a tensor of length Ltot. */
static void gather(const int* grp, int k, int d, int64_t sf, int64_t Ltot, local* out) {
  memcpy(out->shape, L[grp[0]].shape, sizeof out->shape);
  out->shape[d] = Ltot;
  out->numel = numel_of(out->shape);
  for (int m = 0; m < k; m++) {
    int64_t offs[8], lens[8];
    int np = pieces(Ltot, k, sf, m, offs, lens);
    int64_t at = 0;
    for (int j = 0; j < np; j++) {
      /* piece j of member m: its rows [at, at+len) go to [offs[j], ...) */
      local* x = &L[grp[m]];
      if (x->numel > 0 && lens[j] > 0) {
        int64_t idx[8] = {0};
        do {
          if (idx[d] < at || idx[d] >= at + lens[j]) continue;
          int64_t o[8];
          memcpy(o, idx, sizeof o);
          o[d] = idx[d] - at + offs[j];
          out->v[lin(out->shape, o)] = x->v[lin(x->shape, idx)];
        } while (next_idx(x->shape, idx));
      }
      at += lens[j];
    }
  }
}

/* ------------------------------------------------------------------ the checks */
static void check_layout(const eng_placement* pl) {
  for (int r = 0; r < NR; r++) {
    int c[8];
    coord_of(r, c);
    int64_t ls[8], off[8];
    if (eng_local_shape_and_offset(ND, SHAPE, MND, MS, c, pl, ls, off)) FAIL("local_shape_and_offset: %s", eng_last_error());
    for (int d = 0; d < ND; d++) {
      static int64_t ix[MAXE];
      int n = held(pl, c, d, ix);
      CHECK(ls[d] == n);
      if (n > 0) CHECK(off[d] == ix[0]);
      int64_t st[MAXE], len[MAXE];
      int nr = eng_local_shard_runs(ND, SHAPE, MND, MS, c, pl, d, st, len, MAXE);
      CHECK(nr >= 0);
      int q = 0;
      for (int j = 0; j < nr; j++) {
        CHECK(len[j] > 0);
        if (j) CHECK(st[j] != st[j - 1] + len[j - 1]); /* adjacent runs are merged */
        for (int64_t t = 0; t < len[j]; t++, q++) CHECK(q < n && ix[q] == st[j] + t);
      }
      CHECK(q == n);
      if (nr > 1) CHECK(eng_local_shard_runs(ND, SHAPE, MND, MS, c, pl, d, st, len, 1) == nr);
    }
  }
}

static void check_boxes(void) {
  for (int i = 0; i < MND; i++)
    if (SRC[i].kind == ENG_PLACEMENT_STRIDED_SHARD || DST[i].kind == ENG_PLACEMENT_STRIDED_SHARD) return; /* not boxes */
  static int64_t sa[MAXR][8], oa[MAXR][8], sb[MAXR][8], ob[MAXR][8];
  for (int r = 0; r < NR; r++) {
    int c[8];
    coord_of(r, c);
    CHECK(!eng_local_shape_and_offset(ND, SHAPE, MND, MS, c, SRC, sa[r], oa[r]));
    CHECK(!eng_local_shape_and_offset(ND, SHAPE, MND, MS, c, DST, sb[r], ob[r]));
  }
  for (int a = 0; a < NR; a++)
    for (int b = 0; b < NR; b++) {
      int64_t reg[32], lo[8], hi[8];
      int want = 1;
      for (int d = 0; d < ND; d++) {
        lo[d] = oa[a][d] > ob[b][d] ? oa[a][d] : ob[b][d];
        hi[d] = oa[a][d] + sa[a][d] < ob[b][d] + sb[b][d] ? oa[a][d] + sa[a][d] : ob[b][d] + sb[b][d];
        if (sa[a][d] == 0 || sb[b][d] == 0 || lo[d] >= hi[d]) want = 0;
      }
      CHECK(eng_shard_boxes_overlap(ND, oa[a], sa[a], ob[b], sb[b]) == want);
      int rc = eng_shard_overlap_region(ND, oa[a], sa[a], ob[b], sb[b], reg);
      CHECK(rc == (want ? 0 : -1));
      for (int d = 0; want && d < ND; d++)
        CHECK(reg[4 * d] == d && reg[4 * d + 1] == lo[d] - oa[a][d] && reg[4 * d + 2] == lo[d] - ob[b][d] &&
              reg[4 * d + 3] == hi[d] - lo[d]);
    }
}

static void raw_calls(rd* r) {
  int c[8];
  int64_t ls[8], off[8], st[4], len[4];
  for (int i = 0; i < MND; i++) c[i] = (int)(int8_t)byte(r);
  eng_local_shape_and_offset(ND, SHAPE, MND, MS, c, SRC, ls, off);
  for (int d = -1; d <= ND; d++) eng_local_shard_runs(ND, SHAPE, MND, MS, c, SRC, d, st, len, 4);
  eng_transform_info steps[MAXSTEPS];
  int n = eng_redistribute_plan(MND, MS, c, SRC, DST, ND, SHAPE, steps, MAXSTEPS);
  CHECK(n >= -1 && n <= MAXSTEPS);
  int64_t sz, of;
  int rc = eng_shard_size_and_offset((int64_t)(int8_t)byte(r), (int)(int8_t)byte(r), (int)(int8_t)byte(r), &sz, &of);
  CHECK(rc == 0 || rc == -1);
}

static void check_chunk(rd* r) {
  int64_t n = byte(r) % 40, sz, off;
  int k = 1 + (int)(byte(r) % 9), idx = (int)(byte(r) % (unsigned)k);
  CHECK(eng_shard_size_and_offset(n, k, idx, &sz, &off) == 0);
  int64_t total = 0;
  for (int j = 0; j < k; j++) {
    int64_t s2, o2;
    CHECK(eng_shard_size_and_offset(n, k, j, &s2, &o2) == 0);
    CHECK(s2 >= 0 && o2 == (s2 ? total : o2) && o2 <= n);
    total += s2;
  }
  CHECK(total == n);
  int64_t s3, o3;
  chunk(n, k, idx, &s3, &o3);
  CHECK(sz == s3 && off == o3);
  CHECK(eng_shard_size_and_offset(n, k, k, &sz, &off) == -1);
  CHECK(eng_shard_size_and_offset(n, 0, 0, &sz, &off) == -1);
  CHECK(eng_shard_size_and_offset(-1, k, 0, &sz, &off) == -1);
}

/* Is a plan with a step that cannot run (x -> Partial) what these layouts ask for? */
static int needs_unsupported(void) {
  for (int i = 0; i < MND; i++) {
    if (DST[i].kind != ENG_PLACEMENT_PARTIAL) continue;
    if (SRC[i].kind == ENG_PLACEMENT_PARTIAL) continue; /* same op: unchanged */
    if (SRC[i].kind == ENG_PLACEMENT_REPLICATE && OP != ENG_REDUCE_PROD) continue;
    if (MS[i] == 1 && SRC[i].kind == ENG_PLACEMENT_REPLICATE) continue; /* R -> P on a dim of 1: skipped */
    return 1;
  }
  return 0;
}

static void run_plan(void) {
  static eng_transform_info plans[MAXR][MAXSTEPS];
  int nsteps = -1;
  for (int r = 0; r < NR; r++) {
    int c[8];
    coord_of(r, c);
    int n = eng_redistribute_plan(MND, MS, c, SRC, DST, ND, SHAPE, plans[r], MAXSTEPS);
    if (n < 0) FAIL("plan failed on valid layouts: %s", eng_last_error());
    if (r == 0) nsteps = n;
    CHECK(n == nsteps);
    for (int s = 0; s < n; s++) {
      const eng_transform_info* a = &plans[0][s], *b = &plans[r][s];
      CHECK(a->mesh_dim == b->mesh_dim && a->mesh_dim >= 0 && a->mesh_dim < MND);
      CHECK(eng_placement_equal(&a->src, &b->src) && eng_placement_equal(&a->dst, &b->dst));
    }
  }
  /* the source shards, Partial values split into shares */
  for (int r = 0; r < NR; r++) {
    int c[8];
    coord_of(r, c);
    direct(SRC, c, &L[r]);
    for (int64_t e = 0; e < L[r].numel; e++) L[r].v[e] = share(SRC, c, e, L[r].v[e]);
  }
  int rejected = 0;
  for (int s = 0; s < nsteps && !rejected; s++) {
    const eng_transform_info* st = &plans[0][s];
    int i = st->mesh_dim, k = (int)MS[i];
    eng_placement a = st->src, b = st->dst;
    int sa = a.kind == ENG_PLACEMENT_SHARD, ssa = a.kind == ENG_PLACEMENT_STRIDED_SHARD;
    int sb = b.kind == ENG_PLACEMENT_SHARD, ssb = b.kind == ENG_PLACEMENT_STRIDED_SHARD;
    int ra = a.kind == ENG_PLACEMENT_REPLICATE, rb = b.kind == ENG_PLACEMENT_REPLICATE;
    int pa = a.kind == ENG_PLACEMENT_PARTIAL, pb = b.kind == ENG_PLACEMENT_PARTIAL;
    if (eng_placement_equal(&a, &b)) continue; /* noop (a 1-d mesh's plan is its one change, or none) */
    /* the engine's error steps (redistribute.c) run even on a mesh dim of 1 */
    if ((sa || ssa) && pb) { rejected = 1; break; }
    if (pa && pb) { rejected = 1; break; } /* different ops (equal ones are no step) */
    if (k == 1) continue;                   /* the engine skips the other steps there */
    if (ra && pb && b.op == ENG_REDUCE_PROD) { rejected = 1; break; }
    if (!((sa && rb) || (ra && sb) || (pa && rb) || (pa && sb) || (sa && sb) || (ra && pb) || (ssa && rb) || (ra && ssb)))
      FAIL("step %d: no transition for this placement change", s + 1);
    for (int r = 0; r < NR; r++) {
      int c[8];
      coord_of(r, c);
      if (c[i] != 0) continue;
      int grp[8];
      for (int m = 0; m < k; m++) { c[i] = m; grp[m] = rank_of(c); }
      for (int m = 0; m < k; m++)
        for (int d = 0; d < ND; d++) CHECK(plans[grp[m]][s].logical_shape[d] == plans[grp[0]][s].logical_shape[d]);
      const int64_t* lsh = plans[grp[0]][s].logical_shape;
      if ((sa || ssa) && (rb || sb)) {
        int d = pdim(&a);
        int64_t Ltot = lsh[d], sf = ssa ? a.split_factor : 0;
        for (int m = 0; m < k; m++) {
          int64_t offs[8], lens[8], want = 0;
          int np = pieces(Ltot, k, sf, m, offs, lens);
          for (int j = 0; j < np; j++) want += lens[j];
          if (L[grp[m]].shape[d] != want)
            FAIL("step %d (mesh dim %d): rank %d holds %lld on dim %d, the logical shape %lld gives %lld: the engine "
                 "refuses this plan", s + 1, i, grp[m], (long long)L[grp[m]].shape[d], d, (long long)Ltot, (long long)want);
          CHECK(same_other_dims(&L[grp[m]], &L[grp[0]], d, -1));
        }
        local full;
        gather(grp, k, d, sf, Ltot, &full);
        for (int m = 0; m < k; m++) {
          if (rb) T[grp[m]] = full;
          else {
            int e = pdim(&b);
            if (full.shape[e] != lsh[e])
              FAIL("step %d (all_to_all on mesh dim %d): dim %d has %lld entries, the logical shape says %lld", s + 1,
                   i, e, (long long)full.shape[e], (long long)lsh[e]);
            int64_t offs[1], lens[1];
            pieces(full.shape[e], k, 0, m, offs, lens);
            take(&full, e, offs, lens, 1, &T[grp[m]]);
          }
        }
      } else if (ra && (sb || ssb)) {
        int e = pdim(&b);
        for (int m = 0; m < k; m++) {
          int64_t offs[8], lens[8];
          int np = pieces(L[grp[m]].shape[e], k, ssb ? b.split_factor : 0, m, offs, lens);
          take(&L[grp[m]], e, offs, lens, np, &T[grp[m]]);
        }
      } else if (pa) {
        local red = L[grp[0]];
        for (int m = 1; m < k; m++) {
          CHECK(same_other_dims(&L[grp[m]], &red, -1, -1));
          for (int64_t q = 0; q < red.numel; q++) red.v[q] = reduce2(red.v[q], L[grp[m]].v[q]);
        }
        if (a.op == ENG_REDUCE_AVG)
          for (int64_t q = 0; q < red.numel; q++) {
            CHECK(red.v[q] % k == 0);
            red.v[q] /= k;
          }
        for (int m = 0; m < k; m++) {
          if (rb) T[grp[m]] = red;
          else {
            int e = pdim(&b);
            int64_t offs[1], lens[1];
            pieces(red.shape[e], k, 0, m, offs, lens);
            take(&red, e, offs, lens, 1, &T[grp[m]]);
          }
        }
      } else { /* R -> P */
        for (int m = 0; m < k; m++) {
          T[grp[m]] = L[grp[m]];
          if (b.op == ENG_REDUCE_SUM && m > 0) for (int64_t q = 0; q < T[grp[m]].numel; q++) T[grp[m]].v[q] = 0;
        }
      }
    }
    memcpy(L, T, sizeof(local) * (size_t)NR);
  }
  if (rejected) {
    if (!needs_unsupported()) FAIL("the plan has a step that cannot run, for layouts that do not need one");
    return;
  }
  if (needs_unsupported()) FAIL("the plan runs, for layouts that need an unsupported step");
  /* compare with the direct distribution of the target (Partial reduced) */
  for (int r = 0; r < NR; r++) {
    int c[8];
    coord_of(r, c);
    local want, got = L[r];
    direct(DST, c, &want);
    for (int d = 0; d < ND; d++) CHECK(got.shape[d] == want.shape[d]);
    int any_p = 0;
    for (int i = 0; i < MND; i++) any_p |= DST[i].kind == ENG_PLACEMENT_PARTIAL;
    if (any_p) {
      int count = 1;
      for (int o = 0; o < NR; o++) {
        if (o == r) continue;
        int co[8], same = 1;
        coord_of(o, co);
        for (int i = 0; i < MND; i++) if (DST[i].kind != ENG_PLACEMENT_PARTIAL && co[i] != c[i]) same = 0;
        if (!same) continue;
        CHECK(same_other_dims(&L[o], &got, -1, -1));
        for (int64_t q = 0; q < got.numel; q++) got.v[q] = reduce2(got.v[q], L[o].v[q]);
        count++;
      }
      if (OP == ENG_REDUCE_AVG)
        for (int64_t q = 0; q < got.numel; q++) { CHECK(got.v[q] % count == 0); got.v[q] /= count; }
    }
    for (int64_t q = 0; q < want.numel; q++)
      if (got.v[q] != want.v[q])
        FAIL("rank %d element %lld: the plan gives %lld, direct distribution %lld", r, (long long)q,
             (long long)got.v[q], (long long)want.v[q]);
  }
}

int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  rd r = {data, size, 0};
  unsigned h = byte(&r);
  RAW = (h & 0x80) != 0;
  OP = (int)(byte(&r) % 5);
  MND = 1 + (int)(h % 3);
  NR = 1;
  for (int i = 0; i < MND; i++) {
    unsigned b = byte(&r);
    MS[i] = RAW ? (int64_t)(b % 6) - 1 : 1 + (int64_t)(b % 4);
    NR *= MS[i] > 0 ? (int)MS[i] : 1;
  }
  ND = (int)(byte(&r) % 5);
  int64_t ne = 1;
  for (int d = 0; d < ND; d++) {
    SHAPE[d] = (int64_t)(byte(&r) % 8);
    if (ne * (SHAPE[d] ? SHAPE[d] : 1) > MAXE) SHAPE[d] = 1;
    ne *= SHAPE[d] ? SHAPE[d] : 1;
  }
  for (int i = 0; i < MND; i++) SRC[i] = placement(&r);
  for (int i = 0; i < MND; i++) DST[i] = placement(&r);
  if (RAW) { raw_calls(&r); return 0; }
  check_chunk(&r);
  check_layout(SRC);
  check_layout(DST);
  check_boxes();
  run_plan();
  return 0;
}
