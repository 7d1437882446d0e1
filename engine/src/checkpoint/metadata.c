/* metadata.c: one tensor's entry in a checkpoint's metadata (checkpoint.h):
 * "<dtype>|<shape>|<chunk>;<chunk>;..." with a chunk
 * "<file>:<offset>:<nbytes>:<checksum hex>:<offsets>:<sizes>".  The parser
 * is strict (decimal integers without signs or leading junk, known dtype
 * names, at most 8 dims) and validates the chunk boxes as ShardedTensor
 * metadata is validated (sharded_tensor/: inside the tensor, no overlaps,
 * exact cover), so a loader never reads past a chunk or leaves a hole. */
#include "core/internal.h"
#include "eng/checkpoint.h"
#include "eng/sharded_tensor.h"
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define HEADER_BYTES 64
#define MAX_ND 8

typedef struct { const char* s; const char* op; } cur;

static int bad(cur* c, const char* what) {
  return eng_err("%s: bad metadata entry (%s) near '%.24s'", c->op, what, c->s);
}

/* a non-negative decimal integer < 2^62 */
static int num(cur* c, int64_t* out) {
  const char* s = c->s;
  if (*s < '0' || *s > '9') return bad(c, "expected a number");
  int64_t v = 0;
  int n = 0;
  while (*s >= '0' && *s <= '9') {
    if (v > ((int64_t)1 << 58)) return bad(c, "number too large");
    v = v * 10 + (*s - '0');
    s++;
    n++;
  }
  if (n > 1 && c->s[0] == '0') return bad(c, "leading zero");
  c->s = s;
  *out = v;
  return 0;
}

static int expect(cur* c, char ch, const char* what) {
  if (*c->s != ch) return bad(c, what);
  c->s++;
  return 0;
}

/* "a,b,c" up to a terminator (not consumed); count in *n */
static int list(cur* c, int64_t* out, int* n, char term) {
  *n = 0;
  if (*c->s == term || *c->s == 0) return 0;
  for (;;) {
    if (*n >= MAX_ND) return bad(c, "more than 8 dims");
    if (num(c, &out[*n]) != 0) return -1;
    (*n)++;
    if (*c->s == ',') { c->s++; continue; }
    return 0;
  }
}

