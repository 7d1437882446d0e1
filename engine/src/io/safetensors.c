/* Subsystem io/: tensor file formats (safetensors).  May call: core/. */
/* safetensors.c: reading and writing safetensors files.
 *
 * Layout: 8-byte little-endian header length N, N bytes of JSON
 *   {"__metadata__": {"key": "value", ...},
 *    "name": {"dtype": "F32", "shape": [2, 3], "data_offsets": [begin, end]}, ...}
 * (padded with spaces to a multiple of 8), then the data buffer; offsets are
 * relative to the buffer's start.  Tensors are written contiguous, in the
 * order given.  Loading reads and validates the whole file (header syntax,
 * dtypes, shapes against byte ranges, ranges inside the buffer and not
 * overlapping, duplicate names) with errors naming the file. */
#include "core/internal.h"
#include "eng/io.h"
#include <errno.h>
#include <stdio.h>
#include <unistd.h>

#define ST_MAX_HEADER (100u << 20) /* as the reference implementation */
#define ST_MAX_DEPTH 64

static const char* const st_dtype_names[ENG_NUM_DTYPES] = {"F32", "F64", "BF16", "F16", "I32", "I64", "U8", "BOOL"};

typedef struct {
  char* name;
  int dtype, ndim;
  int64_t shape[ENG_MAX_DIMS];
  uint64_t begin, end;
} st_entry;

struct eng_safetensors {
  char* path;
  int n, cap;
  st_entry* e;
  int n_meta, meta_cap, have_meta;
  char** mkeys;
  char** mvals;
  unsigned char* data;
  uint64_t data_len;
};

/* ------------------------------------------------------------------ growable buffer */
typedef struct { char* p; size_t n, cap; int oom; } sbuf;

static void sb_put(sbuf* b, const char* s, size_t n) {
  if (b->oom) return;
  if (b->n + n + 1 > b->cap) {
    size_t c = b->cap ? b->cap : 256;
    while (c < b->n + n + 1) c *= 2;
    char* q = realloc(b->p, c);
    if (!q) { b->oom = 1; return; }
    b->p = q; b->cap = c;
  }
  memcpy(b->p + b->n, s, n);
  b->n += n;
  b->p[b->n] = 0;
}
static void sb_str(sbuf* b, const char* s) { sb_put(b, s, strlen(s)); }
static void sb_json_string(sbuf* b, const char* s) {
  sb_put(b, "\"", 1);
  for (const unsigned char* c = (const unsigned char*)s; *c; c++) {
    char tmp[8];
    if (*c == '"') sb_put(b, "\\\"", 2);
    else if (*c == '\\') sb_put(b, "\\\\", 2);
    else if (*c == '\n') sb_put(b, "\\n", 2);
    else if (*c == '\t') sb_put(b, "\\t", 2);
    else if (*c == '\r') sb_put(b, "\\r", 2);
    else if (*c < 0x20) { snprintf(tmp, sizeof tmp, "\\u%04x", *c); sb_put(b, tmp, 6); }
    else sb_put(b, (const char*)c, 1);
  }
  sb_put(b, "\"", 1);
}

/* ------------------------------------------------------------------ JSON reader */
typedef struct {
  const char* s;
  size_t n, i;
  const char* path;
  int failed;
} jp;

static int jp_fail(jp* p, const char* what) {
  if (!p->failed) {
    p->failed = 1;
    if (p->i < p->n)
      eng_err("safetensors_load: %s: bad JSON header at byte %zu (near '%.12s'): %s", p->path, p->i, p->s + p->i, what);
    else
      eng_err("safetensors_load: %s: bad JSON header: unexpected end of header: %s", p->path, what);
  }
  return -1;
}

static void jp_ws(jp* p) {
  while (p->i < p->n && (p->s[p->i] == ' ' || p->s[p->i] == '\t' || p->s[p->i] == '\n' || p->s[p->i] == '\r')) p->i++;
}

static int jp_expect(jp* p, char c, const char* what) {
  jp_ws(p);
  if (p->i >= p->n || p->s[p->i] != c) return jp_fail(p, what);
  p->i++;
  return 0;
}

static int jp_peek(jp* p) { jp_ws(p); return p->i < p->n ? (unsigned char)p->s[p->i] : -1; }

