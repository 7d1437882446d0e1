/* Subsystem checkpoint/: distributed checkpoints (rank data files, the
 * metadata entries, crash-safe commits).  May call: core/, io/ (checksums),
 * sharded_tensor/ (shard-box checks).  The Lua API (planning per tensor, the
 * collectives that agree on success, the metadata file) is
 * lua/engine/distributed/checkpoint.lua.
 *
 * files.c: the per-rank data files.  A writer queues chunks (copied into
 * staging buffers for async saves, or retained for sync ones), then writes
 * them in order after a 64-byte header, in a pthread when async, computing
 * each chunk's checksum as it goes; finish joins, fsyncs, renames the
 * temporary file to its final name and fsyncs the directory.  Errors raised
 * in the thread are kept in the writer and set on the caller's thread by
 * finish (error messages are thread-local). */
#include "core/internal.h"
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
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
  pthread_t thread;
  int thread_live, started, finished, failed;
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
  if (copy || t->device != ENG_CPU) {
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

static void* run(void* arg) {
  eng_ckpt_writer* w = arg;
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
    if (eng_tensor_checksum(c, &w->sums[i]) != 0) {
      fail_w(w, "checkpoint.save: %s: %s", w->path, eng_last_error());
      break;
    }
    if (simulate) bytes /= 2;
    if (write_all(w->fd, eng_ptr(c), bytes) != 0) {
      fail_w(w, "checkpoint.save: write error on '%s': %s", w->tmp, strerror(errno));
      break;
    }
    if (simulate) fail_w(w, "checkpoint.save: %s: the write was interrupted (test hook ENGINE_CKPT_TEST_FAIL=%s)",
                         w->path, hook);
  }
  if (!w->failed && fsync(w->fd) != 0)
    fail_w(w, "checkpoint.save: fsync of '%s' failed: %s", w->tmp, strerror(errno));
  /* the staged data is not needed any more (an async save frees it early) */
  for (int i = 0; i < w->n; i++) { eng_tensor_release(w->chunks[i]); w->chunks[i] = NULL; }
  return NULL;
}

int eng_ckpt_writer_start(eng_ckpt_writer* w, int async) {
  if (!w) return eng_err("checkpoint.save: writer is NULL");
  if (w->started) return eng_err("checkpoint.save: %s: started twice", w->path);
  w->started = 1;
  if (async) {
    if (pthread_create(&w->thread, NULL, run, w) != 0) {
      w->started = 0;
      return eng_err("checkpoint.save: %s: cannot start the writer thread", w->path);
    }
    w->thread_live = 1;
  } else {
    run(w);
  }
  return 0;
}

int eng_ckpt_writer_finish(eng_ckpt_writer* w) {
  if (!w) return eng_err("checkpoint.save: writer is NULL");
  if (w->finished) return w->failed ? eng_err("%s", w->err) : 0;
  if (!w->started && eng_ckpt_writer_start(w, 0) != 0) return -1;
  if (w->thread_live) { pthread_join(w->thread, NULL); w->thread_live = 0; }
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
  if (w->thread_live) pthread_join(w->thread, NULL);
  if (w->fd >= 0) { close(w->fd); unlink(w->tmp); }
  for (int i = 0; i < w->n; i++) if (w->chunks[i]) eng_tensor_release(w->chunks[i]);
  free(w->chunks); free(w->sums); free(w->path); free(w->tmp);
  free(w);
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

int eng_ckpt_read_chunk(const char* path, const char* id, int64_t offset, int64_t nbytes, uint64_t checksum,
                        eng_tensor* out) {
  const char* op = "checkpoint.load";
  if (!path || !id || !out) return eng_err("%s: path, id and output are required", op);
  if (out->device != ENG_CPU || !eng_tensor_is_contiguous(out) || out->dist ||
      out->numel * (int64_t)eng_dtype_size(out->dtype) != nbytes)
    return eng_err("%s: %s: the output %s is not a contiguous CPU tensor of %lld bytes", op, path, eng_desc(out),
                   (long long)nbytes);
  if (offset < HEADER_BYTES) return eng_err("%s: %s: chunk offset %lld is inside the header", op, path, (long long)offset);
  int fd = open_checked(op, path, id, offset + nbytes, NULL);
  if (fd < 0) return -1;
  char* p = eng_ptr(out);
  int64_t done = 0;
  while (done < nbytes) {
    int64_t want = nbytes - done;
    ssize_t k = pread(fd, p + done, want > (1 << 30) ? (1 << 30) : (size_t)want, offset + done);
    if (k < 0 && errno == EINTR) continue;
    if (k <= 0) {
      close(fd);
      return eng_err("%s: '%s' is truncated: reading %lld bytes at offset %lld", op, path, (long long)nbytes,
                     (long long)offset);
    }
    done += k;
  }
  close(fd);
  uint64_t got;
  if (eng_tensor_checksum(out, &got) != 0) { eng_err_prefix("%s: %s", op, path); return -1; }
  if (got != checksum)
    return eng_err("%s: '%s': the chunk at offset %lld (%lld bytes) fails its checksum (stored %016llx, computed "
                   "%016llx): the file is corrupt", op, path, (long long)offset, (long long)nbytes,
                   (unsigned long long)checksum, (unsigned long long)got);
  eng_bump_version(out);
  return 0;
}
