/* rng.h: counter-based random numbers (Philox 4x32-10).
 *
 * Element i of a random tensor drawn with (seed, offset) is a pure function
 * of (seed, offset + i), where i is its row-major index in the GLOBAL tensor.
 * So any shard of a global random tensor can be generated on its own and is
 * bit-identical to the same slice of the whole.  The global generator keeps
 * (seed, offset); each draw advances offset by the global numel rounded up to
 * a multiple of 4. */
#ifndef ENG_RNG_H
#define ENG_RNG_H
#include <stdint.h>
#include <stddef.h>
#include "tensor.h"

enum { ENG_RNG_UNIFORM = 0, ENG_RNG_NORMAL = 1, ENG_RNG_BERNOULLI = 2 };

/* A generator is its state: (seed, offset).  Besides the global one, user generators (Lua's
 * engine.Generator) are structs owned by the caller.  eng_rng_use(g) makes g the generator of this
 * thread's draws (NULL: the global one again) and returns the previous one; the functions below
 * (seed, state, reserve, and every random op) act on that current generator. */
typedef struct eng_generator { uint64_t seed; uint64_t offset; } eng_generator;
eng_generator* eng_rng_use(eng_generator* g);

void eng_manual_seed(uint64_t seed);
void eng_rng_get_state(uint64_t* seed, uint64_t* offset);
void eng_rng_set_state(uint64_t seed, uint64_t offset);
/* Reserve n draws from the current generator: returns the offset to use. */
uint64_t eng_rng_reserve(uint64_t n);

/* The slice [start, start+size) of a global random tensor of global_shape,
 * drawn with (seed, offset).  kind uniform: U[a, b); normal: N(a, b^2);
 * bernoulli: 1 with probability a.  start/size may be NULL for the whole. */
eng_tensor* eng_random_slice(int kind, int ndim, const int64_t* global_shape,
                             const int64_t* start, const int64_t* size, double a, double b,
                             int dtype, uint64_t seed, uint64_t offset);
/* Whole tensors from the global generator. */
eng_tensor* eng_rand(int ndim, const int64_t* shape, int dtype);
eng_tensor* eng_randn(int ndim, const int64_t* shape, int dtype);
/* In place (no autograd): fill t from the global generator. */
int eng_uniform_(eng_tensor* t, double a, double b);
int eng_normal_(eng_tensor* t, double mean, double std);

#endif