static int hex4(jp* p, unsigned* out) {
  if (p->i + 4 > p->n) return jp_fail(p, "truncated \\u escape");
  unsigned v = 0;
  for (int k = 0; k < 4; k++) {
    char c = p->s[p->i + k];
    v <<= 4;
    if (c >= '0' && c <= '9') v |= (unsigned)(c - '0');
    else if (c >= 'a' && c <= 'f') v |= (unsigned)(c - 'a' + 10);
    else if (c >= 'A' && c <= 'F') v |= (unsigned)(c - 'A' + 10);
    else return jp_fail(p, "bad hex digit in \\u escape");
  }
  p->i += 4;
  *out = v;
  return 0;
}

static void put_utf8(sbuf* b, unsigned cp) {
  char u[4];
  if (cp < 0x80) { u[0] = (char)cp; sb_put(b, u, 1); }
  else if (cp < 0x800) { u[0] = (char)(0xC0 | (cp >> 6)); u[1] = (char)(0x80 | (cp & 0x3F)); sb_put(b, u, 2); }
  else if (cp < 0x10000) {
    u[0] = (char)(0xE0 | (cp >> 12)); u[1] = (char)(0x80 | ((cp >> 6) & 0x3F)); u[2] = (char)(0x80 | (cp & 0x3F));
    sb_put(b, u, 3);
  } else {
    u[0] = (char)(0xF0 | (cp >> 18)); u[1] = (char)(0x80 | ((cp >> 12) & 0x3F));
    u[2] = (char)(0x80 | ((cp >> 6) & 0x3F)); u[3] = (char)(0x80 | (cp & 0x3F));
    sb_put(b, u, 4);
  }
}

/* Parses a string; *out is a new malloc'd NUL-terminated copy (or NULL when
 * out is NULL: skip). */
static int jp_string(jp* p, char** out) {
  if (jp_expect(p, '"', "expected a string")) return -1;
  sbuf b = {0};
  for (;;) {
    if (p->i >= p->n) { free(b.p); return jp_fail(p, "unterminated string"); }
    unsigned char c = (unsigned char)p->s[p->i++];
    if (c == '"') break;
    if (c < 0x20) { p->i--; free(b.p); return jp_fail(p, "control character in string"); }
    if (c != '\\') { sb_put(&b, (const char*)&c, 1); continue; }
    if (p->i >= p->n) { free(b.p); return jp_fail(p, "unterminated escape"); }
    char e = p->s[p->i++];
    switch (e) {
      case '"': sb_put(&b, "\"", 1); break;
      case '\\': sb_put(&b, "\\", 1); break;
      case '/': sb_put(&b, "/", 1); break;
      case 'b': sb_put(&b, "\b", 1); break;
      case 'f': sb_put(&b, "\f", 1); break;
      case 'n': sb_put(&b, "\n", 1); break;
      case 'r': sb_put(&b, "\r", 1); break;
      case 't': sb_put(&b, "\t", 1); break;
      case 'u': {
        unsigned cp;
        if (hex4(p, &cp)) { free(b.p); return -1; }
        if (cp >= 0xD800 && cp < 0xDC00) {
          unsigned lo;
          if (p->i + 2 > p->n || p->s[p->i] != '\\' || p->s[p->i + 1] != 'u') {
            free(b.p); return jp_fail(p, "unpaired UTF-16 surrogate in \\u escape");
          }
          p->i += 2;
          if (hex4(p, &lo)) { free(b.p); return -1; }
          if (lo < 0xDC00 || lo >= 0xE000) { free(b.p); return jp_fail(p, "unpaired UTF-16 surrogate in \\u escape"); }
          cp = 0x10000 + ((cp - 0xD800) << 10) + (lo - 0xDC00);
        } else if (cp >= 0xDC00 && cp < 0xE000) {
          free(b.p); return jp_fail(p, "unpaired UTF-16 surrogate in \\u escape");
        }
        if (cp == 0) { free(b.p); return jp_fail(p, "NUL character (\\u0000) in string"); }
        put_utf8(&b, cp);
        break;
      }
      default: p->i--; free(b.p); return jp_fail(p, "invalid escape in string");
    }
  }
  if (b.oom) { free(b.p); return jp_fail(p, "out of memory"); }
  if (out) { *out = b.p ? b.p : strdup(""); if (!*out) return jp_fail(p, "out of memory"); }
  else free(b.p);
  return 0;
}

