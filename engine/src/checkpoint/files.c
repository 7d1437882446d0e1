/* Subsystem checkpoint/: distributed checkpoints (rank data files, the
 * metadata entries, crash-safe commits).  May call: core/, io/ (checksums),
 * sharded_tensor/ (shard-box checks), kernels/cpu (the staging copy).  The Lua API (planning per tensor, the
 * collectives that agree on success, the metadata file) is
 * lua/engine/distributed/checkpoint.lua.
 *
 * files.c: the per-rank data files.  A writer queues chunks (copied into
 * staging buffers for async saves, or retained for sync ones), then writes
 * them in order after a 64-byte header, in a pthread when async, computing
 * each chunk's checksum as it goes; finish joins, fsyncs, renames the
 * temporary file to its final name and fsyncs the directory.  Errors raised
 * in the thread are kept in the writer and set on the caller's thread by
 * finish (error messages are thread-local).  A reader preads a data file
 * for a load: every needed chunk is checksummed, then copied. */
#include "core/internal.h"
#include "kernels/cpu/kcpu.h"
#include "eng/checkpoint.h"
#include "eng/io.h"
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/syscall.h>
#include <sys/stat.h>
#include <unistd.h>

#define HEADER_BYTES 64
static const char MAGIC[8] = {'E', 'N', 'G', 'D', 'C', 'P', '0', '1'};

struct eng_ckpt_writer {
  char* path;
  char* tmp;
  char id[56];
  int fd;
  int n, cap;
  eng_tensor** chunks;
  uint64_t* sums;
  int64_t end; /* file size after the queued chunks */
  int thread_live, thread_done, started, finished, failed;
  char err[512];
};

static int mkdirs(const char* dir) {
  char buf[4096];
  size_t n = strlen(dir);
  if (n == 0 || n >= sizeof buf) return 0;
  memcpy(buf, dir, n + 1);
  for (size_t i = 1; i <= n; i++) {
    if (buf[i] == '/' || buf[i] == 0) {
      char c = buf[i];
      buf[i] = 0;
      if (mkdir(buf, 0777) != 0 && errno != EEXIST) return -1;
      buf[i] = c;
    }
  }
  return 0;
}

static void dir_of(const char* path, char* out, size_t cap) {
  const char* s = strrchr(path, '/');
  if (!s) { snprintf(out, cap, "."); return; }
  size_t n = (size_t)(s - path);
  if (n == 0) n = 1;
  if (n >= cap) n = cap - 1;
  memcpy(out, path, n);
  out[n] = 0;
}

static int fsync_dir(const char* path) {
  char dir[4096];
  dir_of(path, dir, sizeof dir);
  int fd = open(dir, O_RDONLY);
  if (fd < 0) return -1;
  int rc = fsync(fd);
  close(fd);
  return rc;
}

eng_ckpt_writer* eng_ckpt_writer_open(const char* path, const char* id) {
  const char* op = "checkpoint.save";
  if (!path || !id) return eng_errp("%s: path and id are required", op);
  if (strlen(id) > 55) return eng_errp("%s: checkpoint id '%s' is longer than 55 bytes", op, id);
  char dir[4096];
  dir_of(path, dir, sizeof dir);
  if (mkdirs(dir) != 0) return eng_errp("%s: cannot create directory '%s': %s", op, dir, strerror(errno));
  eng_ckpt_writer* w = calloc(1, sizeof *w);
  if (!w) return eng_errp("%s: out of memory", op);
  size_t pl = strlen(path);
  w->path = malloc(pl + 1);
  w->tmp = malloc(pl + 32);
  if (!w->path || !w->tmp) { free(w->path); free(w->tmp); free(w); return eng_errp("%s: out of memory", op); }
  memcpy(w->path, path, pl + 1);
  snprintf(w->tmp, pl + 32, "%s.tmp%ld", path, (long)getpid());
  snprintf(w->id, sizeof w->id, "%s", id);
  w->fd = open(w->tmp, O_WRONLY | O_CREAT | O_TRUNC, 0666);
  if (w->fd < 0) {
    eng_err("%s: cannot open '%s' for writing: %s", op, w->tmp, strerror(errno));
    free(w->path); free(w->tmp); free(w);
    return NULL;
  }
  w->end = HEADER_BYTES;
  return w;
}

