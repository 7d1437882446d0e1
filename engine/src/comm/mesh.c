/* mesh.c: DeviceMesh: an N-d array of world ranks, optional dim names, one
 * process group per mesh dim (this rank's row), slicing and flattening. */
#include "comm/comm_impl.h"
#include "eng/comm.h"
#include "eng/cuda.h"
#include "eng/dist.h"
#include "eng/mesh.h"
#include <stdio.h>
#include <unistd.h>

#define NAME_MAX_LEN 63

struct eng_mesh {
  int32_t refcount;
  int32_t device, ndim, numel;
  int64_t shape[ENG_MAX_DIMS];
  int* ranks;                      /* numel world ranks, row-major */
  int has_names;
  char names[ENG_MAX_DIMS][NAME_MAX_LEN + 1];
  int member;
  int coord[ENG_MAX_DIMS];         /* this rank's coordinate (members) */
  eng_pg* groups[ENG_MAX_DIMS];    /* this rank's row along each dim (owned) */
};

static eng_mesh* mesh_alloc(int device, int ndim, const int64_t* shape, int numel) {
  eng_mesh* m = calloc(1, sizeof *m);
  if (!m) return eng_errp("DeviceMesh: out of memory");
  m->ranks = malloc(sizeof(int) * (size_t)(numel > 0 ? numel : 1));
  if (!m->ranks) { free(m); return eng_errp("DeviceMesh: out of memory"); }
  m->refcount = 1;
  m->device = device;
  m->ndim = ndim;
  m->numel = numel;
  for (int d = 0; d < ndim; d++) m->shape[d] = shape[d];
  return m;
}

eng_mesh* eng_mesh_retain(eng_mesh* m) {
  if (m) __atomic_add_fetch(&m->refcount, 1, __ATOMIC_RELAXED);
  return m;
}

void eng_mesh_release(eng_mesh* m) {
  if (!m) return;
  if (__atomic_sub_fetch(&m->refcount, 1, __ATOMIC_ACQ_REL) != 0) return;
  for (int d = 0; d < m->ndim; d++) eng_pg_release(m->groups[d]);
  free(m->ranks);
  free(m);
}

static const char* dev_name(int device) { return device == ENG_CUDA ? "cuda" : "cpu"; }

/* ('dp', 'tp') */
static int names_str(const eng_mesh* m, char* b, int cap) {
  int k = snprintf(b, cap, "(");
  for (int d = 0; d < m->ndim && k < cap; d++)
    k += snprintf(b + k, cap - k, "%s'%s'", d ? ", " : "", m->names[d]);
  if (k < cap) k += snprintf(b + k, cap - k, m->ndim == 1 ? ",)" : ")");
  return k;
}

static void unravel(const eng_mesh* m, int idx, int* coord) {
  for (int d = m->ndim - 1; d >= 0; d--) { coord[d] = idx % (int)m->shape[d]; idx /= (int)m->shape[d]; }
}

static void find_me(eng_mesh* m) {
  int me = eng_dist_rank();
  m->member = 0;
  for (int i = 0; i < m->numel; i++)
    if (m->ranks[i] == me) { m->member = 1; unravel(m, i, m->coord); return; }
  for (int d = 0; d < m->ndim; d++) m->coord[d] = -1;
}

/* The group of this rank's row along dim d: one split of the world. */
static eng_pg* make_dim_group(const eng_mesh* m, int d) {
  int color = MPI_UNDEFINED, key = 0;
  if (m->member) {
    color = 0;
    for (int e = 0; e < m->ndim; e++) if (e != d) color = color * (int)m->shape[e] + m->coord[e];
    key = m->coord[d];
  }
  MPI_Comm c;
  int rc = MPI_Comm_split(MPI_COMM_WORLD, color, key, &c);
  if (rc != MPI_SUCCESS) return eng_errp("DeviceMesh: MPI_Comm_split for mesh dim %d failed: %s", d, comm_mpi_errstr(rc));
  eng_pg* pg = comm_pg_from_mpi(c, NULL);
  if (!pg) return NULL;
  char label[NAME_MAX_LEN + 16];
  if (m->has_names) snprintf(label, sizeof label, "%s", m->names[d]);
  else snprintf(label, sizeof label, "dim%d", d);
  char tmp[sizeof pg->name];
  snprintf(tmp, sizeof tmp, "%s", pg->name);
  if (pg->member) snprintf(pg->name, sizeof pg->name, "%s:%s", label, tmp);
  else snprintf(pg->name, sizeof pg->name, "%s (not a member)", label);
  return pg;
}

