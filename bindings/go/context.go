// context.go - Group (in-process ranks), RunRanks, and Context: one rank's
// view of a job (step, learning rate, loss scale, memory, trace); its
// checkpoint calls are in checkpoint.go.

package fsdp

// #include <stdlib.h>
// #include "fsdp.h"
import "C"

import (
	"fmt"
	"runtime"
	"sync"
	"unsafe"
)

// Group is a set of in-process ranks (the local communicator).
type Group struct {
	ptr  *C.fsdp_local_group_t
	size int
}

// LocalGroup creates a group of n ranks living in this process.
func LocalGroup(n int) (*Group, error) {
	var p *C.fsdp_local_group_t
	if err := call("fsdp_local_group_create", func() C.fsdp_status_t {
		return C.fsdp_local_group_create(C.int(n), &p)
	}); err != nil {
		return nil, err
	}
	return &Group{ptr: p, size: n}, nil
}

// Size is the number of ranks of the group.
func (g *Group) Size() int { return g.size }

// Close frees the group (its memory lives on until its last Context is
// closed, so the order does not matter); calling it again does nothing.
func (g *Group) Close() {
	if g != nil && g.ptr != nil {
		C.fsdp_local_group_destroy(g.ptr)
		g.ptr = nil
	}
}

// Abort fails every collective of every Context on the group, in progress or
// to come, at once with ErrComm and a message carrying reason, and no new
// Context can join the group. It is for when one rank fails and the others
// must not wait out timeout_s; RunRanks calls it. Abort may be called from any
// goroutine while others wait in collectives; a second call changes nothing.
func (g *Group) Abort(reason string) error {
	if g == nil || g.ptr == nil {
		return closedError("Group")
	}
	cs := C.CString(reason)
	defer C.free(unsafe.Pointer(cs))
	return call("fsdp_local_group_abort", func() C.fsdp_status_t { return C.fsdp_local_group_abort(g.ptr, cs) })
}

// RunRanks runs fn for ranks 0..n-1 of a new local Group, each on its own
// goroutine locked to its own OS thread, waits for all, closes the group and
// returns the first error (a panic in fn becomes an error). When a rank fails
// it aborts the group, so the other ranks' collectives fail at once with
// ErrComm naming that rank and its error instead of waiting out timeout_s;
// the error returned is the failed rank's own.
func RunRanks(n int, fn func(rank int, g *Group) error) error {
	g, err := LocalGroup(n)
	if err != nil {
		return err
	}
	defer g.Close()
	var (
		wg    sync.WaitGroup
		once  sync.Once
		first error
	)
	for r := 0; r < n; r++ {
		wg.Add(1)
		go func(rank int) {
			defer wg.Done()
			runtime.LockOSThread()
			defer runtime.UnlockOSThread()
			err := func() (err error) {
				defer func() {
					if p := recover(); p != nil {
						err = fmt.Errorf("rank %d panicked: %v", rank, p)
					}
				}()
				return fn(rank, g)
			}()
			if err != nil {
				once.Do(func() {
					first = fmt.Errorf("rank %d: %w", rank, err)
					// The group is still open: it is closed after wg.Wait.
					_ = g.Abort(fmt.Sprintf("rank %d failed: %v", rank, err))
				})
			}
		}(r)
	}
	wg.Wait()
	return first
}

// Context is one rank's view of the job. It owns its units.
type Context struct {
	ptr    *C.fsdp_ctx_t
	units  []*Unit
	device string // "cpu" or "cuda:N": where unit buffers live
}

// NewContext (collective) creates this rank's context. group nil means a
// world of one (rank 0) or, with comm=mpi, a process of an mpirun job
// (rank -1). The config is copied.
func NewContext(cfg *Config, group *Group, rank int) (*Context, error) {
	if cfg == nil || cfg.ptr == nil {
		return nil, closedError("Config")
	}
	var gp *C.fsdp_local_group_t
	if group != nil {
		if group.ptr == nil {
			return nil, closedError("Group")
		}
		gp = group.ptr
	}
	device, err := cfg.Get("device")
	if err != nil {
		return nil, err
	}
	var p *C.fsdp_ctx_t
	if err := call("fsdp_ctx_create", func() C.fsdp_status_t {
		return C.fsdp_ctx_create(cfg.ptr, gp, C.int(rank), &p)
	}); err != nil {
		return nil, err
	}
	return &Context{ptr: p, device: device}, nil
}

// Device is where the context's unit buffers live: "cpu" or "cuda:N". On
// CUDA, Param/Grad slices cannot be made (the host cannot read GPU memory);
// use ParamPtr/GradPtr with a CUDA library.
func (c *Context) Device() string { return c.device }