int64_t eng_ckpt_writer_add(eng_ckpt_writer* w, eng_tensor* t, int copy) {
  const char* op = "checkpoint.save";
  if (!w || !t) return eng_err("%s: writer and tensor are required", op);
  if (w->started) return eng_err("%s: %s: chunks added after the write started", op, w->path);
  if (t->dist) return eng_err("%s: %s is a DTensor: add its local shard", op, eng_desc(t));
  if (eng_meta_check(t, op)) return -1;
  eng_tensor* c;
  if (copy && t->device == ENG_CPU && eng_tensor_is_contiguous(t)) {
    /* the staging copy of an async save: streamed past the cache (the writer thread reads it back from memory
     * long after; the caller's working set stays cached) */
    c = eng_tensor_empty(t->ndim, t->shape, t->dtype, ENG_CPU);
    if (c) kc_copy_stream(eng_ptr(c), eng_ptr(t), (size_t)(t->numel * (int64_t)eng_dtype_size(t->dtype)));
  } else if (copy || t->device != ENG_CPU) {
    c = eng_tensor_empty(t->ndim, t->shape, t->dtype, ENG_CPU);
    if (c && eng_tensor_copy_(c, t) != 0) { eng_tensor_release(c); c = NULL; }
  } else {
    c = eng_as_contig(t, t->dtype);
  }
  if (!c) { eng_err_prefix("%s: %s", op, w->path); return -1; }
  if (w->n == w->cap) {
    int nc = w->cap ? 2 * w->cap : 16;
    eng_tensor** a = realloc(w->chunks, (size_t)nc * sizeof *a);
    if (a) w->chunks = a;
    uint64_t* s = a ? realloc(w->sums, (size_t)nc * sizeof *s) : NULL;
    if (s) w->sums = s;
    if (!a || !s) { eng_tensor_release(c); return eng_err("%s: out of memory", op); }
    w->cap = nc;
  }
  int64_t off = w->end;
  w->chunks[w->n] = c;
  w->sums[w->n] = 0;
  w->n++;
  w->end += c->numel * (int64_t)eng_dtype_size(c->dtype);
  return off;
}

static int write_all(int fd, const char* p, int64_t n) {
  while (n > 0) {
    ssize_t k = write(fd, p, n > (1 << 30) ? (1 << 30) : (size_t)n);
    if (k < 0) { if (errno == EINTR) continue; return -1; }
    p += k;
    n -= k;
  }
  return 0;
}

static void fail_w(eng_ckpt_writer* w, const char* fmt, const char* a, const char* b) {
  if (w->failed) return;
  w->failed = 1;
  snprintf(w->err, sizeof w->err, fmt, a, b);
}

/* The test hooks: ENGINE_CKPT_TEST_FAIL (the write of a matching data file stops half way and fails) and
 * ENGINE_CKPT_TEST_KILL (the same half write, then the process SIGKILLs itself before the rename: a rank killed
 * during a save, its partial file left under the temporary name).  Returns the matching value, or NULL. */
static const char* test_hook(const char* path, int* kill_it) {
  const char* names[2] = {"ENGINE_CKPT_TEST_FAIL", "ENGINE_CKPT_TEST_KILL"};
  for (int i = 0; i < 2; i++) {
    const char* v = getenv(names[i]);
    if (v && *v && strstr(path, v) != NULL) {
      if (kill_it) *kill_it = i == 1;
      return v;
    }
  }
  return NULL;
}