/* Local checks and the rank array; no communication. */
static eng_mesh* build_local(const char* op, int device, int ndim, const int64_t* shape, const int* ranks,
                             const char* const* names) {
  if (device != ENG_CPU && device != ENG_CUDA) return eng_errp("%s: invalid device code %d", op, device);
  if (device == ENG_CUDA && eng_comm_cuda_device_count() <= 0)
    return eng_errp("%s: device 'cuda' requested but no CUDA GPU is usable on this machine%s; use \"cpu\"", op,
                    eng_comm_have_nccl() ? "" : " (and this build has no CUDA/NCCL backend)");
  if (ndim < 1 || ndim > ENG_MAX_DIMS)
    return eng_errp("%s: a mesh has 1 to %d dims, got %d", op, ENG_MAX_DIMS, ndim);
  if (!shape) return eng_errp("%s: mesh shape is NULL", op);
  int64_t numel = 1;
  for (int d = 0; d < ndim; d++) {
    if (shape[d] < 1)
      return eng_errp("%s: mesh shape %s has a size below 1 in dim %d", op, eng_shape_str(ndim, shape), d);
    numel *= shape[d];
    if (numel > (1 << 24)) return eng_errp("%s: mesh shape %s is too large", op, eng_shape_str(ndim, shape));
  }
  int world = eng_dist_world_size();
  if (!ranks && numel != world)
    return eng_errp("%s: mesh shape %s holds %lld ranks but the world size is %d (the product of the mesh shape "
                    "must equal the world size, or pass an explicit rank list)", op, eng_shape_str(ndim, shape),
                    (long long)numel, world);
  if (names) {
    for (int d = 0; d < ndim; d++) {
      if (!names[d] || !names[d][0]) return eng_errp("%s: mesh_dim_names[%d] is empty", op, d);
      if (strlen(names[d]) > NAME_MAX_LEN)
        return eng_errp("%s: mesh_dim_name '%.20s...' is longer than %d characters", op, names[d], NAME_MAX_LEN);
      for (int e = 0; e < d; e++)
        if (!strcmp(names[d], names[e]))
          return eng_errp("%s: Each mesh_dim_name must be unique. Found repeated mesh_dim_name '%s'", op, names[d]);
    }
  }
  eng_mesh* m = mesh_alloc(device, ndim, shape, (int)numel);
  if (!m) return NULL;
  if (ranks) {
    char* seen = calloc((size_t)world, 1);
    if (!seen) { eng_mesh_release(m); return eng_errp("%s: out of memory", op); }
    for (int i = 0; i < numel; i++) {
      if (ranks[i] < 0 || ranks[i] >= world) {
        free(seen); eng_mesh_release(m);
        return eng_errp("%s: rank %d in the mesh is out of range for world size %d (ranks are 0-based)", op,
                        ranks[i], world);
      }
      if (seen[ranks[i]]) {
        free(seen); eng_mesh_release(m);
        return eng_errp("%s: rank %d appears twice in the mesh", op, ranks[i]);
      }
      seen[ranks[i]] = 1;
      m->ranks[i] = ranks[i];
    }
    free(seen);
  } else {
    for (int i = 0; i < numel; i++) m->ranks[i] = i;
  }
  if (names) {
    m->has_names = 1;
    for (int d = 0; d < ndim; d++) snprintf(m->names[d], sizeof m->names[d], "%s", names[d]);
  }
  return m;
}

/* A CUDA mesh: NCCL refuses two ranks of one communicator on one GPU (its "invalid usage" at the first collective,
 * on some ranks only when the others wait elsewhere).  Every rank publishes its host (hostname, and NCCL_HOSTID,
 * which makes NCCL treat ranks as different hosts) and its GPU's bus id in one all_gather over the world; two mesh
 * ranks with the same host and GPU fail mesh creation on every rank with a message naming them and the fix. */
