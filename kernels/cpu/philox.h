/* philox.h: the Philox 4x32-10 counter-based generator (Salmon et al., SC'11)
 * and the per-element transforms of the engine's random numbers.
 *
 * Addressing scheme (shared by every random op, so any shard of a global
 * random tensor can be generated on its own):
 *   element j (= offset + global row-major index) uses block b = j / 4 and
 *   word w = j % 4 of Philox(counter = {lo32(b), hi32(b), 0, 0},
 *   key = {lo32(seed), hi32(seed)}).
 *   uniform   u_j = word * 2^-32                            in [0, 1)
 *   bernoulli 1 if u_j < p
 *   normal    Box-Muller on the word pair (0,1) or (2,3) of the block:
 *             elements 4b, 4b+2 take r*cos(theta), 4b+1, 4b+3 take r*sin(theta),
 *             with r = sqrt(-2 ln((w_even + 1) * 2^-32)), theta = 2 pi w_odd 2^-32.
 * All transforms run in double precision; callers round to the output dtype.
 * The CPU kernels (random.c) evaluate ln, cos and sin with their own
 * branch-free polynomials (within a few ulp of libm), so a value depends
 * only on (seed, position); another backend matches them to ~1e-15, not
 * bit for bit, unless it uses the same polynomials.
 * Pure C with no engine types; KC_PHILOX_FN lets another backend (e.g. CUDA)
 * compile the same functions with its own qualifiers. */
#ifndef KCPU_PHILOX_H
#define KCPU_PHILOX_H
#include <stdint.h>
#include <math.h>

#ifndef KC_PHILOX_FN
#define KC_PHILOX_FN static inline
#endif

#define KC_PHILOX_M0 0xD2511F53u
#define KC_PHILOX_M1 0xCD9E8D57u
#define KC_PHILOX_W0 0x9E3779B9u
#define KC_PHILOX_W1 0xBB67AE85u

/* out = Philox4x32-10(counter c, key k). */
KC_PHILOX_FN void kc_philox4x32_10(const uint32_t c_in[4], const uint32_t k_in[2], uint32_t out[4]) {
  uint32_t c0 = c_in[0], c1 = c_in[1], c2 = c_in[2], c3 = c_in[3];
  uint32_t k0 = k_in[0], k1 = k_in[1];
  for (int r = 0; r < 10; r++) {
    uint64_t p0 = (uint64_t)KC_PHILOX_M0 * c0;
    uint64_t p1 = (uint64_t)KC_PHILOX_M1 * c2;
    uint32_t hi0 = (uint32_t)(p0 >> 32), lo0 = (uint32_t)p0;
    uint32_t hi1 = (uint32_t)(p1 >> 32), lo1 = (uint32_t)p1;
    c0 = hi1 ^ c1 ^ k0;
    c1 = lo1;
    c2 = hi0 ^ c3 ^ k1;
    c3 = lo0;
    k0 += KC_PHILOX_W0;
    k1 += KC_PHILOX_W1;
  }
  out[0] = c0; out[1] = c1; out[2] = c2; out[3] = c3;
}

/* The four words of block b for seed. */
KC_PHILOX_FN void kc_philox_block(uint64_t seed, uint64_t b, uint32_t out[4]) {
  uint32_t c[4] = {(uint32_t)b, (uint32_t)(b >> 32), 0u, 0u};
  uint32_t k[2] = {(uint32_t)seed, (uint32_t)(seed >> 32)};
  kc_philox4x32_10(c, k, out);
}

KC_PHILOX_FN double kc_philox_u01(uint32_t w) { return (double)w * (1.0 / 4294967296.0); }

#endif