/* A non-negative integer (no sign, fraction or exponent) below 2^63. */
static int jp_uint(jp* p, uint64_t* out, const char* what) {
  jp_ws(p);
  size_t start = p->i;
  uint64_t v = 0;
  while (p->i < p->n && p->s[p->i] >= '0' && p->s[p->i] <= '9') {
    unsigned d = (unsigned)(p->s[p->i] - '0');
    if (v > (uint64_t)(INT64_MAX - d) / 10) return jp_fail(p, "integer too large");
    v = v * 10 + d;
    p->i++;
  }
  if (p->i == start) return jp_fail(p, what);
  if (p->i < p->n && (p->s[p->i] == '.' || p->s[p->i] == 'e' || p->s[p->i] == 'E'))
    return jp_fail(p, "expected an integer, got a fraction or exponent");
  *out = v;
  return 0;
}

static int jp_skip(jp* p, int depth);

static int jp_skip_number(jp* p) {
  size_t start = p->i;
  if (p->i < p->n && p->s[p->i] == '-') p->i++;
  while (p->i < p->n && strchr("0123456789.eE+-", p->s[p->i])) p->i++;
  if (p->i == start || (p->i == start + 1 && p->s[start] == '-')) return jp_fail(p, "bad number");
  return 0;
}

static int jp_skip(jp* p, int depth) {
  if (depth > ST_MAX_DEPTH) return jp_fail(p, "nesting too deep");
  int c = jp_peek(p);
  if (c == '"') return jp_string(p, NULL);
  if (c == '{' || c == '[') {
    char close = c == '{' ? '}' : ']';
    p->i++;
    if (jp_peek(p) == close) { p->i++; return 0; }
    for (;;) {
      if (c == '{') {
        if (jp_string(p, NULL) || jp_expect(p, ':', "expected ':'")) return -1;
      }
      if (jp_skip(p, depth + 1)) return -1;
      int d = jp_peek(p);
      if (d == ',') { p->i++; continue; }
      if (d == close) { p->i++; return 0; }
      return jp_fail(p, c == '{' ? "expected ',' or '}'" : "expected ',' or ']'");
    }
  }
  if (c == '-' || (c >= '0' && c <= '9')) return jp_skip_number(p);
  static const char* const words[] = {"true", "false", "null"};
  for (int k = 0; k < 3; k++) {
    size_t l = strlen(words[k]);
    if (p->i + l <= p->n && !memcmp(p->s + p->i, words[k], l)) { p->i += l; return 0; }
  }
  return jp_fail(p, "expected a JSON value");
}

/* ------------------------------------------------------------------ loading */
static void st_free_entries(eng_safetensors* f) {
  for (int i = 0; i < f->n; i++) free(f->e[i].name);
  for (int i = 0; i < f->n_meta; i++) { free(f->mkeys[i]); free(f->mvals[i]); }
  free(f->e); free(f->mkeys); free(f->mvals);
}

void eng_safetensors_free(eng_safetensors* f) {
  if (!f) return;
  st_free_entries(f);
  free(f->data);
  free(f->path);
  free(f);
}

static int parse_metadata(jp* p, eng_safetensors* f) {
  if (f->have_meta) return jp_fail(p, "duplicate __metadata__");
  f->have_meta = 1;
  if (jp_expect(p, '{', "__metadata__ must be an object of strings")) return -1;
  if (jp_peek(p) == '}') { p->i++; return 0; }
  for (;;) {
    char *k = NULL, *v = NULL;
    if (jp_string(p, &k)) return -1;
    if (jp_expect(p, ':', "expected ':'") || jp_peek(p) != '"') {
      free(k);
      return jp_fail(p, "__metadata__ values must be strings");
    }
    if (jp_string(p, &v)) { free(k); return -1; }
    if (f->n_meta == f->meta_cap) {
      int c = f->meta_cap ? 2 * f->meta_cap : 8;
      char** a = realloc(f->mkeys, (size_t)c * sizeof *a);
      if (a) f->mkeys = a;
      char** b = a ? realloc(f->mvals, (size_t)c * sizeof *b) : NULL;
      if (b) f->mvals = b;
      if (!a || !b) { free(k); free(v); return jp_fail(p, "out of memory"); }
      f->meta_cap = c;
    }
    f->mkeys[f->n_meta] = k; f->mvals[f->n_meta] = v; f->n_meta++;
    int d = jp_peek(p);
    if (d == ',') { p->i++; continue; }
    if (d == '}') { p->i++; return 0; }
    return jp_fail(p, "expected ',' or '}' in __metadata__");
  }
}