typedef struct gpu_id { int32_t err, dev; char host[72]; char hostid[64]; char bus[32]; } gpu_id;

static int gpu_check(const eng_mesh* m, const char* op) {
  int world = eng_dist_world_size();
  if (world < 2) return 0;
  gpu_id mine;
  memset(&mine, 0, sizeof mine);
  mine.dev = eng_cuda_current_device();
  if (mine.dev < 0 || eng_cuda_device_bus_id(mine.dev, mine.bus, sizeof mine.bus)) mine.err = 1;
  gethostname(mine.host, sizeof mine.host - 1);
  const char* hid = getenv("NCCL_HOSTID");
  if (hid) snprintf(mine.hostid, sizeof mine.hostid, "%s", hid);
  char why[512] = "";
  if (mine.err) snprintf(why, sizeof why, "%s", eng_last_error());
  gpu_id* all = calloc((size_t)world, sizeof *all);
  if (!all) return eng_err("%s: out of memory", op);
  int rc = MPI_Allgather(&mine, (int)sizeof mine, MPI_BYTE, all, (int)sizeof mine, MPI_BYTE, MPI_COMM_WORLD);
  if (rc != MPI_SUCCESS) { free(all); return eng_err("%s: %s", op, comm_mpi_errstr(rc)); }
  int bad = 0;
  for (int i = 0; i < world && !bad; i++)
    if (all[i].err) {
      bad = 1;
      if (mine.err) eng_err("%s: device 'cuda': %s", op, why);
      else eng_err("%s: device 'cuda': rank %d cannot use its GPU (see its error)", op, i);
    }
  for (int a = 0; a < m->numel && !bad; a++)
    for (int b = a + 1; b < m->numel && !bad; b++) {
      const gpu_id *x = &all[m->ranks[a]], *y = &all[m->ranks[b]];
      if (strcmp(x->host, y->host) || strcmp(x->hostid, y->hostid) || strcmp(x->bus, y->bus)) continue;
      bad = 1;
      eng_err("%s: ranks %d and %d of the mesh both use GPU %d (bus %s) of host %s: NCCL cannot run two ranks of one "
              "communicator on one GPU. Launch one rank per GPU (mpirun -np <GPUs per node> x nodes), or for tests give "
              "each rank its own NCCL_HOSTID with NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1 (docs/cuda.md, \"Several ranks "
              "on one GPU\")", op, m->ranks[a], m->ranks[b], x->dev, x->bus, x->host);
    }
  free(all);
  return bad ? -1 : 0;
}

eng_mesh* eng_mesh_new(int device, int ndim, const int64_t* shape, const int* ranks, const char* const* names) {
  const char* op = "init_device_mesh";
  if (comm_ensure_init(op)) return NULL;
  eng_mesh* m = build_local(op, device, ndim, shape, ranks, names);
  if (!m) {
    /* still take part in the agreement, so ranks with valid arguments fail too instead of hanging */
    char saved[2048];
    snprintf(saved, sizeof saved, "%s", eng_last_error());
    static const char tag[] = "invalid mesh arguments";
    comm_world_agree(tag, sizeof tag, op, "arguments");
    eng_set_error_message(saved);
    return NULL;
  }
  int64_t numel = m->numel;
  /* every rank must describe the same mesh */
  size_t blob_n = sizeof(int) * 2 + sizeof(int64_t) * (size_t)ndim + sizeof(int) * (size_t)numel +
                  sizeof m->names + sizeof(int);
  char* blob = calloc(1, blob_n);
  if (!blob) { eng_mesh_release(m); return eng_errp("%s: out of memory", op); }
  char* p = blob;
  memcpy(p, &device, sizeof(int)); p += sizeof(int);
  memcpy(p, &ndim, sizeof(int)); p += sizeof(int);
  memcpy(p, shape, sizeof(int64_t) * (size_t)ndim); p += sizeof(int64_t) * (size_t)ndim;
  memcpy(p, m->ranks, sizeof(int) * (size_t)numel); p += sizeof(int) * (size_t)numel;
  memcpy(p, m->names, sizeof m->names); p += sizeof m->names;
  memcpy(p, &m->has_names, sizeof(int));
  int rc = comm_world_agree(blob, blob_n, op, "mesh shapes, rank lists or dim names");
  free(blob);
  if (rc) { eng_mesh_release(m); return NULL; }
  if (device == ENG_CUDA && gpu_check(m, op)) { eng_mesh_release(m); return NULL; }
  find_me(m);
  for (int d = 0; d < ndim; d++) {
    m->groups[d] = make_dim_group(m, d);
    if (!m->groups[d]) { eng_mesh_release(m); return NULL; }
  }
  return m;
}

