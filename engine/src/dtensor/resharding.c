/* resharding.c: which part of a saved chunk lands in the shard a rank holds
 * now (PyTorch's checkpoint/resharding.py: _check_shard_metadata_pair_overlap
 * and _shards_get_overlap_region_wrt_saved_tensor).  Pure math: loading a
 * checkpoint into any layout copies, for every saved chunk that overlaps
 * this rank's shard, saved.narrow(d, saved_off, len) into
 * current.narrow(d, cur_off, len) over every dim d. */
#include "core/internal.h"
#include <stdio.h>

static int check_box(const char* op, const char* what, int ndim, const int64_t* off, const int64_t* size) {
  if (!off || !size) return eng_err("%s: %s offsets/sizes are NULL", op, what);
  for (int d = 0; d < ndim; d++)
    if (off[d] < 0 || size[d] < 0)
      return eng_err("%s: %s box has offset %lld and size %lld on dim %d (both must be >= 0)", op, what,
                     (long long)off[d], (long long)size[d], d + 1);
  return 0;
}

static int check_args(const char* op, int ndim, const int64_t* oa, const int64_t* sa, const int64_t* ob,
                      const int64_t* sb, const char* na, const char* nb) {
  if (ndim < 0 || ndim > ENG_MAX_DIMS) return eng_err("%s: %d dims (0 to %d)", op, ndim, ENG_MAX_DIMS);
  if (check_box(op, na, ndim, oa, sa) || check_box(op, nb, ndim, ob, sb)) return -1;
  return 0;
}

static int overlap(int ndim, const int64_t* oa, const int64_t* sa, const int64_t* ob, const int64_t* sb) {
  for (int d = 0; d < ndim; d++) if (sa[d] == 0 || sb[d] == 0) return 0; /* nothing to copy */
  for (int d = 0; d < ndim; d++)
    if (oa[d] >= ob[d] + sb[d] || ob[d] >= oa[d] + sa[d]) return 0;
  return 1;
}

int eng_shard_boxes_overlap(int ndim, const int64_t* off_a, const int64_t* size_a, const int64_t* off_b,
                            const int64_t* size_b) {
  if (check_args("check_shard_metadata_pair_overlap", ndim, off_a, size_a, off_b, size_b, "first", "second")) return -1;
  return overlap(ndim, off_a, size_a, off_b, size_b);
}

int eng_shard_overlap_region(int ndim, const int64_t* saved_off, const int64_t* saved_size, const int64_t* cur_off,
                             const int64_t* cur_size, int64_t* out) {
  const char* op = "shards_get_overlap_region_wrt_saved_tensor";
  if (check_args(op, ndim, saved_off, saved_size, cur_off, cur_size, "saved", "current")) return -1;
  if (!out) return eng_err("%s: output is NULL", op);
  if (!overlap(ndim, saved_off, saved_size, cur_off, cur_size)) {
    char a[160], b[160], c[160], d[160];
    snprintf(a, sizeof a, "%s", eng_shape_str(ndim, saved_off));
    snprintf(b, sizeof b, "%s", eng_shape_str(ndim, saved_size));
    snprintf(c, sizeof c, "%s", eng_shape_str(ndim, cur_off));
    snprintf(d, sizeof d, "%s", eng_shape_str(ndim, cur_size));
    return eng_err("%s: the saved chunk (offsets %s, sizes %s) and the current shard (offsets %s, sizes %s) do not "
                   "overlap", op, a, b, c, d);
  }
  for (int i = 0; i < ndim; i++) {
    int64_t so = saved_off[i], co = cur_off[i];
    int64_t end = saved_off[i] + saved_size[i] < cur_off[i] + cur_size[i] ? saved_off[i] + saved_size[i]
                                                                          : cur_off[i] + cur_size[i];
    int64_t start = so > co ? so : co;
    out[4 * i] = i;
    out[4 * i + 1] = so > co ? 0 : co - so; /* where the intersection starts in the saved chunk */
    out[4 * i + 2] = so > co ? so - co : 0; /* ... and in the current shard */
    out[4 * i + 3] = end - start;
  }
  return 0;
}
