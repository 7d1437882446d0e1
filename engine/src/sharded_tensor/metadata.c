/* Subsystem sharded_tensor/: ShardedTensor metadata and shard math (PyTorch's
 * torch.distributed._shard): shard boxes, torch.chunk sharding specs, the
 * checks of enumerable specs.  May call: core/ (and later comm/, dtensor/ for
 * the ShardedTensor <-> DTensor bridge).  The API objects are Lua
 * (lua/engine/distributed/sharding_spec.lua). */
/* metadata.c: checks of shard boxes against a tensor; torch.chunk boxes. */
#include "core/internal.h"
#include <stdio.h>

static const char* box_str(int ndim, const int64_t* off, const int64_t* sz, char* buf, int cap) {
  int k = snprintf(buf, cap, "offsets [");
  for (int d = 0; d < ndim && k < cap; d++) k += snprintf(buf + k, cap - k, "%s%lld", d ? "," : "", (long long)off[d]);
  if (k < cap) k += snprintf(buf + k, cap - k, "] sizes [");
  for (int d = 0; d < ndim && k < cap; d++) k += snprintf(buf + k, cap - k, "%s%lld", d ? "," : "", (long long)sz[d]);
  if (k < cap) snprintf(buf + k, cap - k, "]");
  return buf;
}

int eng_shards_validate(const char* op, int n, int ndim, const int64_t* offsets, const int64_t* sizes,
                        const int64_t* shape, int check_cover) {
  if (!op) op = "shards";
  if (n < 0 || ndim < 0 || ndim > ENG_MAX_DIMS) return eng_err("%s: bad shard count %d or dims %d", op, n, ndim);
  if (n > 0 && (!offsets || !sizes)) return eng_err("%s: offsets/sizes are NULL", op);
  if (ndim > 0 && !shape) return eng_err("%s: shape is NULL", op);
  char b1[256], b2[256];
  int64_t total = 1, covered = 0;
  int empty_tensor = 0;
  for (int d = 0; d < ndim; d++) {
    if (shape[d] < 0) return eng_err("%s: tensor size %lld of dim %d is negative", op, (long long)shape[d], d + 1);
    if (shape[d] == 0) empty_tensor = 1;
    else if (!empty_tensor && !eng_mul_ok(total, shape[d], &total))
      return eng_err("%s: tensor shape %s is too large", op, eng_shape_str(ndim, shape));
  }
  if (empty_tensor) total = 0;
  for (int i = 0; i < n; i++) {
    const int64_t *o = offsets + (int64_t)i * ndim, *s = sizes + (int64_t)i * ndim;
    int64_t vol = 1;
    for (int d = 0; d < ndim; d++) {
      if (o[d] < 0 || s[d] < 0)
        return eng_err("%s: shard %d (%s) has a negative offset or size", op, i + 1, box_str(ndim, o, s, b1, sizeof b1));
      if (o[d] > shape[d] || s[d] > shape[d] - o[d])
        return eng_err("%s: shard %d (%s) is out of bounds of the tensor %s on dim %d", op, i + 1,
                       box_str(ndim, o, s, b1, sizeof b1), eng_shape_str(ndim, shape), d + 1);
      vol = s[d] == 0 || vol == 0 ? 0 : vol * s[d]; /* bounded by total, no overflow */
    }
    covered += vol;
    if (vol == 0) continue;
    for (int j = 0; j < i; j++) {
      const int64_t *o2 = offsets + (int64_t)j * ndim, *s2 = sizes + (int64_t)j * ndim;
      int overlap = 1;
      for (int d = 0; d < ndim && overlap; d++) {
        if (s2[d] == 0 || o[d] >= o2[d] + s2[d] || o2[d] >= o[d] + s[d]) overlap = 0;
      }
      if (overlap)
        return eng_err("%s: shards %d (%s) and %d (%s) overlap", op, j + 1, box_str(ndim, o2, s2, b2, sizeof b2), i + 1,
                       box_str(ndim, o, s, b1, sizeof b1));
    }
  }
  if (check_cover && covered != total)
    return eng_err("%s: the shards cover %lld of the %lld elements of the tensor %s (they must cover it exactly)", op,
                   (long long)covered, (long long)total, eng_shape_str(ndim, shape));
  return 0;
}

void eng_chunk_box(int64_t size, int n_chunks, int i, int64_t* offset, int64_t* len) {
  if (n_chunks <= 0 || size <= 0 || i < 0 || i >= n_chunks) { *offset = size > 0 ? size : 0; *len = 0; return; }
  int64_t split = (size + n_chunks - 1) / n_chunks;
  int64_t off = split * i;
  if (off >= size) { *offset = size; *len = 0; return; }
  *offset = off;
  *len = size - off < split ? size - off : split;
}