/* Chunks go out in blocks: each block is checksummed (XXH64, streaming) and
 * then written while it is in the cache, so the data is read from memory once. */
#define WRITE_BLOCK ((int64_t)4 << 20)

static void* run(void* arg) {
  eng_ckpt_writer* w = arg;
  /* an old file of this name goes first (its checkpoint is void: a save writes in place only into a directory
   * without a complete checkpoint, else beside it in "<dir>.saving"; a reader that has it open keeps it): the
   * disk holds one copy, not two, and the new file may reuse the space (writing into space the old file still
   * held was 2-4x slower on the VM's thin-provisioned disk, dd alike).  Here, not in open: freeing a large file's blocks may wait for the disk, and an async save's
   * caller must not. */
  unlink(w->path);
  char head[HEADER_BYTES] = {0};
  memcpy(head, MAGIC, 8);
  memcpy(head + 8, w->id, strlen(w->id));
  if (write_all(w->fd, head, HEADER_BYTES) != 0) {
    fail_w(w, "checkpoint.save: write error on '%s': %s", w->tmp, strerror(errno));
    return NULL;
  }
  const char* hook = test_hook(w->path, NULL);
  int simulate = hook != NULL;
  for (int i = 0; i < w->n && !w->failed; i++) {
    eng_tensor* c = w->chunks[i];
    int64_t bytes = c->numel * (int64_t)eng_dtype_size(c->dtype);
    const char* p = eng_ptr(c);
    eng_xxh64_state st;
    eng_xxh64_reset(&st);
    int64_t limit = simulate ? bytes / 2 : bytes;
    for (int64_t done = 0; done < bytes && !w->failed; done += WRITE_BLOCK) {
      int64_t k = bytes - done < WRITE_BLOCK ? bytes - done : WRITE_BLOCK;
      eng_xxh64_update(&st, p + done, k);
      int64_t out = done + k <= limit ? k : (limit > done ? limit - done : 0);
      if (out > 0 && write_all(w->fd, p + done, out) != 0)
        fail_w(w, "checkpoint.save: write error on '%s': %s", w->tmp, strerror(errno));
    }
    w->sums[i] = eng_xxh64_digest(&st);
    if (simulate) fail_w(w, "checkpoint.save: %s: the write was interrupted (test hook ENGINE_CKPT_TEST_FAIL=%s)",
                         w->path, hook);
  }
  if (!w->failed && fsync(w->fd) != 0)
    fail_w(w, "checkpoint.save: fsync of '%s' failed: %s", w->tmp, strerror(errno));
  /* the staged data is not needed any more (an async save frees it early) */
  for (int i = 0; i < w->n; i++) { eng_tensor_release(w->chunks[i]); w->chunks[i] = NULL; }
  return NULL;
}

/* Async saves run on one background thread per process, made at the first async save and kept (it sleeps on a
 * condition variable between saves), so starting a save is a signal rather than a thread creation.  The thread
 * yields the CPU to training: it runs at a lower priority (nice +10 for this thread only; Linux applies
 * setpriority to a thread id).  Where cores are free this changes nothing; where the ranks use every core, a
 * rank that finished its staging copies no longer slows a peer still copying (4 ranks on 2 cores: the async
 * save blocked 1.2-1.9x one copy of the local shards, about 1.0x at 1 and 2 ranks).  One job at a time: a
 * second async writer waits for the first (checkpoint.save waits for the pending save anyway). */
static pthread_mutex_t bg_mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t bg_job_cv = PTHREAD_COND_INITIALIZER;  /* a job was posted */
static pthread_cond_t bg_done_cv = PTHREAD_COND_INITIALIZER; /* a job finished */
static eng_ckpt_writer* bg_job;
static int bg_live;

