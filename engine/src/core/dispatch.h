/* dispatch.h: the one boundary between the ops and the DTensor layer (a
 * registration point, as autograd/dist_hooks.h is for autograd).  Not public.
 *
 * Ops and core compute on local tensors only.  When an operand of an op is a
 * DTensor (t->dist) or lives on the meta device, the op's guard hands the call
 * to the dispatcher by op id:
 *
 *   if (ENG_DT_ACTIVE(a->dist || ENG_META_T(a) || b->dist || ENG_META_T(b)))
 *     return eng_op_dispatch(ENG_OP_BINARY, &(eng_op_call){.n_in = 2, .in = {a, b}, .ints = {which}});
 *
 * The dispatcher (dtensor/dispatch.c) installs its entry points here when the
 * library loads and owns the table that maps each op id to what handles it:
 * the sharding rules register an op def per id (sharding/registry.c), shape
 * and index ops with their own DTensor form register a handler.  Nothing under
 * ops/ or core/ names the dispatcher, an op def or an eng_dt_* function.
 * ENG_DT_ACTIVE is false in local mode, while the dispatcher runs an op on the
 * local shards.  A build without the DTensor layer would leave the table empty:
 * every guarded call then fails with "<op>: DTensor arguments need the DTensor
 * layer". */
#ifndef ENG_CORE_DISPATCH_H
#define ENG_CORE_DISPATCH_H
#include "core/internal.h"

/* A DTensor layout (eng/dtensor.h): core and the ops only pass it through. */
typedef struct eng_dist_spec eng_dist_spec;

#define ENG_OP_MAX_IN 8
#define ENG_OP_MAX_OUT 4

/* One op call as the dispatcher sees it.  ints/scalars are op-specific (see
 * the op ids below); dims are 0-based and normalized before the call is
 * built. */
typedef struct eng_op_call {
  const char* name;               /* for messages; NULL: the op def's name */
  int n_in;                       /* tensor inputs (NULL entries allowed: optional ones) */
  eng_tensor* in[ENG_OP_MAX_IN];
  int64_t ints[8];
  double scalars[4];
  int needs_grad;                 /* set by the dispatcher */
  /* Variable-length arguments of shape ops (a shape, a dim list, split sizes): n_list entries. */
  const int64_t* list;
  int n_list;
  /* Ops over a list of tensors (cat, stack): n_tensors entries. */
  eng_tensor** tensors;
  int n_tensors;
} eng_op_call;

/* The ops that reach the dispatcher.  First the ops with a sharding rule (an
 * op def; the comment gives the call encoding), then the ones with their own
 * DTensor form. */