int eng_mesh_device(const eng_mesh* m) { return m ? m->device : -1; }
int eng_mesh_ndim(const eng_mesh* m) { return m ? m->ndim : -1; }

int eng_mesh_size(const eng_mesh* m, int dim) {
  if (!m) return eng_err("DeviceMesh.size: mesh is NULL");
  if (dim == -1) return m->numel;
  if (dim < 0 || dim >= m->ndim)
    return eng_err("DeviceMesh.size: mesh dim %d out of range for a %d-d mesh", dim, m->ndim);
  return (int)m->shape[dim];
}

int eng_mesh_ranks(const eng_mesh* m, int* out, int cap) {
  if (!m) return eng_err("DeviceMesh.ranks: mesh is NULL");
  for (int i = 0; i < m->numel && i < cap; i++) out[i] = m->ranks[i];
  return m->numel;
}

int eng_mesh_has_names(const eng_mesh* m) { return m && m->has_names; }

const char* eng_mesh_dim_name(const eng_mesh* m, int dim) {
  if (!m || !m->has_names || dim < 0 || dim >= m->ndim) return NULL;
  return m->names[dim];
}

int eng_mesh_dim_index(const eng_mesh* m, const char* name) {
  if (!m) return eng_err("DeviceMesh: mesh is NULL");
  if (!m->has_names) return eng_err("DeviceMesh: No `mesh_dim_names` found.");
  if (name)
    for (int d = 0; d < m->ndim; d++) if (!strcmp(m->names[d], name)) return d;
  char ns[600];
  names_str(m, ns, sizeof ns);
  return eng_err("DeviceMesh: Invalid mesh_dim_name '%s' specified. Valid mesh_dim_names are %s", name ? name : "nil", ns);
}

int eng_mesh_get_coordinate(const eng_mesh* m, int* out) {
  if (!m || !m->member) return 0;
  for (int d = 0; d < m->ndim; d++) out[d] = m->coord[d];
  return 1;
}

static int check_dim(const eng_mesh* m, int dim, const char* op) {
  if (!m) return eng_err("%s: mesh is NULL", op);
  if (dim < 0 || dim >= m->ndim) return eng_err("%s: mesh dim %d out of range for a %d-d mesh", op, dim, m->ndim);
  return 0;
}

int eng_mesh_get_local_rank(const eng_mesh* m, int dim) {
  if (check_dim(m, dim, "DeviceMesh.get_local_rank")) return -1;
  if (!m->member) return eng_err("DeviceMesh.get_local_rank: rank %d is not part of the mesh", eng_dist_rank());
  return m->coord[dim];
}

eng_pg* eng_mesh_get_group(const eng_mesh* m, int dim) {
  if (check_dim(m, dim, "DeviceMesh.get_group")) return NULL;
  return eng_pg_retain(m->groups[dim]);
}