func (c *Context) live(op string) error {
	if c == nil || c.ptr == nil {
		return newError(op, StatusInvalidState, "Context is closed")
	}
	return nil
}

// intCall runs a getter returning a C int.
func (c *Context) intCall(op string, f func(*C.int) C.fsdp_status_t) (int, error) {
	if err := c.live(op); err != nil {
		return 0, err
	}
	var v C.int
	err := call(op, func() C.fsdp_status_t { return f(&v) })
	return int(v), err
}

// Rank of this context.
func (c *Context) Rank() (int, error) {
	return c.intCall("fsdp_ctx_rank", func(v *C.int) C.fsdp_status_t { return C.fsdp_ctx_rank(c.ptr, v) })
}

// WorldSize of the job.
func (c *Context) WorldSize() (int, error) {
	return c.intCall("fsdp_ctx_world_size", func(v *C.int) C.fsdp_status_t { return C.fsdp_ctx_world_size(c.ptr, v) })
}

// Dtype is the dtype of the buffers behind Param and Grad.
type Dtype int

// The dtypes of fsdp.h.
const (
	FP32 Dtype = C.FSDP_DTYPE_FP32
	BF16 Dtype = C.FSDP_DTYPE_BF16
	FP16 Dtype = C.FSDP_DTYPE_FP16
)

func (d Dtype) String() string {
	switch d {
	case FP32:
		return "fp32"
	case BF16:
		return "bf16"
	case FP16:
		return "fp16"
	}
	return fmt.Sprintf("Dtype(%d)", int(d))
}

// ParamDtype is the dtype of the full params and grads the host computes with.
func (c *Context) ParamDtype() (Dtype, error) {
	if err := c.live("fsdp_ctx_param_dtype"); err != nil {
		return FP32, err
	}
	var d C.fsdp_dtype_t
	err := call("fsdp_ctx_param_dtype", func() C.fsdp_status_t { return C.fsdp_ctx_param_dtype(c.ptr, &d) })
	return Dtype(d), err
}

// AsyncError is a failure found after the call that caused it returned (nil if none).
func (c *Context) AsyncError() error {
	if err := c.live("fsdp_ctx_async_error"); err != nil {
		return err
	}
	return call("fsdp_ctx_async_error", func() C.fsdp_status_t { return C.fsdp_ctx_async_error(c.ptr) })
}

// simple runs a C call on the live context.
func (c *Context) simple(op string, f func() C.fsdp_status_t) error {
	if err := c.live(op); err != nil {
		return err
	}
	return call(op, f)
}

// Step (collective) runs the optimizer on this rank's shards and zeroes the
// grads. On CUDA it waits for the legacy default stream; StepOn takes the
// host's stream.
func (c *Context) Step() error { return c.StepOn(DefaultStream) }

// SetLR sets the learning rate of the following steps.
func (c *Context) SetLR(lr float64) error {
	return c.simple("fsdp_set_lr", func() C.fsdp_status_t { return C.fsdp_set_lr(c.ptr, C.double(lr)) })
}

// SetParamGroup (collective, between steps) sets options ("lr_scale=0.1;
// beta2=0.95"; keys lr_scale, weight_decay, beta1, beta2) on every param
// whose name matches the glob pattern, and returns how many it set.
func (c *Context) SetParamGroup(pattern, options string) (int, error) {
	cp, co := C.CString(pattern), C.CString(options)
	defer C.free(unsafe.Pointer(cp))
	defer C.free(unsafe.Pointer(co))
	var n C.size_t
	err := c.simple("fsdp_set_param_group", func() C.fsdp_status_t { return C.fsdp_set_param_group(c.ptr, cp, co, &n) })
	return int(n), err
}

// SetGradSync(false) accumulates grads locally without communication (no_sync).
func (c *Context) SetGradSync(enabled bool) error {
	e := C.int(0)
	if enabled {
		e = 1
	}
	return c.simple("fsdp_set_grad_sync", func() C.fsdp_status_t { return C.fsdp_set_grad_sync(c.ptr, e) })
}

// LossScale is the scale to multiply the loss by, and the number of skipped steps.
func (c *Context) LossScale() (scale float64, skipped uint64, err error) {
	var s C.double
	var n C.uint64_t
	err = c.simple("fsdp_loss_scale", func() C.fsdp_status_t { return C.fsdp_loss_scale(c.ptr, &s, &n) })
	return float64(s), uint64(n), err
}

