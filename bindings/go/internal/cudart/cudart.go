// Package cudart opens the CUDA runtime at run time (dlopen) for the
// binding's GPU tests, which need a few CUDA calls of their own (copies,
// streams) and cannot use cgo in a _test.go file. Nothing links against
// CUDA: where no runtime loads, Open says why and the tests skip.
//
// Which library: $FSDP_CUDART_LIBRARY when set, else libcudart.so.13 on the
// loader's path, else the toolkit's ($CUDA_HOME, /usr/local/cuda), else
// libcudart.so.
package cudart

// #cgo LDFLAGS: -ldl
// #include <dlfcn.h>
// #include <stdint.h>
// #include <stdlib.h>
//
// static void* rt;
// static const char* rt_open(const char* path) {
//   void* h = dlopen(path, RTLD_NOW | RTLD_GLOBAL);
//   if (h == NULL) return dlerror();
//   rt = h;
//   return NULL;
// }
// static void* rt_sym(const char* name) { return rt ? dlsym(rt, name) : NULL; }
// #define RT_CALL(type, name, ...) \
//   type f = (type)rt_sym(name); \
//   if (f == NULL) return -1; \
//   return f(__VA_ARGS__);
// typedef int (*int_p)(int*);
// typedef int (*int_i)(int);
// typedef int (*int_pp_u)(void**, unsigned);
// typedef int (*int_pp_z)(void**, size_t);
// typedef int (*int_p1)(void*);
// typedef int (*int_copy)(void*, const void*, size_t, int, void*);
// typedef int (*int_set)(void*, int, size_t, void*);
// typedef const char* (*str_i)(int);
// static int rt_device_count(int* n) { RT_CALL(int_p, "cudaGetDeviceCount", n) }
// static int rt_set_device(int d) { RT_CALL(int_i, "cudaSetDevice", d) }
// static int rt_stream_create(uintptr_t* s) {
//   void* p = NULL;
//   int_pp_u f = (int_pp_u)rt_sym("cudaStreamCreateWithFlags");
//   if (f == NULL) return -1;
//   int e = f(&p, 1u); /* cudaStreamNonBlocking */
//   *s = (uintptr_t)p;
//   return e;
// }
// static int rt_stream_sync(uintptr_t s) { RT_CALL(int_p1, "cudaStreamSynchronize", (void*)s) }
// static int rt_stream_destroy(uintptr_t s) { RT_CALL(int_p1, "cudaStreamDestroy", (void*)s) }
// static int rt_malloc_host(void** p, size_t n) { RT_CALL(int_pp_z, "cudaMallocHost", p, n) }
// static int rt_free_host(void* p) { RT_CALL(int_p1, "cudaFreeHost", p) }
// static int rt_malloc(void** p, size_t n) { RT_CALL(int_pp_z, "cudaMalloc", p, n) }
// static int rt_free(void* p) { RT_CALL(int_p1, "cudaFree", p) }
// static int rt_copy(void* dst, const void* src, size_t n, uintptr_t s) {
//   RT_CALL(int_copy, "cudaMemcpyAsync", dst, src, n, 4 /* cudaMemcpyDefault */, (void*)s)
// }
// static int rt_memset(void* p, int v, size_t n, uintptr_t s) { RT_CALL(int_set, "cudaMemsetAsync", p, v, n, (void*)s) }
// static const char* rt_error(int e) {
//   str_i f = (str_i)rt_sym("cudaGetErrorString");
//   return f ? f(e) : "the CUDA runtime has no cudaGetErrorString";
// }
import "C"

import (
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"unsafe"
)

var (
	once    sync.Once
	openErr error
)

// Candidates are the libraries Open tries, in order.
func Candidates() []string {
	if p := os.Getenv("FSDP_CUDART_LIBRARY"); p != "" {
		return []string{p}
	}
	out := []string{"libcudart.so.13"}
	for _, root := range []string{os.Getenv("CUDA_HOME"), os.Getenv("CUDA_PATH"), "/usr/local/cuda"} {
		if root != "" {
			out = append(out, filepath.Join(root, "lib64", "libcudart.so.13"))
		}
	}
	return append(out, "libcudart.so")
}