eng_mesh* eng_mesh_slice(const eng_mesh* m, int n, const int* dims) {
  if (!m) return eng_errp("DeviceMesh slice: mesh is NULL");
  if (n < 1 || n > m->ndim || !dims)
    return eng_errp("DeviceMesh slice: %d dims requested from a %d-d mesh", n, m->ndim);
  for (int i = 0; i < n; i++) {
    if (dims[i] < 0 || dims[i] >= m->ndim)
      return eng_errp("DeviceMesh slice: mesh dim %d out of range for a %d-d mesh", dims[i], m->ndim);
    if (i && dims[i] <= dims[i - 1])
      return eng_errp("DeviceMesh slice: the dims must be in increasing order (a subsequence of the mesh dims)");
  }
  int64_t shape[ENG_MAX_DIMS];
  int numel = 1;
  for (int i = 0; i < n; i++) { shape[i] = m->shape[dims[i]]; numel *= (int)shape[i]; }
  eng_mesh* s = mesh_alloc(m->device, n, shape, numel);
  if (!s) return NULL;
  int base[ENG_MAX_DIMS], full[ENG_MAX_DIMS], sub[ENG_MAX_DIMS];
  for (int d = 0; d < m->ndim; d++) base[d] = m->member ? m->coord[d] : 0;
  for (int i = 0; i < numel; i++) {
    int idx = i;
    for (int j = n - 1; j >= 0; j--) { sub[j] = idx % (int)shape[j]; idx /= (int)shape[j]; }
    for (int d = 0; d < m->ndim; d++) full[d] = base[d];
    for (int j = 0; j < n; j++) full[dims[j]] = sub[j];
    int lin = 0;
    for (int d = 0; d < m->ndim; d++) lin = lin * (int)m->shape[d] + full[d];
    s->ranks[i] = m->ranks[lin];
  }
  s->has_names = m->has_names;
  for (int j = 0; j < n; j++) {
    if (m->has_names) memcpy(s->names[j], m->names[dims[j]], sizeof s->names[j]);
    s->groups[j] = eng_pg_retain(m->groups[dims[j]]);
  }
  s->member = m->member;
  for (int j = 0; j < n; j++) s->coord[j] = m->member ? m->coord[dims[j]] : -1;
  return s;
}

eng_mesh* eng_mesh_slice_names(const eng_mesh* m, int n, const char* const* names) {
  if (!m) return eng_errp("DeviceMesh slice: mesh is NULL");
  if (!m->has_names) return eng_errp("DeviceMesh slice: No `mesh_dim_names` found.");
  if (n < 1 || !names) return eng_errp("DeviceMesh slice: no mesh_dim_names given");
  if (n > ENG_MAX_DIMS) return eng_errp("DeviceMesh slice: %d names given; a mesh has at most %d dims", n, ENG_MAX_DIMS);
  int dims[ENG_MAX_DIMS];
  char ns[600];
  names_str(m, ns, sizeof ns);
  for (int i = 0; i < n; i++) {
    dims[i] = -1;
    for (int d = 0; d < m->ndim; d++) if (names[i] && !strcmp(names[i], m->names[d])) dims[i] = d;
    if (dims[i] < 0)
      return eng_errp("DeviceMesh slice: Invalid mesh_dim_name '%s' specified. Valid mesh_dim_names are %s",
                      names[i] ? names[i] : "nil", ns);
  }
  for (int i = 1; i < n; i++)
    if (dims[i] <= dims[i - 1]) {
      char req[600];
      int k = snprintf(req, sizeof req, "(");
      for (int j = 0; j < n && k < (int)sizeof req; j++) k += snprintf(req + k, sizeof req - k, "%s'%s'", j ? ", " : "", names[j]);
      if (k < (int)sizeof req) snprintf(req + k, sizeof req - k, ")");
      return eng_errp("DeviceMesh slice: Invalid mesh_dim_names %s specified. Valid mesh_dim_names should be a "
                      "subsequence of %s", req, ns);
    }
  return eng_mesh_slice(m, n, dims);
}

/* A flatten call with bad arguments still takes part in the split (as a
 * non-member), so the ranks with good arguments do not hang. */
static eng_mesh* flatten_fail(void) {
  char saved[2048];
  snprintf(saved, sizeof saved, "%s", eng_last_error());
  MPI_Comm c = MPI_COMM_NULL;
  if (MPI_Comm_split(MPI_COMM_WORLD, MPI_UNDEFINED, 0, &c) == MPI_SUCCESS && c != MPI_COMM_NULL) MPI_Comm_free(&c);
  eng_set_error_message(saved);
  return NULL;
}