typedef enum eng_op_id {
  ENG_OP_UNARY,          /* ints[0] = ENG_UN_*, ints[1] op flag, scalars = params */
  ENG_OP_CAST,           /* ints[0] = dtype */
  ENG_OP_CLONE,          /* ints[0]: 0 clone, 1 contiguous */
  ENG_OP_SCALAR,         /* ints[0] = ENG_SC_*, scalars[0] = s */
  ENG_OP_BINARY,         /* ints[0] = ENG_BIN_* */
  ENG_OP_COMPARE,        /* ints[0] = cmp */
  ENG_OP_COMPARE_SCALAR, /* ints[0] = cmp, scalars[0] = s */
  ENG_OP_WHERE,
  ENG_OP_MASKED_FILL,    /* scalars[0] = value */
  ENG_OP_SUM,            /* ints[0] = dim mask, ints[1] = keepdim */
  ENG_OP_MEAN,
  ENG_OP_MAX_DIM,        /* ints[0] = dim, ints[1] = keepdim, ints[2] = 1 max / 0 min; values and indices */
  ENG_OP_MAX_DIM_VALUES, /* the same, values only */
  ENG_OP_EXTREME_ALL,    /* ints[0] = 1 max / 0 min */
  ENG_OP_ARGEXT,         /* ints[0] = dim, ints[1] = keepdim, ints[2] = 1 argmax / 0 argmin */
  ENG_OP_ARGMAX_ALL,
  ENG_OP_MATMUL,
  ENG_OP_LINEAR,
  ENG_OP_LINEAR_GELU,     /* ints[0] = approximate (0 erf, 1 tanh) */
  ENG_OP_EMBEDDING,      /* ints[0] = padding_idx (-1 none) */
  ENG_OP_CROSS_ENTROPY,  /* ints[0] = ignore_index, ints[1] = reduction, scalars[0] = label_smoothing */
  ENG_OP_NLL_LOSS,       /* (logp, target, weight) as cross_entropy; ints[2] = 1: cross_entropy with weights */
  ENG_OP_PLOSS,          /* elementwise losses (x, y, weight, pos_weight): ints[0] = kind, ints[1] = reduction */
  ENG_OP_PLOSS_CHECKED,  /* binary_cross_entropy (checks its targets on every rank) */
  ENG_OP_SOFTMAX,        /* ints[0] = dim, ints[1] = log */
  ENG_OP_NORM,           /* (x, w, b) ints[0] = n_norm, ints[1] = rms, scalars[0] = eps */
  ENG_OP_DROPOUT,        /* scalars[0] = p */
  ENG_OP_SDPA,           /* (q, k, v, mask) ints[0] = is_causal, scalars[0] = dropout_p, scalars[1] = scale */
  ENG_OP_ROTARY_EMB,     /* (x [B, T, H, D], cos, sin [T, D / 2]) */
  ENG_OP_SILU_MUL,       /* (a, b) of one shape: silu(a) * b */
  ENG_OP_MATH_UNARY,     /* ints[0] = op (ops/ops.h), scalars = params */
  ENG_OP_MATH_BINARY,    /* ints[0] = op */
  ENG_OP_MATH_BINARY_INT,
  ENG_OP_REDUCE2,        /* ints[0] = ENG_R2_*, ints[1] = dim mask, ints[2] = keepdim, scalars[0] = p */
  ENG_OP_ALONG,          /* ints[0] = ENG_AL_*, ints[1] = dim, ints[2] = k, ints[3] = flag; one output */
  ENG_OP_ALONG2,         /* the same, values and indices */
  /* ---- ops with their own DTensor form (sharding/shape.c, sharding/index.c, dtensor/random.c) */
  ENG_OP_VIEW,           /* list = shape; ints[0] = 0 view, 1 reshape */
  ENG_OP_SQUEEZE,        /* ints[0] = dim, ints[1] = 1: every size-1 dim */
  ENG_OP_UNSQUEEZE,      /* ints[0] = dim */
  ENG_OP_FLATTEN,        /* ints[0] = start dim, ints[1] = end dim */
  ENG_OP_TRANSPOSE,      /* ints[0], ints[1] = dims */
  ENG_OP_PERMUTE,        /* list = dims */
  ENG_OP_EXPAND,         /* list = shape */
  ENG_OP_NARROW,         /* ints[0] = dim, ints[1] = start, ints[2] = length */
  ENG_OP_SELECT,         /* ints[0] = dim, ints[1] = index */
  ENG_OP_INDEX_SELECT,   /* in = {t, index}, ints[0] = dim */
  ENG_OP_JOIN,           /* tensors, ints[0] = dim, ints[1] = 1 stack / 0 cat */
  ENG_OP_SPLIT,          /* multi: ints[0] = mode (0 split_size, 1 sizes in list, 2 chunks), ints[1] = split
                          * size or chunks, ints[2] = dim, ints[3] = the most outputs to write */
  ENG_OP_GATHER,         /* in = {x, index}, ints[0] = dim */
  ENG_OP_SCATTER,        /* in = {x, index, src}, ints[0] = dim, ints[1] = reduce */
  ENG_OP_INDEX_PUT,      /* in = {x, index, src}, ints[0] = dim, ints[1] = accumulate, scalars[0] = alpha */
  ENG_OP_RANDOM_FILL,    /* in place: in = {t}, ints[0] = kind (0 uniform, 1 normal, 2 bernoulli), scalars a, b */
  ENG_OP_COUNT
} eng_op_id;

/* op codes carried in ints[0] */
enum { ENG_SC_ADD, ENG_SC_SUB, ENG_SC_MUL, ENG_SC_DIV, ENG_SC_POW, ENG_SC_RSUB, ENG_SC_RDIV, ENG_SC_RPOW };
enum { ENG_BIN_ADD, ENG_BIN_SUB, ENG_BIN_MUL, ENG_BIN_DIV, ENG_BIN_POW, ENG_BIN_MAX, ENG_BIN_MIN };
enum { ENG_UN_NEG, ENG_UN_EXP, ENG_UN_LOG, ENG_UN_SQRT, ENG_UN_RSQRT, ENG_UN_ABS, ENG_UN_TANH, ENG_UN_SIGMOID,
       ENG_UN_RELU, ENG_UN_SILU, ENG_UN_GELU, ENG_UN_CLAMP, ENG_UN_LEAKY_RELU, ENG_UN_ELU, ENG_UN_HARDTANH,
       ENG_UN_SOFTPLUS };
enum { ENG_R2_PROD, ENG_R2_AMAX, ENG_R2_AMIN, ENG_R2_LSE, ENG_R2_VAR, ENG_R2_STD, ENG_R2_NORM, ENG_R2_ALL, ENG_R2_ANY };
enum { ENG_AL_CUMSUM, ENG_AL_CUMPROD, ENG_AL_ARGSORT, ENG_AL_SORT, ENG_AL_TOPK, ENG_AL_KTH };

