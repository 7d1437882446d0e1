/* host.c: the `engine` executable.  Embeds LuaJIT, puts the Lua library on
 * package.path, runs a recipe with `arg`, prints errors with a traceback and
 * exits non-zero.  It initializes the distributed runtime (MPI) itself, so
 * `engine x.lua` is a world of size 1 and `mpirun -np N engine x.lua` works.
 *
 *   engine [options] script.lua [args...]
 *   engine -e 'lua code' [args...]
 *   engine --version
 */
#include <lua.h>
#include <lauxlib.h>
#include <lualib.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <limits.h>
#include <libgen.h>
#include "engine.h"

/* Message handler: the error message with a traceback.  A nil error object
 * is the Lua 5.1 way to end a script quietly with a failure status (as
 * lua.c and luajit.c treat it): busted's exit(n) does `error()` when n is not
 * 0, after printing its own summary.  It stays nil, and nothing is printed. */
/* A usage error (engine.cli: a bad option, or --help) is not a crash: the Lua library's
 * __engine_error_hook(msg) gives its exit code and stream, kept here for main to print once and exit
 * with, without a traceback. */
static int g_quiet_code = -1;
static char* g_quiet_msg = NULL;
static int g_quiet_stdout = 0;

static int usage_error(lua_State* L, const char* msg) {
  lua_getglobal(L, "__engine_error_hook");
  if (!lua_isfunction(L, -1)) { lua_pop(L, 1); return 0; }
  lua_pushstring(L, msg);
  if (lua_pcall(L, 1, 2, 0) != 0) { lua_pop(L, 1); return 0; }
  int is = lua_isnumber(L, -2);
  if (is) {
    g_quiet_code = (int)lua_tointeger(L, -2);
    g_quiet_stdout = lua_isstring(L, -1) && !strcmp(lua_tostring(L, -1), "stdout");
    free(g_quiet_msg);
    g_quiet_msg = strdup(msg);
  }
  lua_pop(L, 2);
  return is;
}

static int traceback(lua_State* L) {
  if (lua_isnoneornil(L, 1)) { lua_settop(L, 1); return 1; }
  const char* msg = lua_tostring(L, 1);
  if (msg && usage_error(L, msg)) { lua_pushnil(L); return 1; }
  if (!msg) {
    if (luaL_callmeta(L, 1, "__tostring") && lua_type(L, -1) == LUA_TSTRING) return 1;
    msg = lua_pushfstring(L, "(error object is a %s value)", luaL_typename(L, 1));
  }
  luaL_traceback(L, L, msg, 1);
  return 1;
}

static int run_chunk(lua_State* L, int status, int nargs) {
  if (status == 0) {
    int base = lua_gettop(L) - nargs;
    lua_pushcfunction(L, traceback);
    lua_insert(L, base);
    status = lua_pcall(L, nargs, 0, base);
    lua_remove(L, base);
  }
  if (status != 0) {
    if (!lua_isnil(L, -1)) { /* nil: a quiet failure exit (see traceback) */
      const char* msg = lua_tostring(L, -1);
      fprintf(stderr, "engine: %s\n", msg ? msg : "(error object is not a string)");
      fflush(stderr);
    }
    lua_pop(L, 1);
  }
  return status;
}

/* The folder that holds lua/engine: ENGINE_HOME, else derived from the
 * executable's location (build/bindings/engine -> repo root), else the
 * compiled-in source root. */
static void find_home(char* out, size_t cap) {
  const char* env = getenv("ENGINE_HOME");
  if (env && *env) { snprintf(out, cap, "%s", env); return; }
  char exe[PATH_MAX];
  ssize_t n = readlink("/proc/self/exe", exe, sizeof exe - 1);
  if (n > 0) {
    exe[n] = 0;
    char probe[PATH_MAX + 64];
    char* dir = dirname(exe);
    for (int up = 0; up < 4; up++) {
      snprintf(probe, sizeof probe, "%s/lua/engine/init.lua", dir);
      if (access(probe, R_OK) == 0) { snprintf(out, cap, "%s", dir); return; }
      dir = dirname(dir);
    }
  }
  snprintf(out, cap, "%s", ENGINE_SOURCE_DIR);
}

static void usage(void) {
  fprintf(stderr,
          "usage: engine [-e code] [script.lua [args...]]\n"
          "       engine --version\n"
          "Runs a Lua recipe with the engine library on package.path.\n"
          "Under mpirun each rank runs the script: mpirun -np 4 engine recipe.lua\n");
}

/* OpenBLAS chooses its kernels when the library loads, before main, from OPENBLAS_CORETYPE or else the CPU's model
 * number, which an OpenBLAS older than the CPU does not know (Prescott kernels, sgemm 4x slower, on an AVX-512 Xeon
 * of family 6 model 207 under 0.3.21), and the project machines preset OPENBLAS_CORETYPE=Haswell on AVX-512 CPUs.
 * eng_blas_core_select (engine/src/core/blas_core.c) compares that choice with the CPU's features (CPUID, XGETBV)
 * and names the best core for them when OpenBLAS's is of a weaker class; the engine then re-executes itself, before
 * MPI or anything else, with OPENBLAS_CORETYPE set to it (the same pid, so mpirun's ranks are unaffected).
 * ENGINE_BLAS_CORETYPE=auto|keep|<core> decides otherwise; engine.blas_corename() and engine.blas_core_reason()
 * report the result (docs/design.md, "BLAS kernels"). */
static void choose_blas_core(char** argv) {
  const char* want = eng_blas_core_select();
  if (!want) return;
  execv("/proc/self/exe", argv);
  eng_blas_core_exec_failed(errno); /* go on with the kernels already loaded */
}

