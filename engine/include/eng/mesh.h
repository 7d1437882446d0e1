/* mesh.h: DeviceMesh, an N-d array of world ranks with optional dim names.
 *
 * Creating a mesh is collective over the whole world (every rank calls it,
 * also ranks outside the mesh): it creates one process group per mesh dim
 * (this rank's row along that dim) with one MPI_Comm_split per dim.  Ranks
 * outside the mesh get a mesh object whose coordinate is absent and whose
 * groups are non-member groups (collectives on them are skipped).
 * Slicing reuses the parent's groups and communicates nothing.
 * Mesh dims are 0-based here; coordinates and local ranks are 0-based. */
#ifndef ENG_MESH_H
#define ENG_MESH_H
#include <stdint.h>
#include <stddef.h>
#include "comm.h"

typedef struct eng_mesh eng_mesh;

/* device: ENG_CPU or ENG_CUDA (an error when no GPU is usable).
 * ranks: numel(shape) distinct world ranks in row-major order, or NULL for
 * 0..world-1 (then numel(shape) must equal the world size).
 * names: NULL, or ndim distinct non-empty names. */
eng_mesh* eng_mesh_new(int device, int ndim, const int64_t* shape, const int* ranks,
                       const char* const* names);
/* (Every rank must call eng_mesh_new and eng_mesh_flatten, also one whose
 * arguments are invalid: such a call still takes part in the world-wide
 * agreement and fails, and the ranks with valid arguments then fail too,
 * instead of hanging.) */
eng_mesh* eng_mesh_retain(eng_mesh* m);
void eng_mesh_release(eng_mesh* m);

int eng_mesh_device(const eng_mesh* m);
int eng_mesh_ndim(const eng_mesh* m);
/* Size of mesh dim `dim`; dim -1 gives the number of ranks in the mesh. */
int eng_mesh_size(const eng_mesh* m, int dim);
/* Copies the ranks (row-major, eng_mesh_size(m, -1) entries). */
int eng_mesh_ranks(const eng_mesh* m, int* out, int cap);
/* Name of a dim (borrowed) or NULL when the mesh has no names. */
const char* eng_mesh_dim_name(const eng_mesh* m, int dim);
int eng_mesh_has_names(const eng_mesh* m);
/* Index of a named dim, or -1 with a PyTorch-like error. */
int eng_mesh_dim_index(const eng_mesh* m, const char* name);
/* 1 and the coordinate (ndim entries) when this rank is in the mesh, else 0. */
int eng_mesh_get_coordinate(const eng_mesh* m, int* out);
/* This rank's coordinate along dim; -1 with an error for non-members. */
int eng_mesh_get_local_rank(const eng_mesh* m, int dim);
/* The group of this rank's row along dim (new reference). */
eng_pg* eng_mesh_get_group(const eng_mesh* m, int dim);
/* Sub-mesh over the given dims (strictly increasing) holding this rank (for
 * non-members: the one at coordinate 0 of the dropped dims); reuses the
 * parent's groups. */
eng_mesh* eng_mesh_slice(const eng_mesh* m, int n, const int* dims);
/* Same by names (an in-order subsequence of the mesh's names). */
eng_mesh* eng_mesh_slice_names(const eng_mesh* m, int n, const char* const* names);
/* A 1-d mesh over this mesh's ranks in row-major order, with one new group
 * (collective over the world).  name NULL: the dim names joined by "_". */
eng_mesh* eng_mesh_flatten(const eng_mesh* m, const char* name);
/* Same device, shape, ranks and names. */
int eng_mesh_equal(const eng_mesh* a, const eng_mesh* b);
/* DeviceMesh('cpu', [[0, 1], [2, 3]], mesh_dim_names=('dp', 'tp')) */
const char* eng_mesh_describe(const eng_mesh* m, char* buf, int buflen);

#endif
