/* mpi.c: the MPI backend of the process groups: one collective on raw
 * contiguous CPU buffers, blocking (MPI_Allreduce, ...) or nonblocking
 * (MPI_Iallreduce, ...).  bf16 and f16 travel as 2-byte MPI datatypes of
 * their own, reduced by custom MPI ops that compute each pairwise step in f32
 * and round the result to the 16-bit type.  For max/min that is exact; for
 * sum/prod it is exact only when every element is combined once (2 ranks):
 * comm/process_group.c widens sums and products to f32 for larger groups, so they are
 * rounded only once. */
#include "comm/comm_impl.h"
#include "comm/guard.h"
#include "kernels/cpu/kcpu.h"
#include "eng/comm.h"
#include <limits.h>
#include <math.h>
#include <stdio.h>

static MPI_Datatype g_bf16 = MPI_DATATYPE_NULL, g_f16 = MPI_DATATYPE_NULL;
static MPI_Op g_half_max = MPI_OP_NULL, g_half_min = MPI_OP_NULL, g_half_sum = MPI_OP_NULL,
              g_half_prod = MPI_OP_NULL;
static int g_ready;

typedef float (*half_load)(uint16_t);
typedef uint16_t (*half_store)(float);

/* inout[i] = in[i] op inout[i], in f32, for the 2-byte float types. */
static void half_reduce(void* in, void* inout, int* len, MPI_Datatype* dt, int is_max) {
  half_load ld = (*dt == g_bf16) ? kc_bf16_to_f32 : kc_f16_to_f32;
  half_store st = (*dt == g_bf16) ? kc_f32_to_bf16 : kc_f32_to_f16;
  const uint16_t* a = in;
  uint16_t* b = inout;
  int n = *len;
  for (int i = 0; i < n; i++) {
    float x = ld(a[i]), y = ld(b[i]);
    int take_x = isnan(x) || (is_max ? x > y : x < y);
    if (take_x) b[i] = st(x);
  }
}
static void half_max_fn(void* in, void* inout, int* len, MPI_Datatype* dt) { half_reduce(in, inout, len, dt, 1); }
static void half_min_fn(void* in, void* inout, int* len, MPI_Datatype* dt) { half_reduce(in, inout, len, dt, 0); }

/* inout[i] = round16(f32(in[i]) + f32(inout[i])) (or *): the f32 sum of two
 * bf16 values is exact, so this rounds once. */
static void half_arith(void* in, void* inout, int* len, MPI_Datatype* dt, int is_prod) {
  const uint16_t* a = in;
  uint16_t* b = inout;
  int n = *len;
  if (*dt == g_bf16) {
    if (is_prod) for (int i = 0; i < n; i++) b[i] = kc_f32_to_bf16(kc_bf16_to_f32(a[i]) * kc_bf16_to_f32(b[i]));
    else for (int i = 0; i < n; i++) b[i] = kc_f32_to_bf16(kc_bf16_to_f32(a[i]) + kc_bf16_to_f32(b[i]));
  } else {
    if (is_prod) for (int i = 0; i < n; i++) b[i] = kc_f32_to_f16(kc_f16_to_f32(a[i]) * kc_f16_to_f32(b[i]));
    else for (int i = 0; i < n; i++) b[i] = kc_f32_to_f16(kc_f16_to_f32(a[i]) + kc_f16_to_f32(b[i]));
  }
}
static void half_sum_fn(void* in, void* inout, int* len, MPI_Datatype* dt) { half_arith(in, inout, len, dt, 0); }
static void half_prod_fn(void* in, void* inout, int* len, MPI_Datatype* dt) { half_arith(in, inout, len, dt, 1); }

static int ensure_types(void) {
  if (g_ready) return 0;
  if (MPI_Type_contiguous(2, MPI_BYTE, &g_bf16) != MPI_SUCCESS || MPI_Type_commit(&g_bf16) != MPI_SUCCESS ||
      MPI_Type_contiguous(2, MPI_BYTE, &g_f16) != MPI_SUCCESS || MPI_Type_commit(&g_f16) != MPI_SUCCESS ||
      MPI_Op_create(half_max_fn, 1, &g_half_max) != MPI_SUCCESS ||
      MPI_Op_create(half_min_fn, 1, &g_half_min) != MPI_SUCCESS ||
      MPI_Op_create(half_sum_fn, 1, &g_half_sum) != MPI_SUCCESS ||
      MPI_Op_create(half_prod_fn, 1, &g_half_prod) != MPI_SUCCESS)
    return eng_err("comm: cannot create the MPI datatypes and ops for bf16/f16");
  g_ready = 1;
  return 0;
}

const char* comm_mpi_errstr(int rc) {
  static __thread char buf[MPI_MAX_ERROR_STRING + 32];
  char s[MPI_MAX_ERROR_STRING];
  int n = 0;
  if (MPI_Error_string(rc, s, &n) != MPI_SUCCESS) snprintf(s, sizeof s, "unknown");
  snprintf(buf, sizeof buf, "MPI error %d: %s", rc, s);
  return buf;
}

static MPI_Datatype mpi_type(int dtype) {
  switch (dtype) {
    case ENG_F32: return MPI_FLOAT;
    case ENG_F64: return MPI_DOUBLE;
    case ENG_BF16: return g_bf16;
    case ENG_F16: return g_f16;
    case ENG_I32: return MPI_INT32_T;
    case ENG_I64: return MPI_INT64_T;
    default: return MPI_UINT8_T; /* u8, bool */
  }
}