/* What the DTensor layer installs.  Every member is set together. */
typedef struct eng_dispatcher {
  /* An op with a DTensor (or meta) operand: one output (new reference) or NULL. */
  eng_tensor* (*call)(eng_op_id op, eng_op_call* c);
  /* Several outputs: new references into outs; the number written, or -1. */
  int (*call_multi)(eng_op_id op, eng_op_call* c, eng_tensor** outs);
  /* In-place ops (c->in[0] op= the others): the others are redistributed to
   * in[0]'s layout, then fn runs on the locals in local mode.  mode: 0 in[0]
   * may not be Partial; 1 linear (Partial allowed when every DTensor operand
   * has in[0]'s exact layout); 2 scaling (Partial(sum/avg), no tensor
   * operands).  0 or -1. */
  int (*call_inplace)(const char* name, int mode, eng_op_call* c, int (*fn)(eng_op_call* c));
  /* A tensor's DTensor layout (t->dist): lifetime and description. */
  eng_dist_spec* (*spec_retain)(eng_dist_spec* s);
  void (*spec_release)(eng_dist_spec* s);
  const char* (*spec_describe)(const eng_dist_spec* s, int dtype, char* buf, int cap);
  int (*spec_equal)(const eng_dist_spec* a, const eng_dist_spec* b);
  /* Finishes a pending asynchronous DTensor result that t holds (redistribute(..., {async_op = true})). */
  int (*wait)(eng_tensor* t);
  /* The norm of DTensor shards (ops/optim.c's global norms): n groups, each with a layout (a tensor's spec:
   * the group's mesh and the mask of its mesh dims that shard) and the local accumulator acc[g] of the
   * group's tensors (a sum of |x|^p for kind ENG_NORM_SUM, a max or min); combines each mesh's groups,
   * counting a group replicated where another shards from coordinate 0 only, agrees on err (a local error
   * on some rank fails every rank, before any all_reduce), then reduces over every sharded mesh dim (one
   * all_reduce per mesh dim, PyTorch's count).  *out: the combination over all groups.  0 or -1. */
  int (*norm_reduce)(const char* op, int n, const eng_dist_spec* const* layouts, const uint32_t* masks,
                     const double* acc, int kind, int err, double* out);
} eng_dispatcher;

enum { ENG_NORM_SUM, ENG_NORM_MAX, ENG_NORM_MIN };

/* Installs d (copied); NULL uninstalls. */
void eng_dispatcher_install(const eng_dispatcher* d);

/* Local mode (per thread): on while the dispatcher runs an op on local
 * shards; guards then let DTensor operands pass as their locals. */
int eng_dispatch_local_mode(void);
int eng_dispatch_set_local_mode(int on); /* returns the previous mode */

/* ---- what ops and core call */
#define ENG_DT_ACTIVE(cond) (__builtin_expect(!!(cond), 0) && !eng_dispatch_local_mode())
/* The guards send an op to the dispatcher when an operand is meta too. */
#define ENG_META_T(t) ((t) && (t)->device == ENG_META)
eng_tensor* eng_op_dispatch(eng_op_id op, eng_op_call* c);
int eng_op_dispatch_multi(eng_op_id op, eng_op_call* c, eng_tensor** outs);
int eng_op_dispatch_inplace(const char* name, int mode, eng_op_call* c, int (*fn)(eng_op_call* c));
/* t->dist's lifetime and "f32[8,4] on mesh(4) [Shard(1)]" (plain "?" without a DTensor layer). */
eng_dist_spec* eng_spec_retain(eng_dist_spec* s);
void eng_spec_release(eng_dist_spec* s);
const char* eng_spec_describe(const eng_dist_spec* s, int dtype, char* buf, int cap);
/* "DTensor(<spec>, local f32[4,2])", or eng_desc(t) for a plain tensor, into buf. */
const char* eng_dist_desc(const eng_tensor* t, char* buf, int cap);
int eng_spec_equal(const eng_dist_spec* a, const eng_dist_spec* b); /* 1 when both NULL or equal */
int eng_dist_wait(eng_tensor* t);                                    /* 0 or -1 */
int eng_dist_norm_reduce(const char* op, int n, const eng_dist_spec* const* layouts, const uint32_t* masks,
                         const double* acc, int kind, int err, double* out);

/* Dim list -> bit mask (n_dims 0: all dims); -1 on a bad dim. */
int64_t eng_dims_mask(int ndim, int n_dims, const int* dims, const char* op);

#endif