static int parse_entry(jp* p, st_entry* e) {
  int have_dtype = 0, have_shape = 0, have_off = 0;
  if (jp_expect(p, '{', "a tensor entry must be an object")) return -1;
  if (jp_peek(p) == '}') { p->i++; goto check; }
  for (;;) {
    char* k = NULL;
    if (jp_string(p, &k) || jp_expect(p, ':', "expected ':'")) { free(k); return -1; }
    if (!strcmp(k, "dtype")) {
      char* v = NULL;
      if (jp_peek(p) != '"') { free(k); return jp_fail(p, "dtype must be a string"); }
      if (jp_string(p, &v)) { free(k); return -1; }
      e->dtype = -1;
      for (int d = 0; d < ENG_NUM_DTYPES; d++) if (!strcmp(v, st_dtype_names[d])) e->dtype = d;
      if (e->dtype < 0) {
        eng_err("safetensors_load: %s: tensor '%s' has unsupported dtype \"%s\" (supported: F32, F64, BF16, F16, "
                "I32, I64, U8, BOOL)", p->path, e->name, v);
        p->failed = 1;
        free(v); free(k);
        return -1;
      }
      free(v);
      have_dtype = 1;
    } else if (!strcmp(k, "shape")) {
      if (jp_expect(p, '[', "shape must be an array of integers")) { free(k); return -1; }
      e->ndim = 0;
      if (jp_peek(p) == ']') p->i++;
      else for (;;) {
        uint64_t v;
        if (e->ndim >= ENG_MAX_DIMS) { free(k); return jp_fail(p, "shape has more than 8 dims"); }
        if (jp_uint(p, &v, "shape entries must be non-negative integers")) { free(k); return -1; }
        e->shape[e->ndim++] = (int64_t)v;
        int d = jp_peek(p);
        if (d == ',') { p->i++; continue; }
        if (d == ']') { p->i++; break; }
        free(k);
        return jp_fail(p, "expected ',' or ']' in shape");
      }
      have_shape = 1;
    } else if (!strcmp(k, "data_offsets")) {
      if (jp_expect(p, '[', "data_offsets must be [begin, end]") ||
          jp_uint(p, &e->begin, "data_offsets must be non-negative integers") ||
          jp_expect(p, ',', "data_offsets must have two entries") ||
          jp_uint(p, &e->end, "data_offsets must be non-negative integers") ||
          jp_expect(p, ']', "data_offsets must have two entries")) {
        free(k);
        return -1;
      }
      have_off = 1;
    } else if (jp_skip(p, 2)) {
      free(k);
      return -1;
    }
    free(k);
    int d = jp_peek(p);
    if (d == ',') { p->i++; continue; }
    if (d == '}') { p->i++; break; }
    return jp_fail(p, "expected ',' or '}' in a tensor entry");
  }
check:
  if (!have_dtype || !have_shape || !have_off) {
    eng_err("safetensors_load: %s: tensor '%s' lacks %s", p->path, e->name,
            !have_dtype ? "\"dtype\"" : !have_shape ? "\"shape\"" : "\"data_offsets\"");
    p->failed = 1;
    return -1;
  }
  return 0;
}

