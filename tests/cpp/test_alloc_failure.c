/* Running out of memory inside the library is an error like the others: a status
   (NVFP4KV_ERROR_OUT_OF_MEMORY) and a message, never an exception through the C ABI (which ends
   the process). Each call runs in a child
   process whose malloc fails at its n-th call only, or from its n-th call on, for n = 1, 2, ...
   until the call no longer allocates that often; the child must exit normally with the status
   and a message.

   This program's malloc replaces the C library's for the whole process, C++'s operator new
   included (glibc's symbol interposition; the test is built on Linux only). The calls:
   - a store that is refused (k_scale 0): its message is built while malloc fails;
   - a CPU decode on two threads: the worker's buffers and its thread fail, and a call that fails
     leaves its output untouched. */
#define _GNU_SOURCE
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "nvfp4kv/nvfp4kv.h"
#include "host_view.h"

/* AddressSanitizer owns malloc and stops a process that replaces it: skip (ctest's code 77). */
#if defined(__SANITIZE_ADDRESS__)
#define NVFP4KV_ASAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define NVFP4KV_ASAN 1
#endif
#endif

static long g_left = -1;  /* > 0: mallocs that still succeed before one fails */
static int g_fail_rest = 0; /* whether every malloc after that one fails too */
static int g_counting = 0;  /* whether mallocs are counted (in g_counted) */
static long g_counted = 0;

#ifndef NVFP4KV_ASAN
extern void* __libc_malloc(size_t);

void* malloc(size_t n) {
  if (g_counting) __atomic_add_fetch(&g_counted, 1, __ATOMIC_RELAXED);
  if (g_left == 0 && g_fail_rest) return NULL;
  if (g_left > 0 && __atomic_sub_fetch(&g_left, 1, __ATOMIC_RELAXED) == 0) return NULL;
  return __libc_malloc(n);
}
#endif

enum { B = 2, L = 256, H = 2, D = 128, T = 16, F = D / 2 + D / 16, N = B * L / T };

/* The call under test; returns its status (the message is read by the caller). */
static nvfp4kv_status store_refused(void) {
  static float key[1][H][D], zero = 0.0f;
  static uint8_t cache[1][2][1][H][F];
  static int64_t slot = 0;
  int64_t ks[3] = {1, H, D}, cs[5] = {1, 2, 1, H, F}, one[1] = {1};
  DLTensor k = view(key, kDLFloat, 32, 3, ks), c = view(cache, kDLUInt, 8, 5, cs);
  DLTensor s = view(&slot, kDLInt, 64, 1, one), g = view(&zero, kDLFloat, 32, 1, one);
  return nvfp4kv_store(&k, &k, &c, NULL, &s, &g, &g, NVFP4KV_RECIPE_NVFP4, NVFP4KV_SCALES_LINEAR, NULL);
}

static nvfp4kv_status decode_two_threads(void) {
  /* Zero pages (codes and scales 0): every V is 0, so the output is 0 and its value is checked. */
  static uint8_t cache[N][2][T][H][F];
  static uint16_t query[B][H][D], out[B][H][D];
  static int32_t table[B][L / T], lens[B] = {L, L};
  static float one_f = 1.0f;
  int64_t qs[3] = {B, H, D}, cs[5] = {N, 2, T, H, F}, ts[2] = {B, L / T}, ls[1] = {B}, one[1] = {1};
  int b, j;
  for (b = 0; b < B; ++b)
    for (j = 0; j < L / T; ++j) table[b][j] = b * (L / T) + j;
  memset(out, 0xFF, sizeof out);
  {
    DLTensor q = view(query, kDLBfloat, 16, 3, qs), c = view(cache, kDLUInt, 8, 5, cs);
    DLTensor bt = view(table, kDLInt, 32, 2, ts), sl = view(lens, kDLInt, 32, 1, ls);
    DLTensor sc = view(&one_f, kDLFloat, 32, 1, one), o = view(out, kDLBfloat, 16, 3, qs);
    const nvfp4kv_status st = nvfp4kv_decode_attention(&q, &c, NULL, &bt, &sl, &sc, &sc, NVFP4KV_SCALES_LINEAR, 1,
                                                       0.088f, 0.0f, -1, &o, NULL, NULL, NULL);
    if (st == NVFP4KV_SUCCESS)
      for (b = 0; b < B * H * D; ++b)
        if ((&out[0][0][0])[b] != 0) return (nvfp4kv_status)-1; /* a wrong output: reported below */
    if (st != NVFP4KV_SUCCESS) /* a call that fails leaves out untouched (found by review) */
      for (b = 0; b < B * H * D; ++b)
        if ((&out[0][0][0])[b] != 0xFFFF) return (nvfp4kv_status)-2;
    return st;
  }
}