// Open loads the runtime once; the error names every library tried.
func Open() error {
	once.Do(func() {
		var tried []string
		for _, p := range Candidates() {
			cs := C.CString(p)
			msg := C.rt_open(cs)
			C.free(unsafe.Pointer(cs))
			if msg == nil {
				return
			}
			tried = append(tried, C.GoString(msg))
		}
		openErr = fmt.Errorf("the CUDA runtime did not load (set FSDP_CUDART_LIBRARY to a libcudart.so.13): %s",
			strings.Join(tried, "; "))
	})
	return openErr
}

func check(e C.int, call string) error {
	if e == 0 {
		return nil
	}
	if e == -1 {
		return fmt.Errorf("%s: not in the loaded CUDA runtime", call)
	}
	return fmt.Errorf("%s: %s (cudaError %d)", call, C.GoString(C.rt_error(e)), int(e))
}

// DeviceCount is cudaGetDeviceCount.
func DeviceCount() (int, error) {
	var n C.int
	err := check(C.rt_device_count(&n), "cudaGetDeviceCount")
	return int(n), err
}

// SetDevice is cudaSetDevice: the calling OS thread's current device.
func SetDevice(d int) error { return check(C.rt_set_device(C.int(d)), "cudaSetDevice") }

// StreamCreate makes a non-blocking stream (ordered with no other stream).
func StreamCreate() (uintptr, error) {
	var s C.uintptr_t
	err := check(C.rt_stream_create(&s), "cudaStreamCreateWithFlags")
	return uintptr(s), err
}

// StreamSynchronize is cudaStreamSynchronize (0: the legacy default stream).
func StreamSynchronize(s uintptr) error {
	return check(C.rt_stream_sync(C.uintptr_t(s)), "cudaStreamSynchronize")
}

// StreamDestroy is cudaStreamDestroy.
func StreamDestroy(s uintptr) error {
	return check(C.rt_stream_destroy(C.uintptr_t(s)), "cudaStreamDestroy")
}

// Pinned is page-locked host memory of float32s (C memory: a Go slice over
// it may be handed to asynchronous copies).
type Pinned struct {
	p unsafe.Pointer
	n int
}

// NewPinned allocates n float32s of pinned host memory.
func NewPinned(n int) (*Pinned, error) {
	var p unsafe.Pointer
	if err := check(C.rt_malloc_host(&p, C.size_t(4*n)), "cudaMallocHost"); err != nil {
		return nil, err
	}
	return &Pinned{p: p, n: n}, nil
}

// Floats is the memory as a slice.
func (h *Pinned) Floats() []float32 { return unsafe.Slice((*float32)(h.p), h.n) }

// Ptr is the memory's address.
func (h *Pinned) Ptr() unsafe.Pointer { return h.p }

// Free releases the memory (after the copies that use it are done).
func (h *Pinned) Free() error { return check(C.rt_free_host(h.p), "cudaFreeHost") }

// Malloc is cudaMalloc.
func Malloc(nbytes int) (unsafe.Pointer, error) {
	var p unsafe.Pointer
	err := check(C.rt_malloc(&p, C.size_t(nbytes)), "cudaMalloc")
	return p, err
}

// Free is cudaFree.
func Free(p unsafe.Pointer) error { return check(C.rt_free(p), "cudaFree") }

// CopyAsync queues a copy of nbytes on stream s, either direction (cudaMemcpyDefault).
func CopyAsync(dst, src unsafe.Pointer, nbytes int, s uintptr) error {
	return check(C.rt_copy(dst, src, C.size_t(nbytes), C.uintptr_t(s)), "cudaMemcpyAsync")
}

// MemsetAsync queues a memset of nbytes on stream s.
func MemsetAsync(p unsafe.Pointer, v int, nbytes int, s uintptr) error {
	return check(C.rt_memset(p, C.int(v), C.size_t(nbytes), C.uintptr_t(s)), "cudaMemsetAsync")
}