static void* background(void* arg) {
  (void)arg;
#ifdef SYS_gettid
  (void)setpriority(PRIO_PROCESS, (id_t)syscall(SYS_gettid), 10);
#endif
  for (;;) {
    pthread_mutex_lock(&bg_mu);
    while (!bg_job) pthread_cond_wait(&bg_job_cv, &bg_mu);
    eng_ckpt_writer* w = bg_job;
    pthread_mutex_unlock(&bg_mu);
    run(w);
    pthread_mutex_lock(&bg_mu);
    w->thread_done = 1;
    bg_job = NULL;
    pthread_cond_broadcast(&bg_done_cv);
    pthread_mutex_unlock(&bg_mu);
  }
  return NULL;
}

/* waits until w's job, if it was posted, has finished */
static void bg_join(eng_ckpt_writer* w) {
  if (!w->thread_live) return;
  pthread_mutex_lock(&bg_mu);
  while (!w->thread_done) pthread_cond_wait(&bg_done_cv, &bg_mu);
  w->thread_live = 0;
  pthread_mutex_unlock(&bg_mu);
}

int eng_ckpt_writer_start(eng_ckpt_writer* w, int async) {
  if (!w) return eng_err("checkpoint.save: writer is NULL");
  if (w->started) return eng_err("checkpoint.save: %s: started twice", w->path);
  if (!async) {
    w->started = 1;
    run(w);
    return 0;
  }
  pthread_mutex_lock(&bg_mu);
  if (!bg_live) {
    pthread_t t;
    pthread_attr_t at;
    pthread_attr_init(&at);
    pthread_attr_setdetachstate(&at, PTHREAD_CREATE_DETACHED);
    int rc = pthread_create(&t, &at, background, NULL);
    pthread_attr_destroy(&at);
    if (rc != 0) {
      pthread_mutex_unlock(&bg_mu);
      return eng_err("checkpoint.save: %s: cannot start the writer thread", w->path);
    }
    bg_live = 1;
  }
  while (bg_job) pthread_cond_wait(&bg_done_cv, &bg_mu);
  w->started = 1;
  w->thread_live = 1;
  bg_job = w;
  pthread_cond_signal(&bg_job_cv);
  pthread_mutex_unlock(&bg_mu);
  return 0;
}

int eng_ckpt_writer_finish(eng_ckpt_writer* w) {
  if (!w) return eng_err("checkpoint.save: writer is NULL");
  if (w->finished) return w->failed ? eng_err("%s", w->err) : 0;
  if (!w->started && eng_ckpt_writer_start(w, 0) != 0) return -1;
  bg_join(w);
  w->finished = 1;
  if (close(w->fd) != 0) fail_w(w, "checkpoint.save: close of '%s' failed: %s", w->tmp, strerror(errno));
  w->fd = -1;
  if (w->failed) {
    int kill_it = 0;
    if (!test_hook(w->path, &kill_it)) unlink(w->tmp); /* the hook leaves the partial file behind */
    if (kill_it) kill(getpid(), SIGKILL);
    return eng_err("%s", w->err);
  }
  if (rename(w->tmp, w->path) != 0) {
    fail_w(w, "checkpoint.save: cannot move '%s' to its final name: %s", w->tmp, strerror(errno));
    unlink(w->tmp);
    return eng_err("%s", w->err);
  }
  fsync_dir(w->path);
  return 0;
}

uint64_t eng_ckpt_writer_checksum(const eng_ckpt_writer* w, int i) {
  if (!w || i < 0 || i >= w->n) return 0;
  return w->sums[i];
}

int eng_ckpt_writer_count(const eng_ckpt_writer* w) { return w ? w->n : 0; }

void eng_ckpt_writer_free(eng_ckpt_writer* w) {
  if (!w) return;
  bg_join(w);
  if (w->fd >= 0) { close(w->fd); unlink(w->tmp); }
  for (int i = 0; i < w->n; i++) if (w->chunks[i]) eng_tensor_release(w->chunks[i]);
  free(w->chunks); free(w->sums); free(w->path); free(w->tmp);
  free(w);
}

