// stream.go - Stream: the cudaStream_t a GPU host computes on, for the *On
// variants of the unit transitions and of Step, and the C calls that take it.

package fsdp

// #include <stdint.h>
// #include "fsdp.h"
//
// // The stream crosses into C as an integer and becomes a pointer there: Go
// // never holds a cudaStream_t as a pointer (a handle such as
// // cudaStreamPerThread, 0x2, is no valid address for Go's stack checks).
// static fsdp_status_t fsdp_go_forward_begin(fsdp_unit_t* u, uintptr_t s) { return fsdp_forward_begin(u, (void*)s); }
// static fsdp_status_t fsdp_go_forward_end(fsdp_unit_t* u, uintptr_t s) { return fsdp_forward_end(u, (void*)s); }
// static fsdp_status_t fsdp_go_backward_begin(fsdp_unit_t* u, uintptr_t s) { return fsdp_backward_begin(u, (void*)s); }
// static fsdp_status_t fsdp_go_backward_end(fsdp_unit_t* u, uintptr_t s) { return fsdp_backward_end(u, (void*)s); }
// static fsdp_status_t fsdp_go_grad_accumulate(fsdp_unit_t* u, size_t i, uintptr_t src, fsdp_dtype_t dt, size_t n, uintptr_t s) {
//   return fsdp_grad_accumulate(u, i, (const void*)src, dt, n, (void*)s);
// }
// static fsdp_status_t fsdp_go_step(fsdp_ctx_t* c, uintptr_t s) { return fsdp_step(c, (void*)s); }
// static fsdp_status_t fsdp_go_clip_grad_norm(fsdp_ctx_t* c, uintptr_t s, double m, double* n) {
//   return fsdp_clip_grad_norm(c, (void*)s, m, n);
// }
// static fsdp_status_t fsdp_go_step_begin(fsdp_ctx_t* c, uintptr_t s, int* u, float* g) { return fsdp_step_begin(c, (void*)s, u, g); }
// static fsdp_status_t fsdp_go_step_end(fsdp_ctx_t* c, uintptr_t s) { return fsdp_step_end(c, (void*)s); }
import "C"

import (
	"strconv"
	"strings"
)

// Stream is a cudaStream_t as an integer: the stream the host queues its GPU
// work on, which libfsdp orders its own work against (docs/gpu.md, "the
// stream contract"). 0 (DefaultStream) is NULL, the legacy default stream,
// which is what ForwardBegin, ..., Step pass. From a cgo CUDA library:
// fsdp.Stream(uintptr(unsafe.Pointer(s))) for a C.cudaStream_t s; a
// cudaStream_t is memory of the CUDA driver, not of Go, so cgo's pointer
// rules allow it either way. On a CPU context only 0 is accepted.
type Stream uintptr

// DefaultStream is NULL: CUDA's legacy default stream.
const DefaultStream Stream = 0

func (s Stream) c() C.uintptr_t { return C.uintptr_t(s) }

// ForwardBeginOn is ForwardBegin with the host's stream s: s waits for the
// unit's gather, on the GPU.
func (u *Unit) ForwardBeginOn(s Stream) error {
	return u.simple("fsdp_forward_begin", func() C.fsdp_status_t { return C.fsdp_go_forward_begin(u.ptr, s.c()) })
}

// ForwardEndOn is ForwardEnd after the work queued on s so far.
func (u *Unit) ForwardEndOn(s Stream) error {
	return u.simple("fsdp_forward_end", func() C.fsdp_status_t { return C.fsdp_go_forward_end(u.ptr, s.c()) })
}

// BackwardBeginOn is BackwardBegin with the host's stream s.
func (u *Unit) BackwardBeginOn(s Stream) error {
	return u.simple("fsdp_backward_begin", func() C.fsdp_status_t { return C.fsdp_go_backward_begin(u.ptr, s.c()) })
}

// BackwardEndOn is BackwardEnd after the work queued on s so far: the grads
// the host's kernels add on s are reduced once they are there.
func (u *Unit) BackwardEndOn(s Stream) error {
	return u.simple("fsdp_backward_end", func() C.fsdp_status_t { return C.fsdp_go_backward_end(u.ptr, s.c()) })
}