static int parse_header(jp* p, eng_safetensors* f) {
  if (jp_expect(p, '{', "the header must be a JSON object")) return -1;
  if (jp_peek(p) == '}') p->i++;
  else for (;;) {
    char* k = NULL;
    if (jp_string(p, &k)) return -1;
    if (jp_expect(p, ':', "expected ':'")) { free(k); return -1; }
    if (!strcmp(k, "__metadata__")) {
      free(k);
      if (parse_metadata(p, f)) return -1;
    } else {
      if (f->n == f->cap) {
        int c = f->cap ? 2 * f->cap : 16;
        st_entry* a = realloc(f->e, (size_t)c * sizeof *a);
        if (!a) { free(k); return jp_fail(p, "out of memory"); }
        f->e = a; f->cap = c;
      }
      st_entry* e = &f->e[f->n++];
      memset(e, 0, sizeof *e);
      e->name = k;
      if (parse_entry(p, e)) return -1;
    }
    int d = jp_peek(p);
    if (d == ',') { p->i++; continue; }
    if (d == '}') { p->i++; break; }
    return jp_fail(p, "expected ',' or '}'");
  }
  jp_ws(p);
  if (p->i != p->n) return jp_fail(p, "trailing characters after the header object");
  return 0;
}

static int cmp_str(const void* a, const void* b) { return strcmp(*(const char* const*)a, *(const char* const*)b); }

/* Duplicate tensor names, and duplicate __metadata__ keys (a reader keeping
 * the first or the last would silently differ from another reader): sorted,
 * so a header of millions of names is checked in n log n, not n^2. */
static int check_duplicates(eng_safetensors* f) {
  for (int pass = 0; pass < 2; pass++) {
    int n = pass ? f->n_meta : f->n;
    if (n < 2) continue;
    const char** s = malloc((size_t)n * sizeof *s);
    if (!s) return eng_err("safetensors_load: out of memory");
    for (int i = 0; i < n; i++) s[i] = pass ? f->mkeys[i] : f->e[i].name;
    qsort(s, (size_t)n, sizeof *s, cmp_str);
    for (int i = 1; i < n; i++)
      if (!strcmp(s[i - 1], s[i])) {
        int rc = pass ? eng_err("safetensors_load: %s: duplicate __metadata__ key '%s'", f->path, s[i])
                      : eng_err("safetensors_load: %s: duplicate tensor name '%s'", f->path, s[i]);
        free(s);
        return rc;
      }
    free(s);
  }
  return 0;
}

static int cmp_begin(const void* a, const void* b) {
  const st_entry *x = *(const st_entry* const*)a, *y = *(const st_entry* const*)b;
  if (x->begin != y->begin) return x->begin < y->begin ? -1 : 1;
  return x->end < y->end ? -1 : x->end > y->end;
}

static int validate(eng_safetensors* f) {
  const char* path = f->path;
  for (int i = 0; i < f->n; i++) {
    st_entry* e = &f->e[i];
    uint64_t bytes = (uint64_t)eng_dtype_size(e->dtype);
    for (int d = 0; d < e->ndim; d++) {
      uint64_t s = (uint64_t)e->shape[d];
      if (s && bytes > UINT64_MAX / 2 / s)
        return eng_err("safetensors_load: %s: tensor '%s' shape %s is too large", path, e->name,
                       eng_shape_str(e->ndim, e->shape));
      bytes *= s;
    }
    /* a 0 in the shape makes the byte count 0, but the tensor's strides must still exist */
    if (eng_numel_checked(e->ndim, e->shape, e->dtype, NULL, "safetensors_load"))
      return eng_err("safetensors_load: %s: tensor '%s' shape %s is too large (its strides overflow)", path, e->name,
                     eng_shape_str(e->ndim, e->shape));
    if (e->begin > e->end)
      return eng_err("safetensors_load: %s: tensor '%s' has data_offsets [%llu, %llu] with begin > end", path,
                     e->name, (unsigned long long)e->begin, (unsigned long long)e->end);
    if (e->end - e->begin != bytes)
      return eng_err("safetensors_load: %s: tensor '%s' (%s%s) needs %llu bytes but data_offsets [%llu, %llu] "
                     "hold %llu", path, e->name, st_dtype_names[e->dtype], eng_shape_str(e->ndim, e->shape),
                     (unsigned long long)bytes, (unsigned long long)e->begin, (unsigned long long)e->end,
                     (unsigned long long)(e->end - e->begin));
    if (e->end > f->data_len)
      return eng_err("safetensors_load: %s: tensor '%s' data_offsets [%llu, %llu] run past the end of the data "
                     "(%llu bytes; truncated file?)", path, e->name, (unsigned long long)e->begin,
                     (unsigned long long)e->end, (unsigned long long)f->data_len);
  }
  if (f->n > 1) {
    st_entry** s = malloc((size_t)f->n * sizeof *s);
    if (!s) return eng_err("safetensors_load: out of memory");
    for (int i = 0; i < f->n; i++) s[i] = &f->e[i];
    qsort(s, (size_t)f->n, sizeof *s, cmp_begin);
    const st_entry* prev = NULL;
    for (int i = 0; i < f->n; i++) {
      if (s[i]->begin == s[i]->end) continue;
      if (prev && s[i]->begin < prev->end) {
        int rc = eng_err("safetensors_load: %s: tensors '%s' [%llu, %llu] and '%s' [%llu, %llu] overlap", path,
                         prev->name, (unsigned long long)prev->begin, (unsigned long long)prev->end, s[i]->name,
                         (unsigned long long)s[i]->begin, (unsigned long long)s[i]->end);
        free(s);
        return rc;
      }
      prev = s[i];
    }
    free(s);
  }
  return 0;
}