int eng_ckpt_exchange_dirs(const char* staged, const char* dir) {
  const char* op = "checkpoint.save";
  if (!staged || !dir) return eng_err("%s: paths are required", op);
#ifdef SYS_renameat2
  if (syscall(SYS_renameat2, AT_FDCWD, staged, AT_FDCWD, dir, 2 /* RENAME_EXCHANGE */) == 0) {
    fsync_dir(dir);
    return 0;
  }
  if (errno != EINVAL && errno != ENOSYS && errno != EOPNOTSUPP)
    return eng_err("%s: cannot exchange '%s' with '%s': %s", op, staged, dir, strerror(errno));
#endif
  char old[4200];
  snprintf(old, sizeof old, "%s.old", staged);
  if (rename(dir, old) != 0) return eng_err("%s: cannot move '%s' to '%s': %s", op, dir, old, strerror(errno));
  if (rename(staged, dir) != 0) {
    int e = errno;
    (void)rename(old, dir);
    return eng_err("%s: cannot move '%s' to '%s': %s", op, staged, dir, strerror(e));
  }
  (void)rename(old, staged);
  fsync_dir(dir);
  return 0;
}

const char* eng_ckpt_realpath(const char* path) {
  static __thread char buf[4096];
  if (!path) return eng_errp("checkpoint: path is NULL");
  char* r = realpath(path, NULL);
  if (!r) return eng_errp("checkpoint.save: cannot resolve '%s': %s", path, strerror(errno));
  size_t n = strlen(r);
  if (n >= sizeof buf) { free(r); return eng_errp("checkpoint.save: the path of '%s' is too long", path); }
  memcpy(buf, r, n + 1);
  free(r);
  return buf;
}

int eng_ckpt_commit_file(const char* tmp, const char* path) {
  const char* op = "checkpoint.save";
  if (!tmp || !path) return eng_err("%s: paths are required", op);
  int fd = open(tmp, O_RDONLY);
  if (fd < 0) return eng_err("%s: cannot open '%s': %s", op, tmp, strerror(errno));
  int rc = fsync(fd);
  close(fd);
  if (rc != 0) return eng_err("%s: fsync of '%s' failed: %s", op, tmp, strerror(errno));
  if (rename(tmp, path) != 0) return eng_err("%s: cannot move '%s' to '%s': %s", op, tmp, path, strerror(errno));
  fsync_dir(path);
  return 0;
}

/* ------------------------------------------------------------------ reading */
static int open_checked(const char* op, const char* path, const char* id, int64_t min_size, int64_t* size) {
  int fd = open(path, O_RDONLY);
  if (fd < 0) return eng_err("%s: cannot open '%s': %s", op, path, strerror(errno));
  struct stat st;
  if (fstat(fd, &st) != 0) { close(fd); return eng_err("%s: cannot stat '%s': %s", op, path, strerror(errno)); }
  char head[HEADER_BYTES];
  ssize_t k = pread(fd, head, HEADER_BYTES, 0);
  if (k != HEADER_BYTES || memcmp(head, MAGIC, 8) != 0) {
    close(fd);
    return eng_err("%s: '%s' is not a checkpoint data file (bad header)", op, path);
  }
  char fid[57];
  memcpy(fid, head + 8, 56);
  fid[56] = 0;
  if (strcmp(fid, id) != 0) {
    close(fd);
    return eng_err("%s: '%s' belongs to another checkpoint (id %s, the metadata says %s): the directory mixes "
                   "files of two saves", op, path, fid, id);
  }
  if ((int64_t)st.st_size < min_size) {
    close(fd);
    return eng_err("%s: '%s' is truncated: %lld bytes, the metadata needs %lld", op, path, (long long)st.st_size,
                   (long long)min_size);
  }
  if (size) *size = st.st_size;
  return fd;
}