static int mpi_op(int op, int dtype, MPI_Op* out) {
  int half = dtype == ENG_BF16 || dtype == ENG_F16;
  switch (op) {
    case ENG_REDUCE_SUM: case ENG_REDUCE_AVG: *out = half ? g_half_sum : MPI_SUM; break;
    case ENG_REDUCE_MAX: *out = half ? g_half_max : MPI_MAX; break;
    case ENG_REDUCE_MIN: *out = half ? g_half_min : MPI_MIN; break;
    case ENG_REDUCE_PROD: *out = half ? g_half_prod : MPI_PROD; break;
    default: return eng_err("comm: invalid reduce op %d", op);
  }
  return 0;
}

int comm_mpi_issue(eng_pg* pg, const comm_args* a, MPI_Request* req) {
  if (ensure_types()) return -1;
  if (a->count > INT_MAX || a->count < 0)
    return eng_err("%s: %lld elements per call exceed the MPI limit of %d", eng_coll_kind_name(a->kind),
                   (long long)a->count, INT_MAX);
  int n = (int)a->count;
  MPI_Datatype dt = mpi_type(a->dtype);
  MPI_Comm c = pg->comm;
  MPI_Op op = MPI_OP_NULL;
  const void* send = a->send;
  int rc;
  if (!req) comm_guard_begin(pg, eng_coll_kind_name(a->kind)); /* a blocking call: not for ever */
  switch (a->kind) {
    case ENG_COLL_ALL_REDUCE:
      if (mpi_op(a->op, a->dtype, &op)) return -1;
      if (!send || send == a->recv) send = MPI_IN_PLACE;
      rc = req ? MPI_Iallreduce(send, a->recv, n, dt, op, c, req) : MPI_Allreduce(send, a->recv, n, dt, op, c);
      break;
    case ENG_COLL_ALL_GATHER:
      rc = req ? MPI_Iallgather(send, n, dt, a->recv, n, dt, c, req) : MPI_Allgather(send, n, dt, a->recv, n, dt, c);
      break;
    case ENG_COLL_REDUCE_SCATTER:
      if (mpi_op(a->op, a->dtype, &op)) return -1;
      rc = req ? MPI_Ireduce_scatter_block(send, a->recv, n, dt, op, c, req)
               : MPI_Reduce_scatter_block(send, a->recv, n, dt, op, c);
      break;
    case ENG_COLL_ALL_TO_ALL:
      rc = req ? MPI_Ialltoall(send, n, dt, a->recv, n, dt, c, req) : MPI_Alltoall(send, n, dt, a->recv, n, dt, c);
      break;
    case ENG_COLL_BROADCAST:
      rc = req ? MPI_Ibcast(a->recv, n, dt, a->root, c, req) : MPI_Bcast(a->recv, n, dt, a->root, c);
      break;
    case ENG_COLL_SCATTER:
      rc = req ? MPI_Iscatter(send, n, dt, a->recv, n, dt, a->root, c, req)
               : MPI_Scatter(send, n, dt, a->recv, n, dt, a->root, c);
      break;
    case ENG_COLL_GATHER:
      if (a->vcounts) /* per-rank sizes: set on every rank (MPI reads them on the root) */
        rc = req ? MPI_Igatherv(send, n, dt, a->recv, a->vcounts, a->vdispls, dt, a->root, c, req)
                 : MPI_Gatherv(send, n, dt, a->recv, a->vcounts, a->vdispls, dt, a->root, c);
      else
        rc = req ? MPI_Igather(send, n, dt, a->recv, n, dt, a->root, c, req)
                 : MPI_Gather(send, n, dt, a->recv, n, dt, a->root, c);
      break;
    case ENG_COLL_BARRIER:
      rc = req ? MPI_Ibarrier(c, req) : MPI_Barrier(c);
      break;
    default:
      comm_guard_end();
      return eng_err("comm: invalid collective kind %d", a->kind);
  }
  if (!req) comm_guard_end();
  if (rc != MPI_SUCCESS)
    return eng_err("%s: %s on group %s", eng_coll_kind_name(a->kind), comm_mpi_errstr(rc), pg->name);
  return 0;
}

int comm_mpi_alltoall_vector(eng_pg* pg, const void* send, void* recv, int64_t rows, int64_t block,
                             int64_t row_stride, int dtype) {
  if (ensure_types()) return -1;
  if (rows <= 0 || block <= 0 || row_stride < block || rows > INT_MAX || row_stride > INT_MAX ||
      rows * block > INT_MAX)
    return eng_err("raw_all_to_all_strided: bad layout rows=%lld block=%lld row_stride=%lld", (long long)rows,
                   (long long)block, (long long)row_stride);
  MPI_Datatype dt = mpi_type(dtype), vec = MPI_DATATYPE_NULL, sized = MPI_DATATYPE_NULL;
  MPI_Aint lb, extent;
  int rc = MPI_Type_get_extent(dt, &lb, &extent);
  if (rc == MPI_SUCCESS) rc = MPI_Type_vector((int)rows, (int)block, (int)row_stride, dt, &vec);
  /* consecutive peers' blocks start `block` elements apart */
  if (rc == MPI_SUCCESS) rc = MPI_Type_create_resized(vec, 0, (MPI_Aint)block * extent, &sized);
  if (rc == MPI_SUCCESS) rc = MPI_Type_commit(&sized);
  if (rc == MPI_SUCCESS) {
    comm_guard_begin(pg, "all_to_all");
    rc = MPI_Alltoall(send, 1, sized, recv, (int)(rows * block), dt, pg->comm);
    comm_guard_end();
  }
  if (sized != MPI_DATATYPE_NULL) MPI_Type_free(&sized);
  if (vec != MPI_DATATYPE_NULL) MPI_Type_free(&vec);
  if (rc != MPI_SUCCESS)
    return eng_err("raw_all_to_all_strided: %s on group %s", comm_mpi_errstr(rc), pg->name);
  return 0;
}