/* Where the bytes come from: a file (path) or a caller's buffer (name); both
 * loaders share everything else, so fuzzing the buffer covers the parser,
 * the validation and the data ranges of the file loader. */
typedef struct {
  FILE* fp;
  const unsigned char* mem;
  uint64_t size, pos;
} st_src;

static int src_read(st_src* s, void* dst, uint64_t n) {
  if (n == 0) return 0;
  if (s->fp) return fread(dst, 1, (size_t)n, s->fp) == n ? 0 : -1;
  if (n > s->size - s->pos) return -1;
  memcpy(dst, s->mem + s->pos, (size_t)n);
  s->pos += n;
  return 0;
}

/* Reads and validates the header and the data of src (size bytes); path
 * names the file in messages. */
static eng_safetensors* st_load(st_src* src, const char* path) {
  eng_safetensors* f = calloc(1, sizeof *f);
  char* header = NULL;
  uint64_t size = src->size;
  if (!f || !(f->path = strdup(path))) { eng_err("safetensors_load: out of memory"); goto fail; }
  if (size < 8) {
    eng_err("safetensors_load: %s: file too short (%llu bytes) to hold the 8-byte header length", path,
            (unsigned long long)size);
    goto fail;
  }
  unsigned char lenb[8];
  if (src_read(src, lenb, 8)) { eng_err("safetensors_load: %s: read error", path); goto fail; }
  uint64_t hlen = 0;
  for (int k = 7; k >= 0; k--) hlen = (hlen << 8) | lenb[k];
  if (hlen > size - 8) {
    eng_err("safetensors_load: %s: header length %llu exceeds the file size %llu (truncated or not a safetensors "
            "file)", path, (unsigned long long)hlen, (unsigned long long)size);
    goto fail;
  }
  if (hlen > ST_MAX_HEADER) {
    eng_err("safetensors_load: %s: header length %llu is larger than the %u-byte limit", path,
            (unsigned long long)hlen, ST_MAX_HEADER);
    goto fail;
  }
  header = malloc((size_t)hlen + 1);
  f->data_len = size - 8 - hlen;
  f->data = malloc(f->data_len ? (size_t)f->data_len : 1);
  if (!header || !f->data) {
    eng_err("safetensors_load: %s: out of memory reading %llu bytes", path, (unsigned long long)size);
    goto fail;
  }
  if (src_read(src, header, hlen) || src_read(src, f->data, f->data_len)) {
    eng_err("safetensors_load: %s: read error", path);
    goto fail;
  }
  header[hlen] = 0;
  jp p = {header, (size_t)hlen, 0, path, 0};
  if (parse_header(&p, f) || check_duplicates(f) || validate(f)) goto fail;
  free(header);
  return f;
fail:
  free(header);
  eng_safetensors_free(f);
  return NULL;
}