/* The mallocs `call` makes when none fails. */
static long count_mallocs(nvfp4kv_status (*call)(void)) {
  g_counted = 0;
  g_counting = 1;
  call();
  g_counting = 0;
  return g_counted;
}

/* Runs `call` with malloc failing at its n-th call (and after it, with `rest`), for every n up to
   the count of its mallocs, in a child each time. Returns the number of failures found (children
   ended abnormally, or wrong statuses or messages). */
static int sweep(const char* name, nvfp4kv_status (*call)(void), nvfp4kv_status expected, int rest) {
  const long total = count_mallocs(call);
  int failures = 0;
  long n;
  for (n = 1; n <= total; ++n) {
    int pipefd[2], status = 0;
    pid_t pid;
    if (pipe(pipefd) != 0) return failures + 1;
    pid = fork();
    if (pid == 0) {
      char msg[256];
      nvfp4kv_status st;
      close(pipefd[0]);
      g_fail_rest = rest;
      g_left = n;
      st = call();
      g_left = -1;
      snprintf(msg, sizeof msg, "%d %s", (int)st, nvfp4kv_last_error());
      if (write(pipefd[1], msg, strlen(msg)) < 0) _exit(3);
      _exit(0);
    }
    close(pipefd[1]);
    {
      char buf[256] = {0};
      ssize_t got = read(pipefd[0], buf, sizeof buf - 1);
      int st = -2;
      close(pipefd[0]);
      waitpid(pid, &status, 0);
      if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) {
        fprintf(stderr, "%s: malloc failing at call %ld%s: the process ended abnormally (status %d)\n",
                name, n, rest ? " and after" : "", status);
        ++failures;
        continue;
      }
      if (got > 0) st = atoi(buf);
      /* A failure the library works around (a thread it could not start) may leave the status;
         one it cannot is NVFP4KV_ERROR_OUT_OF_MEMORY, never a bug's INTERNAL (review). */
      if (st != (int)expected && (st != NVFP4KV_ERROR_OUT_OF_MEMORY || !strstr(buf, "out of host memory"))) {
        fprintf(stderr, "%s: malloc failing at call %ld%s: got \"%s\"\n", name, n, rest ? " and after" : "", buf);
        ++failures;
      }
    }
  }
  printf("%s: %ld runs, malloc failing at each call%s: no abort, every failure a status\n", name, total,
         rest ? " and after it" : "");
  return failures + (total == 0);
}

int main(void) {
#ifdef NVFP4KV_ASAN
  puts("skipped: built with AddressSanitizer, which does not let a program replace malloc");
  return 77;
#endif
  int failures = 0;
  int rest;
  for (rest = 0; rest <= 1; ++rest) failures += sweep("refused store", store_refused, NVFP4KV_ERROR_INVALID_VALUE, rest);
  if (nvfp4kv_set_cpu_threads(2) != NVFP4KV_SUCCESS) {
    fprintf(stderr, "nvfp4kv_set_cpu_threads(2): %s\n", nvfp4kv_last_error());
    return 1;
  }
  if (decode_two_threads() != NVFP4KV_SUCCESS) {
    fprintf(stderr, "decode without failures: %s\n", nvfp4kv_last_error());
    return 1;
  }
  for (rest = 0; rest <= 1; ++rest)
    failures += sweep("CPU decode on two threads", decode_two_threads, NVFP4KV_SUCCESS, rest);
  if (failures) {
    fprintf(stderr, "%d failures\n", failures);
    return 1;
  }
  return 0;
}