// LossScalePtr is where the steps keep the loss scale (one float64;
// fsdp_loss_scale_device): GPU memory on a CUDA context, for a loss kernel to
// read in stream order after the last Step without the host wait of LossScale.
func (c *Context) LossScalePtr() (unsafe.Pointer, error) {
	var p *C.double
	err := c.simple("fsdp_loss_scale_device", func() C.fsdp_status_t { return C.fsdp_loss_scale_device(c.ptr, &p) })
	return unsafe.Pointer(p), err
}

// LastGradNorm is the global grad norm of the last Step, before clipping.
func (c *Context) LastGradNorm() (float64, error) {
	var v C.double
	err := c.simple("fsdp_last_grad_norm", func() C.fsdp_status_t { return C.fsdp_last_grad_norm(c.ptr, &v) })
	return float64(v), err
}

// StepCount is the optimizer's step count: the Steps that updated the params
// (skipped ones not counted), as Load restores it.
func (c *Context) StepCount() (uint64, error) {
	var v C.uint64_t
	err := c.simple("fsdp_ctx_step", func() C.fsdp_status_t { return C.fsdp_ctx_step(c.ptr, &v) })
	return uint64(v), err
}

// ReduceOp is how MetricsReduce combines the ranks' values.
type ReduceOp int

// The ops of fsdp_reduce_op_t.
const (
	ReduceSum ReduceOp = C.FSDP_REDUCE_SUM
	ReduceAvg ReduceOp = C.FSDP_REDUCE_AVG
	ReduceMax ReduceOp = C.FSDP_REDUCE_MAX
	ReduceMin ReduceOp = C.FSDP_REDUCE_MIN
)

func (op ReduceOp) String() string {
	switch op {
	case ReduceSum:
		return "sum"
	case ReduceAvg:
		return "avg"
	case ReduceMax:
		return "max"
	case ReduceMin:
		return "min"
	}
	return fmt.Sprintf("ReduceOp(%d)", int(op))
}

// MetricsReduce (collective) replaces values, on every rank, by their sum,
// mean, maximum or minimum over the ranks, combined in rank order so that
// every rank gets the same bits. It is for the host's metrics (a step's mean
// loss, token counts), not tensors: at most 2^20 values, and len(values) must
// be the same on every rank (nil or empty is fine: the ranks still meet). The
// library does not keep the slice after the call.
func (c *Context) MetricsReduce(values []float64, op ReduceOp) error {
	if err := c.live("fsdp_metrics_reduce"); err != nil {
		return err
	}
	var p *C.double
	if len(values) > 0 {
		p = (*C.double)(unsafe.Pointer(&values[0]))
	}
	return call("fsdp_metrics_reduce", func() C.fsdp_status_t {
		return C.fsdp_metrics_reduce(c.ptr, p, C.size_t(len(values)), C.fsdp_reduce_op_t(op))
	})
}

// MemoryStats are the bytes this rank holds, by category (fsdp_memory_stats_t).
type MemoryStats struct {
	ShardedParams, ShardedGrads, OptimizerState          uint64
	GatheredParams, GatheredParamsPeak                   uint64
	UnshardedGrads, UnshardedGradsPeak                   uint64
	Total, TotalPeak, Device, DevicePeak, Host, HostPeak uint64
	FreeSlots                                            uint64 // gather and grad slots no unit holds now
	SecondaryParams, SecondaryParamsPeak                 uint64 // secondary_shard's kept slices
}

// MemoryStats returns this rank's memory by category.
func (c *Context) MemoryStats() (MemoryStats, error) {
	var s C.fsdp_memory_stats_t
	s.struct_size = C.size_t(unsafe.Sizeof(s))
	if err := c.simple("fsdp_memory_stats", func() C.fsdp_status_t { return C.fsdp_memory_stats(c.ptr, &s) }); err != nil {
		return MemoryStats{}, err
	}
	return MemoryStats{
		ShardedParams: uint64(s.sharded_params_nbytes), ShardedGrads: uint64(s.sharded_grads_nbytes),
		OptimizerState: uint64(s.optimizer_state_nbytes),
		GatheredParams: uint64(s.gathered_params_nbytes), GatheredParamsPeak: uint64(s.gathered_params_peak_nbytes),
		UnshardedGrads: uint64(s.unsharded_grads_nbytes), UnshardedGradsPeak: uint64(s.unsharded_grads_peak_nbytes),
		Total: uint64(s.total_nbytes), TotalPeak: uint64(s.total_peak_nbytes),
		Device: uint64(s.device_nbytes), DevicePeak: uint64(s.device_peak_nbytes),
		Host: uint64(s.host_nbytes), HostPeak: uint64(s.host_peak_nbytes),
		FreeSlots:       uint64(s.free_slots_nbytes),
		SecondaryParams: uint64(s.secondary_params_nbytes), SecondaryParamsPeak: uint64(s.secondary_params_peak_nbytes),
	}, nil
}