int eng_ckpt_file_check(const char* path, const char* id, int64_t min_size) {
  if (!path || !id) return eng_err("checkpoint.load: path and id are required");
  int fd = open_checked("checkpoint.load", path, id, min_size, NULL);
  if (fd < 0) return -1;
  close(fd);
  return 0;
}

/* A reader holds the data file open (no mapping).  verify reads a chunk with
 * pread in blocks of READ_BLOCK bytes into one reused buffer and hashes each
 * block while it is in the cache (XXH64; the FNV of format engine-dcp/1, not
 * streamable, hashes the whole chunk read into memory); copy preads a region
 * that is contiguous in the chunk straight into a contiguous destination of
 * the chunk's dtype (one kernel copy), and any other region through the
 * buffer, in parts whose byte span fits it, with one strided copy per part.
 * Both read the inode opened and checked here, so the bytes copied are the
 * bytes verified even if a later save replaces the file (saves write new files
 * and rename); a file cut short meanwhile is a read error (a mapping would
 * fault with SIGBUS).  Why pread for the checksum pass: 4 ranks reading 256 MiB
 * cold files at once, medians of 8 alternating runs: pread of 4 MiB blocks +
 * XXH64 0.57 s, a mapping with MADV_WILLNEED per chunk 0.67 s (with 64 MiB more
 * asked for ahead: 0.82 s), 1 MiB reads without a hash (dd's) 0.62 s. */
#define READ_BLOCK (4 << 20)
struct eng_ckpt_reader {
  char* path;
  int algo;
  int fd;
  int64_t size;
  char* buf; /* READ_BLOCK bytes, made on first use */
  struct stat st; /* at open: a write in place since changes mtime or size */
};

/* pread all n bytes at off into dst: 0, or -1 with an error naming the file */
static int read_exact(const char* op, eng_ckpt_reader* r, char* dst, int64_t n, int64_t off) {
  while (n > 0) {
    ssize_t k = pread(r->fd, dst, (size_t)(n > (1 << 30) ? (1 << 30) : n), off);
    if (k < 0 && errno == EINTR) continue;
    if (k <= 0)
      return eng_err("%s: cannot read '%s' at offset %lld: %s", op, r->path, (long long)off,
                     k < 0 ? strerror(errno) : "the file ends early");
    dst += k;
    off += k;
    n -= k;
  }
  return 0;
}

eng_ckpt_reader* eng_ckpt_reader_open(const char* path, const char* id, int64_t min_size, int algo) {
  const char* op = "checkpoint.load";
  if (!path || !id) return eng_errp("%s: path and id are required", op);
  if (algo != ENG_CHECKSUM_XXH64 && algo != ENG_CHECKSUM_FNV)
    return eng_errp("%s: %s: unknown checksum algorithm %d", op, path, algo);
  if (min_size < HEADER_BYTES) min_size = HEADER_BYTES;
  int64_t size = 0;
  int fd = open_checked(op, path, id, min_size, &size);
  if (fd < 0) return NULL;
  eng_ckpt_reader* r = calloc(1, sizeof *r);
  char* name = malloc(strlen(path) + 1);
  if (!r || !name) {
    close(fd);
    free(r);
    free(name);
    return eng_errp("%s: %s: out of memory", op, path);
  }
  strcpy(name, path);
  if (fstat(fd, &r->st) != 0) memset(&r->st, 0, sizeof r->st);
  r->path = name;
  r->algo = algo;
  r->fd = fd;
  r->size = size;
  return r;
}

static int in_file(const char* op, eng_ckpt_reader* r, int64_t offset, int64_t nbytes) {
  if (offset < HEADER_BYTES || nbytes < 0 || offset > r->size || nbytes > r->size - offset)
    return eng_err("%s: '%s' is truncated or the chunk is misplaced: %lld bytes at offset %lld, the file has %lld",
                   op, r->path, (long long)nbytes, (long long)offset, (long long)r->size);
  return 0;
}

