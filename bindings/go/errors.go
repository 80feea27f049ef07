// errors.go - statuses, the *Error type and the helper that calls into
// libfsdp and reads its thread-local last error on the same OS thread.

package fsdp

// #include <stdlib.h>
// #include "fsdp.h"
import "C"

import (
	"fmt"
	"runtime"
	"unsafe"
)

// Status is an fsdp_status_t. Each non-OK Status is also an error, so the
// Err* sentinels below work with errors.Is.
type Status int

// The statuses of fsdp.h.
const (
	StatusOK              Status = C.FSDP_OK
	StatusInvalidArgument Status = C.FSDP_ERR_INVALID_ARGUMENT
	StatusInvalidState    Status = C.FSDP_ERR_INVALID_STATE
	StatusUnsupported     Status = C.FSDP_ERR_UNSUPPORTED
	StatusOutOfMemory     Status = C.FSDP_ERR_OUT_OF_MEMORY
	StatusTimeout         Status = C.FSDP_ERR_TIMEOUT
	StatusMismatch        Status = C.FSDP_ERR_MISMATCH
	StatusComm            Status = C.FSDP_ERR_COMM
	StatusCorrupt         Status = C.FSDP_ERR_CORRUPT
	StatusIO              Status = C.FSDP_ERR_IO
	StatusInternal        Status = C.FSDP_ERR_INTERNAL
)

// Sentinels for errors.Is(err, fsdp.ErrTimeout) and so on.
var (
	ErrInvalidArgument error = StatusInvalidArgument
	ErrInvalidState    error = StatusInvalidState
	ErrUnsupported     error = StatusUnsupported
	ErrOutOfMemory     error = StatusOutOfMemory
	ErrTimeout         error = StatusTimeout
	ErrMismatch        error = StatusMismatch
	ErrComm            error = StatusComm
	ErrCorrupt         error = StatusCorrupt
	ErrIO              error = StatusIO
	ErrInternal        error = StatusInternal
)

// Name is the library's name of the status, e.g. "FSDP_ERR_TIMEOUT".
func (s Status) Name() string { return C.GoString(C.fsdp_status_name(C.fsdp_status_t(s))) }

// Error makes a Status usable as an error (the sentinels).
func (s Status) Error() string { return s.Name() }

// Error is a failed libfsdp call: which function, its status and the
// library's message.
type Error struct {
	Op      string // the C function, e.g. "fsdp_config_set"
	Status  Status
	Name    string // Status.Name()
	Message string // fsdp_last_error() of the failed call
}

func (e *Error) Error() string {
	return fmt.Sprintf("%s: %s: %s", e.Op, e.Name, e.Message)
}

// Unwrap returns the Status, so errors.Is(err, fsdp.ErrInvalidState) works.
func (e *Error) Unwrap() error { return e.Status }

// newError builds an error without a C call (e.g. a closed handle).
func newError(op string, st Status, msg string) *Error {
	return &Error{Op: op, Status: st, Name: st.Name(), Message: msg}
}

// call runs f (one C call) with the goroutine locked to its OS thread, so
// that fsdp_last_error is read on the thread that failed.
func call(op string, f func() C.fsdp_status_t) error {
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	st := f()
	if st == C.FSDP_OK {
		return nil
	}
	return newError(op, Status(st), C.GoString(C.fsdp_last_error()))
}

// closedError is returned by every method of a closed handle.
func closedError(what string) error {
	return newError(what, StatusInvalidState, what+" is closed")
}

// Version is FSDP_VERSION_NUMBER of the loaded library (MAJOR*10000+MINOR*100+PATCH).
func Version() int { return int(C.fsdp_version()) }

// BuildInfo names the version and the compiled-in devices and communicators.
func BuildInfo() string { return C.GoString(C.fsdp_build_info()) }

// CommIDCreate makes a new id for comm=nccl processes that the host starts
// itself: call it on one process, send the text to every process, and set
// comm=nccl, comm_id=<text> and world_size=<N> on each (docs/launching.md).
// ErrUnsupported in a build without NCCL.
func CommIDCreate() (string, error) {
	buf := (*C.char)(C.malloc(C.FSDP_COMM_ID_NBYTES))
	defer C.free(unsafe.Pointer(buf))
	if err := call("fsdp_comm_id_create", func() C.fsdp_status_t {
		return C.fsdp_comm_id_create(buf, C.FSDP_COMM_ID_NBYTES)
	}); err != nil {
		return "", err
	}
	return C.GoString(buf), nil
}

// SetLogLevel sets the process-wide log level (0 error .. 3 debug).
func SetLogLevel(level int) error {
	return call("fsdp_log_set_level", func() C.fsdp_status_t { return C.fsdp_log_set_level(C.int(level)) })
}