// CommStats is what this rank's collectives moved since the Context was made
// or ResetCommStats (fsdp_comm_stats_t): calls, and bytes of each
// collective's data as the caller sees it.
type CommStats struct {
	AllGatherCalls, AllGatherBytes         uint64
	ReduceScatterCalls, ReduceScatterBytes uint64
	AllReduceCalls, AllReduceBytes         uint64
	BroadcastCalls, BroadcastBytes         uint64
	ControlCalls                           uint64 // norms, flags, consensus checks, barriers
	HostWaits                              uint64 // calls that blocked the calling thread on queued work (0 for a steady-state step)
	AllToAllCalls, AllToAllBytes           uint64 // the quantized grad reduction (reduce_dtype=int8 or fp8_e4m3)
	// The bytes above by the group of ranks they ran over.
	WorldGroupBytes, ShardGroupBytes, ReplicaGroupBytes, SecondaryGroupBytes uint64
}

// CommStats returns this rank's collective counters.
func (c *Context) CommStats() (CommStats, error) {
	var s C.fsdp_comm_stats_t
	s.struct_size = C.size_t(unsafe.Sizeof(s))
	if err := c.simple("fsdp_comm_stats", func() C.fsdp_status_t { return C.fsdp_comm_stats(c.ptr, &s) }); err != nil {
		return CommStats{}, err
	}
	return CommStats{
		AllGatherCalls: uint64(s.all_gather_calls), AllGatherBytes: uint64(s.all_gather_nbytes),
		ReduceScatterCalls: uint64(s.reduce_scatter_calls), ReduceScatterBytes: uint64(s.reduce_scatter_nbytes),
		AllReduceCalls: uint64(s.all_reduce_calls), AllReduceBytes: uint64(s.all_reduce_nbytes),
		BroadcastCalls: uint64(s.broadcast_calls), BroadcastBytes: uint64(s.broadcast_nbytes),
		ControlCalls: uint64(s.control_calls), HostWaits: uint64(s.host_waits),
		AllToAllCalls: uint64(s.all_to_all_calls), AllToAllBytes: uint64(s.all_to_all_nbytes),
		WorldGroupBytes: uint64(s.world_group_nbytes), ShardGroupBytes: uint64(s.shard_group_nbytes),
		ReplicaGroupBytes: uint64(s.replica_group_nbytes), SecondaryGroupBytes: uint64(s.secondary_group_nbytes),
	}, nil
}

// ResetCommStats restarts this rank's collective counters from zero.
func (c *Context) ResetCommStats() error {
	return c.simple("fsdp_comm_stats_reset", func() C.fsdp_status_t { return C.fsdp_comm_stats_reset(c.ptr) })
}

// ResetPeakMemory restarts the peaks from the current values.
func (c *Context) ResetPeakMemory() error {
	return c.simple("fsdp_memory_stats_reset_peak", func() C.fsdp_status_t { return C.fsdp_memory_stats_reset_peak(c.ptr) })
}

// TraceBegin starts (or restarts) recording this rank's timeline.
func (c *Context) TraceBegin() error {
	return c.simple("fsdp_trace_begin", func() C.fsdp_status_t { return C.fsdp_trace_begin(c.ptr) })
}

// TraceWrite writes what was recorded as Chrome trace JSON to path.
func (c *Context) TraceWrite(path string) error {
	if err := c.live("fsdp_trace_write"); err != nil {
		return err
	}
	return withCString(path, func(p *C.char) error {
		return call("fsdp_trace_write", func() C.fsdp_status_t { return C.fsdp_trace_write(c.ptr, p) })
	})
}

// Finalize (collective) waits for outstanding collectives; afterwards every
// call but Close fails with ErrInvalidState.
func (c *Context) Finalize() error {
	return c.simple("fsdp_ctx_finalize", func() C.fsdp_status_t { return C.fsdp_ctx_finalize(c.ptr) })
}

// Close frees the context and its units (local, never waits); calling it
// again does nothing. Units of a closed context return errors.
func (c *Context) Close() {
	if c != nil && c.ptr != nil {
		C.fsdp_ctx_destroy(c.ptr)
		c.ptr = nil
		for _, u := range c.units {
			u.ptr = nil
		}
		c.units = nil
	}
}