// GradAccumulateOn adds a grad from memory of the host's own into param i's
// grad, queued on s after the work queued there so far (fsdp_grad_accumulate):
// src holds the param's element count of dtype (FP32, BF16 or FP16, whatever
// the context's param dtype), each added in fp32 and rounded once to the param
// dtype. src is memory of the context's device (a GPU pointer from a cgo CUDA
// library on CUDA) passed as an address, never Go memory on a GPU context:
// the add may run after the call returns, so src must stay valid until s is
// synchronized. Between BackwardBegin and BackwardEnd.
func (u *Unit) GradAccumulateOn(i int, src uintptr, dtype Dtype, s Stream) error {
	if err := u.checkIndex("fsdp_grad_accumulate", i); err != nil {
		return err
	}
	n := C.size_t(u.params[i].Numel())
	return call("fsdp_grad_accumulate", func() C.fsdp_status_t {
		return C.fsdp_go_grad_accumulate(u.ptr, C.size_t(i), C.uintptr_t(src), C.fsdp_dtype_t(dtype), n, s.c())
	})
}

// StepOn is Step after the work queued on s so far.
func (c *Context) StepOn(s Stream) error {
	return c.simple("fsdp_step", func() C.fsdp_status_t { return C.fsdp_go_step(c.ptr, s.c()) })
}

// ClipGradNorm is torch.nn.utils.clip_grad_norm_ for libfsdp's own optimizer
// (fsdp_clip_grad_norm, collective): after the step's last backward, before
// Step. It returns the global L2 norm of the grads over all ranks (a host
// wait), and the coming Step alone scales the grads by
// maxNorm / (norm + 1e-6) where that is below 1. maxNorm must be finite and
// > 0; with optimizer=host it is ErrInvalidState. The max_grad_norm option
// does the same inside Step without the wait.
func (c *Context) ClipGradNorm(maxNorm float64) (float64, error) {
	return c.ClipGradNormOn(DefaultStream, maxNorm)
}

// ClipGradNormOn is ClipGradNorm after the work queued on s so far.
func (c *Context) ClipGradNormOn(s Stream, maxNorm float64) (float64, error) {
	var n C.double
	err := c.simple("fsdp_clip_grad_norm", func() C.fsdp_status_t {
		return C.fsdp_go_clip_grad_norm(c.ptr, s.c(), C.double(maxNorm), &n)
	})
	return float64(n), err
}

// StepBegin (optimizer=host, collective) does what Step does before its
// update: every reduction, the norm, the loss scaler's verdict, clipping.
// update false: a skipped step (inf/nan), change nothing; else the host
// multiplies the grads by gradScale in its update (Unit.ShardTensors) and
// then calls StepEnd.
func (c *Context) StepBegin() (update bool, gradScale float32, err error) {
	var u C.int
	var g C.float
	err = c.simple("fsdp_step_begin", func() C.fsdp_status_t {
		return C.fsdp_go_step_begin(c.ptr, DefaultStream.c(), &u, &g)
	})
	return u == 1, float32(g), err
}

// StepEnd (optimizer=host, collective) ends the host's update: the next
// gathers read it and the step is counted.
func (c *Context) StepEnd() error {
	return c.simple("fsdp_step_end", func() C.fsdp_status_t { return C.fsdp_go_step_end(c.ptr, DefaultStream.c()) })
}

// CUDADevice is N of the context's "cuda:N" (ok false on the CPU): the device
// a program's own CUDA calls on ParamPtr/GradPtr must run on. The CUDA
// current device is per OS thread, so lock the goroutine to its thread
// (runtime.LockOSThread) and call cudaSetDevice(N) on it (doc.go).
func (c *Context) CUDADevice() (ordinal int, ok bool) {
	if c == nil || !strings.HasPrefix(c.device, "cuda:") {
		return 0, false
	}
	n, err := strconv.Atoi(strings.TrimPrefix(c.device, "cuda:"))
	return n, err == nil
}
