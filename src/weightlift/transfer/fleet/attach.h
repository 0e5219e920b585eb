/* weightlift attach: the C API an inference engine uses to read the weights of a receiver
 * sidecar (`weightlift receiver serve`, transfer/fleet/sidecar.h) with no other weightlift
 * code: link libweightlift_attach (it needs only libc and libstdc++). The protocol is in
 * docs/formats.md ("Receiver sidecar"); python/weightlift/sidecar.py is the same in Python.
 *
 *   char err[256];
 *   wl_attached* a = wl_attach("/tmp/r0.sock", 10000, err, sizeof err);
 *   if (!a) { fprintf(stderr, "%s\n", err); ... }
 *   wl_attach_wait_version(a, 1, 60000, err, sizeof err);
 *   uint64_t v;
 *   wl_attach_pin(a, 10000, &v, err, sizeof err);         // version v, held still
 *   wl_tensor_info info;
 *   const void* q = wl_attach_tensor(a, "layers.0.attn.qkv_proj.weight", &info);  // no copy
 *   ... generate ...
 *   wl_attach_unpin(a, 10000, err, sizeof err);           // q may change from here on
 *   wl_attach_close(a);
 *
 * Functions returning int give 0 on success and -1 on failure, with a one-line message in
 * `err` (truncated to err_len bytes, always terminated when err_len > 0). Every wait is bounded
 * by its timeout in milliseconds; a request that times out closes the connection (its pin, if
 * the sidecar granted one, goes with it), and every later call fails. One thread at a time per
 * wl_attached. */
#pragma once

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef struct wl_attached wl_attached;

typedef struct wl_tensor_info {
  const char* name;  /* owned by the wl_attached, valid until wl_attach_close */
  const char* dtype; /* safetensors spelling: "BF16", "F8_E4M3", "F32" */
  int ndim;
  const int64_t* shape; /* ndim entries, owned as `name` */
  size_t bytes;
} wl_tensor_info;

/* Connects to the sidecar at `socket_path` and maps its shared memory read-only. NULL on
 * failure (no sidecar there, another protocol version, a mapping that fails). */
wl_attached* wl_attach(const char* socket_path, int timeout_ms, char* err, size_t err_len);

/* The newest version the sidecar has announced (0: nothing received yet); does not wait. */
uint64_t wl_attach_version(wl_attached* a);

/* Waits until the sidecar holds `version` or later. */
int wl_attach_wait_version(wl_attached* a, uint64_t version, int timeout_ms, char* err,
                           size_t err_len);

/* Pins the newest version (its number in *version): no update writes its memory until
 * wl_attach_unpin or wl_attach_close. One pin at a time. */
int wl_attach_pin(wl_attached* a, int timeout_ms, uint64_t* version, char* err, size_t err_len);
int wl_attach_unpin(wl_attached* a, int timeout_ms, char* err, size_t err_len);

/* The tensors the sidecar holds, in memory order; wl_attach_tensor_at is -1 for an index out
 * of range. */
int wl_attach_tensor_count(const wl_attached* a);
int wl_attach_tensor_at(const wl_attached* a, int i, wl_tensor_info* info);

/* Tensor `name` of the pinned version (read-only memory: writing to it kills the process), and
 * its description in *info when info is not NULL. NULL when nothing is pinned or no tensor has
 * that name. */
const void* wl_attach_tensor(const wl_attached* a, const char* name, wl_tensor_info* info);

/* Disconnects (the sidecar drops any pin) and unmaps. NULL is ignored. */
void wl_attach_close(wl_attached* a);

#ifdef __cplusplus
}
#endif