eng_safetensors* eng_safetensors_load(const char* path) {
  if (!path) return eng_errp("safetensors_load: path is NULL");
  FILE* fp = fopen(path, "rb");
  if (!fp) return eng_errp("safetensors_load: cannot open '%s': %s", path, strerror(errno));
  eng_safetensors* f = NULL;
  off_t size;
  if (fseeko(fp, 0, SEEK_END) != 0 || (size = ftello(fp)) < 0 || fseeko(fp, 0, SEEK_SET) != 0)
    eng_err("safetensors_load: %s: cannot seek: %s", path, strerror(errno));
  else {
    st_src src = {fp, NULL, (uint64_t)size, 0};
    f = st_load(&src, path);
  }
  fclose(fp);
  return f;
}

eng_safetensors* eng_safetensors_load_memory(const void* bytes, size_t n, const char* name) {
  if (!bytes && n > 0) return eng_errp("safetensors_load: buffer is NULL");
  st_src src = {NULL, (const unsigned char*)bytes, (uint64_t)n, 0};
  return st_load(&src, name ? name : "(memory)");
}

int eng_safetensors_count(const eng_safetensors* f) {
  if (!f) return eng_err("safetensors: file handle is NULL");
  return f->n;
}

const char* eng_safetensors_name(const eng_safetensors* f, int i) {
  if (!f) return eng_errp("safetensors: file handle is NULL");
  if (i < 0 || i >= f->n) return eng_errp("safetensors: tensor index %d out of range (%d tensors in %s)", i, f->n, f->path);
  return f->e[i].name;
}

eng_tensor* eng_safetensors_get(const eng_safetensors* f, const char* name) {
  if (!f) return eng_errp("safetensors: file handle is NULL");
  if (!name) return eng_errp("safetensors_get: name is NULL");
  for (int i = 0; i < f->n; i++) {
    const st_entry* e = &f->e[i];
    if (strcmp(e->name, name)) continue;
    eng_tensor* t = eng_new(e->ndim, e->shape, e->dtype, ENG_CPU);
    if (t && e->end > e->begin) memcpy(eng_ptr(t), f->data + e->begin, (size_t)(e->end - e->begin));
    if (t && e->dtype == ENG_BOOL) { /* normalise to 0/1 */
      unsigned char* b = (unsigned char*)eng_ptr(t);
      for (int64_t k = 0; k < t->numel; k++) b[k] = b[k] != 0;
    }
    return t;
  }
  return eng_errp("safetensors_get: %s has no tensor named '%s'", f->path, name);
}

int eng_safetensors_meta_count(const eng_safetensors* f) {
  if (!f) return eng_err("safetensors: file handle is NULL");
  return f->n_meta;
}

const char* eng_safetensors_meta_key(const eng_safetensors* f, int i) {
  if (!f) return eng_errp("safetensors: file handle is NULL");
  if (i < 0 || i >= f->n_meta) return eng_errp("safetensors: metadata index %d out of range (%d entries)", i, f->n_meta);
  return f->mkeys[i];
}

const char* eng_safetensors_meta_value(const eng_safetensors* f, int i) {
  if (!f) return eng_errp("safetensors: file handle is NULL");
  if (i < 0 || i >= f->n_meta) return eng_errp("safetensors: metadata index %d out of range (%d entries)", i, f->n_meta);
  return f->mvals[i];
}

