// Shared by the stand-in CUDA libraries (mockcuda.c, mockblas.c): how they report.
// An error goes to stderr at once and, with MOCKCUDA_LOG=path, to that file (appended, so that
// every process of a run and every library writes to one log).
#pragma once
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

static inline FILE* mock_log(void) {
  const char* path = getenv("MOCKCUDA_LOG");
  return path ? fopen(path, "a") : NULL;
}

static inline void mock_say(const char* kind, const char* fmt, va_list ap) {
  char msg[1024];
  vsnprintf(msg, sizeof msg, fmt, ap);
  fprintf(stderr, "mockcuda: %s %s\n", kind, msg);
  FILE* out = mock_log();
  if (out) {
    fprintf(out, "%s %s (pid %d)\n", kind, msg, (int)getpid());
    fclose(out);
  }
}

// Reports a call the real library would refuse; returns `code` for the caller to return.
static inline int mock_error(int code, const char* fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  mock_say("ERROR", fmt, ap);
  va_end(ap);
  return code;
}

static inline void mock_note(const char* fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  mock_say("UNIMPLEMENTED", fmt, ap);
  va_end(ap);
}

// A call the stand-in does not implement: reported, and refused with the library's own
// "not supported" code by the caller.
#define mock_unimplemented(what) (mock_note("%s", what), 801)

static inline int mock_error_name(int e, const char** s) {
  switch (e) {
    case 0: *s = "CUDA_SUCCESS"; break;
    case 1: *s = "CUDA_ERROR_INVALID_VALUE"; break;
    case 2: *s = "CUDA_ERROR_OUT_OF_MEMORY"; break;
    case 101: *s = "CUDA_ERROR_INVALID_DEVICE"; break;
    case 200: *s = "CUDA_ERROR_INVALID_IMAGE"; break;
    case 300: *s = "CUDA_ERROR_INVALID_SOURCE"; break;
    case 400: *s = "CUDA_ERROR_INVALID_HANDLE"; break;
    case 500: *s = "CUDA_ERROR_NOT_FOUND"; break;
    case 719: *s = "CUDA_ERROR_LAUNCH_FAILED"; break;
    case 801: *s = "CUDA_ERROR_NOT_SUPPORTED (not implemented by the mock driver)"; break;
    default: *s = "CUDA_ERROR_UNKNOWN"; break;
  }
  return 0;
}