/* The OpenMPI and PMIx variables a process that is no MPI job's rank (an MPI singleton) was started with are the
 * machine's or the user's settings (an install prefix, an MCA choice such as plm_rsh_agent), unlike those that
 * MPI_Init and mpirun add.  Their names go to ENGINE_PRE_MPI_ENV (separated by spaces), so that a child process a
 * spec starts (spec/helpers/proc.lua) keeps them while it drops the job's. */
extern char** environ;
static void note_pre_mpi_env(void) {
  if (getenv("OMPI_COMM_WORLD_SIZE") || getenv("PMIX_RANK") || getenv("PMI_RANK")) return;
  char buf[4096];
  size_t n = 0;
  buf[0] = 0;
  for (char** e = environ; e && *e; e++) {
    if (strncmp(*e, "OMPI_", 5) && strncmp(*e, "PMIX_", 5) && strncmp(*e, "OPAL_", 5) && strncmp(*e, "ORTE_", 5))
      continue;
    const char* eq = strchr(*e, '=');
    if (!eq) continue;
    size_t len = (size_t)(eq - *e);
    if (n + len + 2 > sizeof buf) break;
    if (n) buf[n++] = ' ';
    memcpy(buf + n, *e, len);
    n += len;
    buf[n] = 0;
  }
  setenv("ENGINE_PRE_MPI_ENV", buf, 1);
}

int main(int argc, char** argv) {
  choose_blas_core(argv);
  if (argc >= 2 && (!strcmp(argv[1], "--version") || !strcmp(argv[1], "-v"))) {
    printf("%s\n", eng_version());
    return 0;
  }
  if (argc >= 2 && (!strcmp(argv[1], "--help") || !strcmp(argv[1], "-h"))) { usage(); return 0; }
  if (argc < 2) { usage(); return 2; }

  eng_runtime_init();
  note_pre_mpi_env();
  if (eng_dist_init() != 0) {
    fprintf(stderr, "engine: distributed init failed: %s\n", eng_last_error());
    return 1;
  }
  lua_State* L = luaL_newstate();
  if (!L) { fprintf(stderr, "engine: cannot create Lua state\n"); return 1; }
  luaL_openlibs(L);

  char home[PATH_MAX];
  find_home(home, sizeof home);
  lua_getglobal(L, "package");
  lua_pushfstring(L, "%s/lua/?.lua;%s/lua/?/init.lua;", home, home);
  lua_getfield(L, -2, "path");
  lua_concat(L, 2);
  lua_setfield(L, -2, "path");
  lua_pop(L, 1);
  lua_pushstring(L, home);
  lua_setglobal(L, "ENGINE_HOME");

  int script = 1;
  const char* code = NULL;
  if (!strcmp(argv[1], "-e")) {
    if (argc < 3) { usage(); return 2; }
    code = argv[2];
    script = 2; /* arg[0] = "-e" chunk; args follow the code */
  }
  /* arg table: arg[0] = script, arg[1..] = its arguments, arg[-1] = engine */
  lua_createtable(L, argc - script - 1, script + 1);
  for (int i = 0; i < argc; i++) {
    lua_pushstring(L, argv[i]);
    lua_rawseti(L, -2, i - script);
  }
  lua_setglobal(L, "arg");

  int status;
  int nargs = argc - script - 1;
  if (code) status = luaL_loadbuffer(L, code, strlen(code), "=(command line)");
  else status = luaL_loadfile(L, argv[script]);
  if (status == 0) {
    luaL_checkstack(L, nargs, "too many arguments");
    for (int i = script + 1; i < argc; i++) lua_pushstring(L, argv[i]);
  } else nargs = 0;
  status = run_chunk(L, status, nargs);
  /* the Lua library's exit hooks (engine.core's at_exit: e.g. an async checkpoint save nobody waited
   * for is finished here), run like the script: an error is printed and fails the run */
  if (status == 0) {
    lua_getglobal(L, "__engine_at_exit");
    if (lua_isfunction(L, -1)) status = run_chunk(L, 0, 0);
    else lua_pop(L, 1);
  }
  /* A usage error: printed once (rank 0) and every rank exits with its code, when every rank raised one
   * (a deterministic error of the arguments); otherwise the failing ranks print it and the job aborts. */
  if (status != 0 && g_quiet_code >= 0) {
    int world = eng_dist_world_size(), agreed = 1;
    if (world > 1) {
      int64_t n = 1;
      agreed = eng_dist_allreduce_counts_timeout(&n, 1, 5.0) == 0 && n == world;
    }
    if (agreed) {
      if (eng_dist_rank() == 0 && g_quiet_msg) {
        FILE* out = g_quiet_stdout ? stdout : stderr;
        fprintf(out, "%s\n", g_quiet_msg);
        fflush(out);
      }
      lua_close(L);
      eng_dist_finalize();
      return g_quiet_code;
    }
    fprintf(stderr, "engine: rank %d: %s\n", eng_dist_rank(), g_quiet_msg ? g_quiet_msg : "");
    fflush(stderr);
  }
  /* A failing rank of a multi-rank job ends the whole job: the other ranks
   * may be waiting for it in a collective, and MPI_Finalize would wait for
   * them in turn. */
  if (status != 0 && eng_dist_world_size() > 1) {
    fflush(stdout);
    fflush(stderr);
    double grace = eng_dist_abort_grace(); /* a watchdog verdict: let the ranks it names print it too */
    if (grace > 0) usleep((useconds_t)(grace * 1e6));
    eng_dist_abort(1);
  }
  /* os.exit inside the script never gets here; the Lua library's exit path
   * finalizes MPI itself. */
  lua_close(L);
  eng_dist_finalize();
  return status ? 1 : 0;
}
