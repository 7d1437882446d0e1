/* checksum.c: a 64-bit checksum of a tensor's values (row-major bytes of its
 * dtype), stored per tensor in checkpoints and verified on load.  The mix is
 * FNV-1a over 8-byte words (then the tail bytes), finished with a
 * splitmix64-style avalanche: one multiply per word, so a 100 MB checkpoint
 * costs a few tens of milliseconds. */
#include "core/internal.h"

static uint64_t mix_bytes(const unsigned char* p, int64_t n) {
  uint64_t h = 0xcbf29ce484222325ULL ^ (uint64_t)n;
  const uint64_t prime = 0x100000001b3ULL;
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    uint64_t w;
    memcpy(&w, p + i, 8);
    h = (h ^ w) * prime;
    h ^= h >> 29;
  }
  for (; i < n; i++) h = (h ^ p[i]) * prime;
  h ^= h >> 33; h *= 0xff51afd7ed558ccdULL;
  h ^= h >> 33; h *= 0xc4ceb9fe1a85ec53ULL;
  h ^= h >> 33;
  return h;
}

int eng_tensor_checksum(const eng_tensor* t, uint64_t* out) {
  ENG_CHECK_I(t, "checksum");
  if (!out) return eng_err("checksum: output pointer is NULL");
  if (eng_meta_check(t, "checksum")) return -1;
  if (t->dist)
    return eng_err("checksum: %s is a DTensor; checksum its local shard (to_local()) or the full tensor "
                   "(full_tensor())", eng_desc(t));
  eng_tensor* h = t->device == ENG_CPU ? eng_tensor_retain((eng_tensor*)t) : eng_tensor_to_device((eng_tensor*)t, ENG_CPU);
  if (!h) { eng_err_prefix("checksum"); return -1; }
  eng_tensor* c = eng_as_contig(h, h->dtype);
  eng_tensor_release(h);
  if (!c) { eng_err_prefix("checksum"); return -1; }
  *out = mix_bytes((const unsigned char*)eng_ptr(c), c->numel * eng_dtype_size(c->dtype));
  eng_tensor_release(c);
  return 0;
}
