// Package fsdp is the Go binding of libfsdp: fully sharded data parallel
// (ZeRO-3) training behind the stable C ABI of include/fsdp.h.
//
// The host (this Go program) computes forward and backward; libfsdp owns the
// parameters, gradients, optimizer state and collectives. A step:
//
//	for each unit in forward order:  u.ForwardBegin(); p, _ := u.Param(i); ...; u.ForwardEnd()
//	for each unit in reverse order:  u.BackwardBegin(); g, _ := u.Grad(i); g[k] += ...; u.BackwardEnd()
//	ctx.Step()
//
// Grads are ADDED into the Grad slices (the library zeroes them at
// BackwardBegin) and averaged over ranks (reduce_op=avg), so each rank
// computes the grads of the mean loss over its own rows.
//
// Zero-copy: Param and Grad return slices over library memory, valid only
// between the Begin and the End call of the unit (Param: ForwardBegin..
// ForwardEnd or BackwardBegin..BackwardEnd; Grad: BackwardBegin..BackwardEnd).
// Touching them afterwards reads freed memory. They are []float32 for
// param_dtype=fp32; for bf16/fp16 contexts Param and Grad return an error and
// ParamU16/GradU16 give the raw 16-bit values ([]uint16; see BF16ToFloat32,
// Float32ToBF16, FP16ToFloat32, Float32ToFP16).
//
// Ranks: with the local communicator every rank is a goroutine locked to its
// own OS thread (RunRanks); each rank creates its own Context on a shared
// Group. Collective calls must be made by every rank in the same order.
// A handle is not safe for concurrent use by several goroutines.
//
// GPUs (compiled, untested on a GPU: cuda_test.go skips without one). On a
// device=cuda context Param and Grad refuse (a Go slice cannot view GPU
// memory); ParamPtr and GradPtr give the device pointers, valid for the
// same block, for the program's own CUDA calls. libfsdp orders its work
// against one stream per call: ForwardBegin, ForwardEnd, BackwardBegin,
// BackwardEnd and Step pass NULL, the legacy default stream, so the
// program's GPU work on those buffers must be on the legacy stream, on a
// blocking stream or the per-thread default stream (CUDA orders those with
// the legacy one), or synchronized before each End. Work on a non-blocking
// stream is ordered with nothing: pass that stream with ForwardBeginOn,
// ForwardEndOn, BackwardBeginOn, BackwardEndOn and StepOn (a Stream is the
// cudaStream_t as an integer: fsdp.Stream(uintptr(unsafe.Pointer(s)))).
// The CUDA current device belongs to the OS thread, and Go moves goroutines
// between threads: a program driving one context locks the goroutine that
// drives it (runtime.LockOSThread) and calls cudaSetDevice(N) on it, N from
// ctx.CUDADevice(), before its own CUDA calls; RunRanks locks each rank's
// goroutine already.
//
// Errors are *Error values carrying the status, its name and the library's
// message (fsdp_last_error, read on the same OS thread as the failed call);
// test them with errors.Is(err, fsdp.ErrInvalidArgument) and friends.
// Every handle has an idempotent Close; calls on a closed handle return an
// error with status ErrInvalidState, never crash.
//
// Building: cgo needs the header and the library (see README.md). From a
// source checkout, once libfsdp is built in build/default (./tools/demo.sh
// does it), nothing needs setting: cgo_repo.go links
// build/default/src/libfsdp.so with an rpath to it, and
//
//	cd bindings/go && go test ./...
//
// just works. CGO_LDFLAGS="-L<dir> -Wl,-rpath,<dir>" links another build
// (its flags come first), e.g. a GPU build's build/gpu/src. With an installed libfsdp use pkg-config, and an
// rpath (or LD_LIBRARY_PATH) so the program finds libfsdp.so.0 at run time:
//
//	PKG_CONFIG_PATH=<prefix>/lib/pkgconfig CGO_LDFLAGS=-Wl,-rpath,<prefix>/lib go build -tags fsdp_pkgconfig ./...
package fsdp
