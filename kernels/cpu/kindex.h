/* kindex.h: CPU kernels of the indexing ops (gather, scatter, index_add,
 * index_copy, nonzero) on contiguous raw buffers.  dtype codes as kcpu.h;
 * index arrays are int64, already checked in range by the caller. */
#ifndef KINDEX_H
#define KINDEX_H
#include <stdint.h>

/* out (contiguous over ishape) [p] = x (contiguous over xshape) at the
 * coordinates of p with dim d replaced by idx[p]; es: element size. */
void kc_gather(int es, int ndim, const int64_t* ishape, const int64_t* xshape, int d, char* out, const char* x,
               const int64_t* idx);
/* dst (contiguous over dshape) at the coordinates of p with dim d replaced by
 * idx[p] = (accumulate: +=) src[p] (src and idx contiguous over ishape). */
void kc_scatter(int dt, int accumulate, int ndim, const int64_t* ishape, const int64_t* dshape, int d, char* dst,
                const char* src, const int64_t* idx);
/* dst [outer, dst_n, inner], src [outer, n_idx, inner]:
 * dst[o, idx[j], :] = (accumulate: +=) alpha * src[o, j, :]. */
void kc_index_put(int dt, int accumulate, double alpha, int64_t outer, int64_t dst_n, int64_t n_idx, int64_t inner,
                  char* dst, const char* src, const int64_t* idx);
/* Number of nonzero elements of x (n elements of dtype dt). */
int64_t kc_count_nonzero(int dt, int64_t n, const char* x);
/* Row-major coordinates (0-based) of the nonzero elements of x (contiguous,
 * shape of ndim dims) into out [count, ndim]. */
void kc_nonzero(int dt, int ndim, const int64_t* shape, const char* x, int64_t* out);

#endif