int eng_ckpt_reader_verify(eng_ckpt_reader* r, int64_t offset, int64_t nbytes, uint64_t checksum) {
  const char* op = "checkpoint.load";
  if (!r) return eng_err("%s: reader is NULL", op);
  if (in_file(op, r, offset, nbytes) != 0) return -1;
  uint64_t got;
  if (r->algo == ENG_CHECKSUM_XXH64) {
    if (!r->buf && !(r->buf = malloc(READ_BLOCK))) return eng_err("%s: %s: out of memory", op, r->path);
    eng_xxh64_state hs;
    eng_xxh64_reset(&hs);
    for (int64_t o = 0; o < nbytes; o += READ_BLOCK) {
      int64_t n = nbytes - o < READ_BLOCK ? nbytes - o : READ_BLOCK;
      if (read_exact(op, r, r->buf, n, offset + o) != 0) return -1;
      eng_xxh64_update(&hs, r->buf, n);
    }
    got = eng_xxh64_digest(&hs);
  } else {
    char* whole = malloc(nbytes > 0 ? (size_t)nbytes : 1);
    if (!whole) return eng_err("%s: %s: out of memory for a chunk of %lld bytes", op, r->path, (long long)nbytes);
    if (read_exact(op, r, whole, nbytes, offset) != 0) { free(whole); return -1; }
    got = eng_checksum_fnv(whole, nbytes);
    free(whole);
  }
  if (got != checksum)
    return eng_err("%s: '%s': the chunk at offset %lld (%lld bytes) fails its checksum (stored %016llx, computed "
                   "%016llx): the file is corrupt", op, r->path, (long long)offset, (long long)nbytes,
                   (unsigned long long)checksum, (unsigned long long)got);
  return 0;
}

/* Copies into out (a view of the destination; its shape is the region's) the region of the chunk at file
 * offset chunk_off whose first element is element off of the chunk (row-major strides cstride): a region whose
 * byte span fits the buffer is read at once and copied from it; a larger one is split on its outermost dim, in
 * parts of as many indices as fit, or index by index (one dim fewer) when one index spans more than the buffer. */
static int copy_part(const char* op, eng_ckpt_reader* r, int64_t chunk_off, int es, int dtype, int ndim,
                     const int64_t* cstride, int64_t off, eng_tensor* out) {
  int64_t span = 1; /* elements from the region's first to its last, inclusive */
  for (int d = 0; d < ndim; d++) span += (out->shape[d] - 1) * cstride[d];
  if (span * es <= READ_BLOCK) {
    if (read_exact(op, r, r->buf, span * es, chunk_off + off * es) != 0) return -1;
    eng_tensor* src = eng_wrap_external(r->buf, span * es, ndim, out->shape, cstride, 0, dtype);
    int rc = src ? eng_tensor_copy_(out, src) : -1;
    eng_tensor_release(src);
    if (rc != 0) { eng_err_prefix("%s: %s", op, r->path); return -1; }
    return 0;
  }
  /* ndim >= 1 here (a 0-dim span is one element); the last dim's chunk stride is 1, so k >= 1 for it */
  int64_t k = READ_BLOCK / (cstride[0] * es);
  if (k >= 1) {
    int64_t shape[8];
    for (int d = 0; d < ndim; d++) shape[d] = out->shape[d];
    for (int64_t i = 0; i < out->shape[0]; i += k) {
      shape[0] = out->shape[0] - i < k ? out->shape[0] - i : k;
      eng_tensor* part = eng_view_of(out, ndim, shape, out->stride, out->offset + i * out->stride[0]);
      int rc = part ? copy_part(op, r, chunk_off, es, dtype, ndim, cstride, off + i * cstride[0], part) : -1;
      eng_tensor_release(part);
      if (rc != 0) return -1;
    }
    return 0;
  }
  for (int64_t i = 0; i < out->shape[0]; i++) {
    eng_tensor* part = eng_view_of(out, ndim - 1, out->shape + 1, out->stride + 1, out->offset + i * out->stride[0]);
    int rc = part ? copy_part(op, r, chunk_off, es, dtype, ndim - 1, cstride + 1, off + i * cstride[0], part) : -1;
    eng_tensor_release(part);
    if (rc != 0) return -1;
  }
  return 0;
}