int eng_ckpt_entry_parse(const char* op, const char* text, int n_files, int* dtype, int* ndim, int64_t* shape,
                         eng_ckpt_chunk* chunks, int cap) {
  if (!op) op = "checkpoint.load";
  if (!text || !dtype || !ndim || !shape) return eng_err("%s: bad arguments to the entry parser", op);
  cur c = {text, op};
  const char* bar = strchr(text, '|');
  if (!bar || bar - text > 15) return bad(&c, "no dtype");
  char name[16];
  memcpy(name, text, (size_t)(bar - text));
  name[bar - text] = 0;
  int dt = eng_dtype_from_name(name);
  if (dt < 0) { eng_clear_error(); return bad(&c, "unknown dtype"); }
  c.s = bar + 1;
  int nd;
  int64_t shp[MAX_ND];
  if (list(&c, shp, &nd, '|') != 0) return -1;
  if (expect(&c, '|', "expected '|' after the shape") != 0) return -1;
  int64_t numel = 1;
  for (int d = 0; d < nd; d++) {
    if (shp[d] > 0 && numel > ((int64_t)1 << 58) / shp[d]) return bad(&c, "tensor too large");
    numel *= shp[d];
  }
  int64_t es = eng_dtype_size(dt);
  int count = 0, room = 16;
  int64_t* offs = malloc(sizeof(int64_t) * MAX_ND * room);
  int64_t* sizes = malloc(sizeof(int64_t) * MAX_ND * room);
  int rc = -1;
  if (!offs || !sizes) { eng_err("%s: out of memory", op); goto done; }
  int64_t covered = 0;
  while (*c.s) {
    eng_ckpt_chunk k;
    memset(&k, 0, sizeof k);
    int64_t f;
    if (num(&c, &f) != 0) goto done;
    if (f >= n_files) { bad(&c, "file index out of range"); goto done; }
    k.file = (int32_t)f;
    if (expect(&c, ':', "expected ':'") || num(&c, &k.offset) || expect(&c, ':', "expected ':'") ||
        num(&c, &k.nbytes) || expect(&c, ':', "expected ':'"))
      goto done;
    uint64_t cs = 0;
    int hex = 0;
    for (; hex < 16; hex++) {
      char ch = c.s[hex];
      int v = ch >= '0' && ch <= '9' ? ch - '0' : ch >= 'a' && ch <= 'f' ? ch - 'a' + 10 : -1;
      if (v < 0) break;
      cs = cs << 4 | (uint64_t)v;
    }
    if (hex != 16) { bad(&c, "checksum must be 16 lowercase hex digits"); goto done; }
    c.s += 16;
    k.checksum = cs;
    int no, ns;
    if (expect(&c, ':', "expected ':'") || list(&c, k.offsets, &no, ':') || expect(&c, ':', "expected ':'") ||
        list(&c, k.sizes, &ns, ';'))
      goto done;
    if (no != nd || ns != nd) { bad(&c, "chunk box dims differ from the tensor's"); goto done; }
    k.ndim = nd;
    int64_t cn = 1;
    for (int d = 0; d < nd; d++) {
      if (k.sizes[d] > shp[d] || k.offsets[d] > shp[d] - k.sizes[d]) { bad(&c, "chunk outside the tensor"); goto done; }
      cn *= k.sizes[d];
    }
    if (cn == 0) { bad(&c, "empty chunk"); goto done; }
    if (k.nbytes != cn * es) { bad(&c, "chunk byte count differs from its box"); goto done; }
    if (k.offset < HEADER_BYTES) { bad(&c, "chunk offset inside the file header"); goto done; }
    covered += cn;
    if (covered > numel) { bad(&c, "chunks hold more elements than the tensor"); goto done; }
    if (count == room) {
      room *= 2;
      int64_t* a = realloc(offs, sizeof(int64_t) * MAX_ND * room);
      if (a) offs = a;
      int64_t* b = a ? realloc(sizes, sizeof(int64_t) * MAX_ND * room) : NULL;
      if (b) sizes = b;
      if (!a || !b) { eng_err("%s: out of memory", op); goto done; }
    }
    for (int d = 0; d < nd; d++) { offs[count * nd + d] = k.offsets[d]; sizes[count * nd + d] = k.sizes[d]; }
    if (chunks && count < cap) chunks[count] = k;
    count++;
    if (*c.s == ';') {
      c.s++;
      if (!*c.s) { bad(&c, "trailing ';'"); goto done; }
    } else if (*c.s) {
      bad(&c, "expected ';' between chunks");
      goto done;
    }
  }
  if (covered != numel) {
    eng_err("%s: bad metadata entry: the chunks hold %lld of the tensor's %lld elements", op, (long long)covered,
            (long long)numel);
    goto done;
  }
  if (count > 1 && nd > 0 && eng_shards_validate(op, count, nd, offs, sizes, shp, 1) != 0) goto done;
  *dtype = dt;
  *ndim = nd;
  for (int d = 0; d < nd; d++) shape[d] = shp[d];
  rc = count;
done:
  free(offs);
  free(sizes);
  return rc;
}

int64_t eng_ckpt_entry_format(int dtype, int ndim, const int64_t* shape, int n, const eng_ckpt_chunk* chunks,
                              char* out, int64_t cap) {
  const char* name = eng_dtype_name(dtype);
  if (!name || ndim < 0 || ndim > MAX_ND || n < 0 || !out || cap <= 0 || (ndim && !shape) || (n && !chunks))
    return eng_err("checkpoint.save: bad arguments to the entry writer");
  int64_t len = 0;
#define PUT(...)                                                                          \
  do {                                                                                    \
    int k_ = snprintf(out + len, (size_t)(cap - len), __VA_ARGS__);                       \
    if (k_ < 0 || k_ >= cap - len) return eng_err("checkpoint.save: entry longer than %lld bytes", (long long)cap); \
    len += k_;                                                                            \
  } while (0)
  PUT("%s|", name);
  for (int d = 0; d < ndim; d++) PUT(d ? ",%lld" : "%lld", (long long)shape[d]);
  PUT("|");
  for (int i = 0; i < n; i++) {
    const eng_ckpt_chunk* k = &chunks[i];
    if (k->ndim != ndim) return eng_err("checkpoint.save: chunk %d has %d dims, the tensor %d", i, k->ndim, ndim);
    PUT("%s%d:%lld:%lld:%016llx:", i ? ";" : "", k->file, (long long)k->offset, (long long)k->nbytes,
        (unsigned long long)k->checksum);
    for (int d = 0; d < ndim; d++) PUT(d ? ",%lld" : "%lld", (long long)k->offsets[d]);
    PUT(":");
    for (int d = 0; d < ndim; d++) PUT(d ? ",%lld" : "%lld", (long long)k->sizes[d]);
  }
#undef PUT
  return len;
}