eng_mesh* eng_mesh_flatten(const eng_mesh* m, const char* name) {
  if (comm_ensure_init("DeviceMesh flatten")) return NULL;
  if (!m) { eng_err("DeviceMesh flatten: mesh is NULL"); return flatten_fail(); }
  char label[NAME_MAX_LEN + 1] = {0};
  if (name) {
    if (!name[0] || strlen(name) > NAME_MAX_LEN) {
      eng_err("DeviceMesh flatten: the name must have 1 to %d characters", NAME_MAX_LEN);
      return flatten_fail();
    }
    snprintf(label, sizeof label, "%s", name);
  } else if (m->has_names) {
    int k = 0;
    for (int d = 0; d < m->ndim && k < NAME_MAX_LEN; d++)
      k += snprintf(label + k, sizeof label - k, "%s%s", d ? "_" : "", m->names[d]);
  }
  int64_t shape = m->numel;
  eng_mesh* f = mesh_alloc(m->device, 1, &shape, m->numel);
  if (!f) return flatten_fail();
  memcpy(f->ranks, m->ranks, sizeof(int) * (size_t)m->numel);
  if (label[0]) { f->has_names = 1; snprintf(f->names[0], sizeof f->names[0], "%s", label); }
  find_me(f);
  int color = MPI_UNDEFINED, key = 0;
  if (f->member) {
    color = f->ranks[0];
    for (int i = 1; i < f->numel; i++) if (f->ranks[i] < color) color = f->ranks[i];
    key = f->coord[0];
  }
  MPI_Comm c;
  int rc = MPI_Comm_split(MPI_COMM_WORLD, color, key, &c);
  if (rc != MPI_SUCCESS) { eng_mesh_release(f); return eng_errp("DeviceMesh flatten: MPI_Comm_split failed: %s", comm_mpi_errstr(rc)); }
  f->groups[0] = comm_pg_from_mpi(c, NULL);
  if (!f->groups[0]) { eng_mesh_release(f); return NULL; }
  eng_pg* pg = f->groups[0];
  char tmp[sizeof pg->name];
  snprintf(tmp, sizeof tmp, "%s", pg->name);
  if (pg->member) snprintf(pg->name, sizeof pg->name, "%s:%s", label[0] ? label : "flat", tmp);
  return f;
}

int eng_mesh_equal(const eng_mesh* a, const eng_mesh* b) {
  if (a == b) return 1;
  if (!a || !b || a->device != b->device || a->ndim != b->ndim || a->numel != b->numel || a->has_names != b->has_names)
    return 0;
  for (int d = 0; d < a->ndim; d++) {
    if (a->shape[d] != b->shape[d]) return 0;
    if (a->has_names && strcmp(a->names[d], b->names[d])) return 0;
  }
  for (int i = 0; i < a->numel; i++) if (a->ranks[i] != b->ranks[i]) return 0;
  return 1;
}

/* Nested rank list of dims d.. starting at flat index *pos. */
static int put_ranks(const eng_mesh* m, int d, int* pos, char* b, int cap) {
  int k = snprintf(b, cap, "[");
  for (int i = 0; i < m->shape[d] && k < cap; i++) {
    if (i) k += snprintf(b + k, cap - k, ", ");
    if (k >= cap) break;
    if (d == m->ndim - 1) k += snprintf(b + k, cap - k, "%d", m->ranks[(*pos)++]);
    else k += put_ranks(m, d + 1, pos, b + k, cap - k);
  }
  if (k < cap) k += snprintf(b + k, cap - k, "]");
  return k < cap ? k : cap;
}

const char* eng_mesh_describe(const eng_mesh* m, char* buf, int buflen) {
  if (!buf || buflen <= 0) return buf;
  if (!m) { snprintf(buf, buflen, "DeviceMesh(nil)"); return buf; }
  int k = snprintf(buf, buflen, "DeviceMesh('%s', ", dev_name(m->device));
  int pos = 0;
  if (k < buflen) k += put_ranks(m, 0, &pos, buf + k, buflen - k);
  if (k < buflen && m->has_names) {
    k += snprintf(buf + k, buflen - k, ", mesh_dim_names=");
    if (k < buflen) k += names_str(m, buf + k, buflen - k);
  }
  if (k < buflen) snprintf(buf + k, buflen - k, ")");
  return buf;
}