int eng_ckpt_reader_copy(eng_ckpt_reader* r, int64_t offset, int dtype, int ndim, const int64_t* sizes,
                         const int64_t* src_offsets, eng_tensor* out) {
  const char* op = "checkpoint.load";
  if (!r || !out || ndim < 0 || ndim > 8 || (ndim && !sizes)) return eng_err("%s: bad arguments to the reader", op);
  ENG_CHECK_I(out, op);
  if (out->dist) return eng_err("%s: %s is a DTensor: copy into its local shard", op, eng_desc(out));
  if (eng_check_internal_overlap(out, op)) return -1; /* an expanded destination: its elements share memory */
  int es = eng_dtype_size(dtype);
  if (es <= 0) return -1;
  if (out->ndim != ndim) return eng_err("%s: %s: the output %s has %d dims, the chunk %d", op, r->path, eng_desc(out),
                                        out->ndim, ndim);
  int64_t numel = 1;
  for (int d = 0; d < ndim; d++) {
    int64_t o = src_offsets ? src_offsets[d] : 0;
    if (sizes[d] < 0 || o < 0 || out->shape[d] > sizes[d] - o)
      return eng_err("%s: %s: the output %s does not fit in the chunk's box", op, r->path, eng_desc(out));
    numel *= sizes[d];
  }
  if (in_file(op, r, offset, numel * es) != 0) return -1;
  if (out->numel == 0) return 0;
  int64_t stride[8], off = 0, st = 1;
  for (int d = ndim - 1; d >= 0; d--) {
    stride[d] = st;
    off += (src_offsets ? src_offsets[d] : 0) * st;
    st *= sizes[d];
  }
  /* a region contiguous in the chunk (full trailing dims, extent 1 before the first partial one) into a
   * contiguous CPU destination of the same dtype: read straight into it */
  int contig = out->device == ENG_CPU && out->dtype == dtype && eng_tensor_is_contiguous(out);
  for (int d = ndim - 1, partial = 0; contig && d >= 0; d--) {
    if (partial) contig = out->shape[d] == 1;
    else partial = out->shape[d] != sizes[d];
  }
  if (contig) {
    if (read_exact(op, r, (char*)eng_ptr(out), out->numel * es, offset + off * es) != 0) return -1;
    return 0;
  }
  if (!r->buf && !(r->buf = malloc(READ_BLOCK))) return eng_err("%s: %s: out of memory", op, r->path);
  return copy_part(op, r, offset, es, dtype, ndim, stride, off, out);
}

int eng_ckpt_reader_unchanged(eng_ckpt_reader* r) {
  const char* op = "checkpoint.load";
  if (!r) return eng_err("%s: reader is NULL", op);
  struct stat now;
  if (fstat(r->fd, &now) != 0) return eng_err("%s: cannot stat '%s': %s", op, r->path, strerror(errno));
  /* not ctime: unlinking or renaming over the file (a later save) changes it, not the bytes */
  if (now.st_size != r->st.st_size || now.st_mtim.tv_sec != r->st.st_mtim.tv_sec ||
      now.st_mtim.tv_nsec != r->st.st_mtim.tv_nsec)
    return eng_err("%s: '%s' was written to during the load", op, r->path);
  return 0;
}

const char* eng_ckpt_reader_path(const eng_ckpt_reader* r) { return r ? r->path : NULL; }

void eng_ckpt_reader_close(eng_ckpt_reader* r) {
  if (!r) return;
  free(r->buf);
  if (r->fd >= 0) close(r->fd);
  free(r->path);
  free(r);
}
