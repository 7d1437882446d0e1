/* peer_health.c: which peers have ended.  Every rank listens on a dup of
 * the world for a goodbye (its last collectives as text) that a rank sends
 * when it finalizes MPI (comm_say_goodbye), so that a rank waiting for an
 * ended peer in a signature check fails with that peer's last collectives
 * instead of hanging (comm/signature_check.c asks here). */
#include "comm/comm_impl.h"
#include <stdio.h>

#define BYE_TAG 7
#define BYE_LEN 1024
static MPI_Comm g_bye_comm = MPI_COMM_NULL;
static MPI_Request g_bye_req = MPI_REQUEST_NULL;
static char g_bye_buf[BYE_LEN];
static char** g_ended; /* per world rank: its goodbye text, NULL while running */
static int g_world_n;

static void bye_listen(void) {
  if (g_bye_comm == MPI_COMM_NULL) return;
  if (MPI_Irecv(g_bye_buf, BYE_LEN, MPI_CHAR, MPI_ANY_SOURCE, BYE_TAG, g_bye_comm, &g_bye_req) != MPI_SUCCESS)
    g_bye_req = MPI_REQUEST_NULL;
}

void comm_peers_listen(void) {
  if (g_bye_comm != MPI_COMM_NULL) return;
  MPI_Comm_size(MPI_COMM_WORLD, &g_world_n);
  if (g_world_n < 2) return;
  if (MPI_Comm_dup(MPI_COMM_WORLD, &g_bye_comm) != MPI_SUCCESS) { g_bye_comm = MPI_COMM_NULL; return; }
  MPI_Comm_set_errhandler(g_bye_comm, MPI_ERRORS_RETURN);
  g_ended = calloc((size_t)g_world_n, sizeof *g_ended);
  bye_listen();
}

void comm_peers_poll(void) {
  while (g_bye_req != MPI_REQUEST_NULL) {
    int flag = 0;
    MPI_Status st;
    if (MPI_Test(&g_bye_req, &flag, &st) != MPI_SUCCESS || !flag) return;
    int src = st.MPI_SOURCE;
    g_bye_buf[BYE_LEN - 1] = 0;
    if (g_ended && src >= 0 && src < g_world_n && !g_ended[src]) g_ended[src] = strdup(g_bye_buf);
    bye_listen();
  }
}

void comm_say_goodbye(void) {
  comm_check_finish_all();
  if (g_bye_comm == MPI_COMM_NULL) return;
  char text[BYE_LEN];
  int me = comm_world_rank();
  int k = snprintf(text, sizeof text, "last collectives of rank %d (%lld in all):\n", me, (long long)comm_record_total());
  if (k < (int)sizeof text) comm_recent_text(text + k, (int)sizeof text - k, 4);
  MPI_Request* rq = malloc(sizeof(MPI_Request) * (size_t)g_world_n);
  int n = 0;
  for (int r = 0; rq && r < g_world_n; r++)
    if (r != me && MPI_Isend(text, (int)strlen(text) + 1, MPI_CHAR, r, BYE_TAG, g_bye_comm, &rq[n]) == MPI_SUCCESS) n++;
  if (rq) MPI_Waitall(n, rq, MPI_STATUSES_IGNORE); /* small: sent eagerly, no receiver needed */
  free(rq);
  if (g_bye_req != MPI_REQUEST_NULL) {
    MPI_Cancel(&g_bye_req);
    MPI_Wait(&g_bye_req, MPI_STATUS_IGNORE);
  }
  g_bye_comm = MPI_COMM_NULL; /* not freed: goodbyes from the others may still arrive */
}

/* A member of pg that has ended, or -1. */
int comm_peer_ended(const eng_pg* pg) {
  if (!g_ended) return -1;
  for (int i = 0; i < pg->size; i++)
    if (pg->ranks[i] >= 0 && pg->ranks[i] < g_world_n && g_ended[pg->ranks[i]]) return pg->ranks[i];
  return -1;
}

const char* comm_peer_goodbye(int world_rank) {
  return g_ended && world_rank >= 0 && world_rank < g_world_n ? g_ended[world_rank] : NULL;
}