/* ------------------------------------------------------------------ saving */
int eng_safetensors_save(const char* path, int n, const char** names, eng_tensor** tensors,
                         int n_meta, const char** meta_keys, const char** meta_values) {
  const char* op = "safetensors_save";
  if (!path) return eng_err("%s: path is NULL", op);
  if (n < 0 || n_meta < 0) return eng_err("%s: %s: negative count", op, path);
  if (n > 0 && (!names || !tensors)) return eng_err("%s: %s: names or tensors list is NULL", op, path);
  if (n_meta > 0 && (!meta_keys || !meta_values)) return eng_err("%s: %s: metadata lists are NULL", op, path);
  for (int i = 0; i < n; i++) {
    if (!names[i]) return eng_err("%s: %s: name %d is NULL", op, path, i + 1);
    if (!tensors[i]) return eng_err("%s: %s: tensor '%s' is NULL", op, path, names[i]);
    if (eng_meta_check(tensors[i], op)) { eng_err_prefix("%s: tensor '%s'", path, names[i]); return -1; }
    if (!strcmp(names[i], "__metadata__")) return eng_err("%s: %s: '__metadata__' is reserved and cannot name a tensor", op, path);
    if (tensors[i]->device != ENG_CPU) return eng_err("%s: %s: tensor '%s' %s is not on the CPU", op, path, names[i], eng_desc(tensors[i]));
    for (int j = 0; j < i; j++)
      if (!strcmp(names[i], names[j])) return eng_err("%s: %s: duplicate tensor name '%s'", op, path, names[i]);
  }
  for (int i = 0; i < n_meta; i++)
    if (!meta_keys[i] || !meta_values[i]) return eng_err("%s: %s: metadata entry %d is NULL", op, path, i + 1);

  sbuf h = {0};
  sb_str(&h, "{");
  int first = 1;
  if (n_meta > 0) {
    sb_str(&h, "\"__metadata__\":{");
    for (int i = 0; i < n_meta; i++) {
      if (i) sb_str(&h, ",");
      sb_json_string(&h, meta_keys[i]); sb_str(&h, ":"); sb_json_string(&h, meta_values[i]);
    }
    sb_str(&h, "}");
    first = 0;
  }
  uint64_t off = 0;
  char num[64];
  for (int i = 0; i < n; i++) {
    eng_tensor* t = tensors[i];
    uint64_t bytes = (uint64_t)t->numel * (uint64_t)eng_dtype_size(t->dtype);
    if (!first) sb_str(&h, ",");
    first = 0;
    sb_json_string(&h, names[i]);
    sb_str(&h, ":{\"dtype\":\"");
    sb_str(&h, st_dtype_names[t->dtype]);
    sb_str(&h, "\",\"shape\":[");
    for (int d = 0; d < t->ndim; d++) {
      snprintf(num, sizeof num, d ? ",%lld" : "%lld", (long long)t->shape[d]);
      sb_str(&h, num);
    }
    snprintf(num, sizeof num, "],\"data_offsets\":[%llu,%llu]}", (unsigned long long)off,
             (unsigned long long)(off + bytes));
    sb_str(&h, num);
    off += bytes;
  }
  sb_str(&h, "}");
  while (!h.oom && h.n % 8) sb_str(&h, " ");
  if (h.oom) { free(h.p); return eng_err("%s: %s: out of memory building the header", op, path); }

  size_t plen = strlen(path);
  char* tmp = malloc(plen + 32);
  if (!tmp) { free(h.p); return eng_err("%s: out of memory", op); }
  snprintf(tmp, plen + 32, "%s.tmp%ld", path, (long)getpid());
  FILE* fp = fopen(tmp, "wb");
  if (!fp) {
    int rc = eng_err("%s: cannot open '%s' for writing: %s", op, tmp, strerror(errno));
    free(h.p); free(tmp);
    return rc;
  }
  unsigned char lenb[8];
  uint64_t hl = h.n;
  for (int k = 0; k < 8; k++) lenb[k] = (unsigned char)(hl >> (8 * k));
  int ok = fwrite(lenb, 1, 8, fp) == 8 && fwrite(h.p, 1, h.n, fp) == h.n, copy_failed = 0;
  free(h.p);
  for (int i = 0; ok && i < n; i++) {
    eng_tensor* t = tensors[i];
    if (t->numel == 0) continue;
    eng_tensor* c = eng_as_contig(t, t->dtype);
    if (!c) { ok = 0; copy_failed = 1; break; }
    size_t bytes = (size_t)t->numel * (size_t)eng_dtype_size(t->dtype);
    ok = fwrite(eng_ptr(c), 1, bytes, fp) == bytes;
    eng_tensor_release(c);
  }
  int err = errno;
  if (fclose(fp) != 0 && ok) { ok = 0; err = errno; }
  if (!ok) {
    int rc = copy_failed ? -1 : eng_err("%s: write error on '%s': %s", op, path, strerror(err));
    if (copy_failed) eng_err_prefix("%s: %s", op, path);
    remove(tmp);
    free(tmp);
    return rc;
  }
  if (rename(tmp, path) != 0) {
    int rc = eng_err("%s: cannot move '%s' to '%s': %s", op, tmp, path, strerror(errno));
    remove(tmp);
    free(tmp);
    return rc;
  }
  free(tmp);
  return 0;
}
