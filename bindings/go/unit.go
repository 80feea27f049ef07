// unit.go - Unit: a group of params gathered and freed together; the forward
// and backward blocks, zero-copy Param/Grad slices, values in and out.

package fsdp

// #include <stdlib.h>
// #include "fsdp.h"
import "C"

import (
	"fmt"
	"unsafe"
)

// Param describes one parameter of a unit: its name and row-major shape.
type Param struct {
	Name  string
	Shape []int64
}

// Numel is the element count of the shape.
func (p Param) Numel() int {
	n := 1
	for _, d := range p.Shape {
		n *= int(d)
	}
	return n
}

// Unit is a registered unit; it belongs to its Context and is freed with it.
type Unit struct {
	ptr    *C.fsdp_unit_t
	ctx    *Context
	name   string
	params []Param
	dtype  Dtype
}

// RegisterUnit (collective) registers a unit of params; every rank must
// register the same units in the same order (else ErrMismatch).
func (c *Context) RegisterUnit(name string, params []Param) (*Unit, error) {
	return c.register("fsdp_unit_register", name, params, nil)
}

// RegisterUnitTrainable is RegisterUnit with each param's trainable flag from
// the start (fsdp_unit_register_trainable): a param registered false is
// frozen and never gets grad or optimizer memory (a frozen base of a
// fine-tuning run); a unit whose params are all false is frozen as a whole.
// len(trainable) must be len(params); the flags are part of what the ranks
// must agree on.
func (c *Context) RegisterUnitTrainable(name string, params []Param, trainable []bool) (*Unit, error) {
	if len(trainable) != len(params) {
		return nil, newError("fsdp_unit_register_trainable", StatusInvalidArgument,
			fmt.Sprintf("%d trainable flags for %d params", len(trainable), len(params)))
	}
	return c.register("fsdp_unit_register_trainable", name, params, trainable)
}

func (c *Context) register(op, name string, params []Param, trainable []bool) (*Unit, error) {
	if err := c.live(op); err != nil {
		return nil, err
	}
	dt, err := c.ParamDtype()
	if err != nil {
		return nil, err
	}
	n := len(params)
	names := make([]*C.char, n+1) // +1: never a zero-length slice to take &[0] of
	ndims := make([]C.int32_t, n+1)
	var dims []C.int64_t
	for i, p := range params {
		names[i] = C.CString(p.Name)
		defer C.free(unsafe.Pointer(names[i]))
		ndims[i] = C.int32_t(len(p.Shape))
		for _, d := range p.Shape {
			dims = append(dims, C.int64_t(d))
		}
	}
	dims = append(dims, 0)
	cname := C.CString(name)
	defer C.free(unsafe.Pointer(cname))
	flags := make([]C.int32_t, n+1)
	for i, t := range trainable {
		if t {
			flags[i] = 1
		}
	}
	var p *C.fsdp_unit_t
	if err := call(op, func() C.fsdp_status_t {
		if trainable == nil {
			return C.fsdp_unit_register(c.ptr, cname, C.size_t(n), &names[0], &ndims[0], &dims[0], &p)
		}
		return C.fsdp_unit_register_trainable(c.ptr, cname, C.size_t(n), &names[0], &ndims[0], &dims[0], &flags[0], &p)
	}); err != nil {
		return nil, err
	}
	cp := make([]Param, n)
	for i, q := range params {
		cp[i] = Param{Name: q.Name, Shape: append([]int64(nil), q.Shape...)}
	}
	u := &Unit{ptr: p, ctx: c, name: name, params: cp, dtype: dt}
	c.units = append(c.units, u)
	return u, nil
}

// Name of the unit.
func (u *Unit) Name() string { return u.name }

// Params of the unit (a copy).
func (u *Unit) Params() []Param { return append([]Param(nil), u.params...) }

func (u *Unit) live(op string) error {
	if u == nil || u.ptr == nil || u.ctx == nil || u.ctx.ptr == nil {
		return newError(op, StatusInvalidState, "the Unit's Context is closed")
	}
	return nil
}

func (u *Unit) simple(op string, f func() C.fsdp_status_t) error {
	if err := u.live(op); err != nil {
		return err
	}
	return call(op, f)
}

// checkIndex rejects a bad index before it reaches Go slicing code.
func (u *Unit) checkIndex(op string, i int) error {
	if err := u.live(op); err != nil {
		return err
	}
	if i < 0 || i >= len(u.params) {
		return newError(op, StatusInvalidArgument,
			fmt.Sprintf("param index %d out of range: unit %q has %d params", i, u.name, len(u.params)))
	}
	return nil
}

// SetValues sets param i from its full fp32 values (len must be the param's
// element count; this rank keeps its slice). With sync_module_states=1 it is
// collective and ranks other than 0 may pass nil.
func (u *Unit) SetValues(i int, values []float32) error {
	if err := u.checkIndex("fsdp_param_set_values", i); err != nil {
		return err
	}
	var p *C.float
	n := len(values)
	if n > 0 {
		p = (*C.float)(unsafe.Pointer(&values[0]))
	} else {
		n = u.params[i].Numel()
	}
	return call("fsdp_param_set_values", func() C.fsdp_status_t {
		return C.fsdp_param_set_values(u.ptr, C.size_t(i), p, C.size_t(n))
	})
}

// SetWeightDecay overrides the weight decay of param i (0 for biases, norms).
func (u *Unit) SetWeightDecay(i int, wd float64) error {
	if err := u.checkIndex("fsdp_param_set_weight_decay", i); err != nil {
		return err
	}
	return call("fsdp_param_set_weight_decay", func() C.fsdp_status_t {
		return C.fsdp_param_set_weight_decay(u.ptr, C.size_t(i), C.double(wd))
	})
}

// SetTrainable (collective, between steps) freezes the unit (false: no
// grads, no optimizer state, no reduction; its backward still gathers the
// params) or unfreezes it (true: zero grads, fresh optimizer state).
func (u *Unit) SetTrainable(trainable bool) error {
	t := C.int(0)
	if trainable {
		t = 1
	}
	return u.simple("fsdp_unit_set_trainable", func() C.fsdp_status_t {
		return C.fsdp_unit_set_trainable(u.ctx.ptr, u.ptr, t)
	})
}

// Trainable reports whether the unit trains (false once frozen).
func (u *Unit) Trainable() (bool, error) {
	var t C.int
	err := u.simple("fsdp_unit_trainable", func() C.fsdp_status_t { return C.fsdp_unit_trainable(u.ptr, &t) })
	return t == 1, err
}

// SetParamTrainable freezes (false) or unfreezes (true) param i alone
// (fsdp_param_set_trainable): collective, between steps. The unit lays its
// frozen params out in a block of their own, with no grads, no optimizer
// state and no bytes in the reduction; slices taken before (ShardInfo)
// point into the old layout and must be taken again.
func (u *Unit) SetParamTrainable(i int, trainable bool) error {
	if err := u.checkIndex("fsdp_param_set_trainable", i); err != nil {
		return err
	}
	t := C.int(0)
	if trainable {
		t = 1
	}
	return u.simple("fsdp_param_set_trainable", func() C.fsdp_status_t {
		return C.fsdp_param_set_trainable(u.ctx.ptr, u.ptr, C.size_t(i), t)
	})
}

// ParamTrainable reports whether param i trains (false once frozen in its unit).
func (u *Unit) ParamTrainable(i int) (bool, error) {
	if err := u.checkIndex("fsdp_param_trainable", i); err != nil {
		return false, err
	}
	var t C.int
	err := u.simple("fsdp_param_trainable", func() C.fsdp_status_t {
		return C.fsdp_param_trainable(u.ptr, C.size_t(i), &t)
	})
	return t == 1, err
}

// ShardTensors (optimizer=host, between StepBegin and StepEnd) is this
// rank's shard of the unit as slices over library memory: the fp32 master,
// the reduced grads and the nStates (host_state) buffers libfsdp keeps.
// CPU contexts only.
func (u *Unit) ShardTensors(nStates int) (params, grads []float32, states [][]float32, err error) {
	if err := u.hostOnly("fsdp_shard_tensors"); err != nil {
		return nil, nil, nil, err
	}
	if nStates < 0 || nStates > 8 {
		return nil, nil, nil, newError("fsdp_shard_tensors", StatusInvalidArgument, "nStates must be 0..8")
	}
	var p, g *C.float
	var n C.size_t
	ptrs := make([]*C.float, 8)
	err = u.simple("fsdp_shard_tensors", func() C.fsdp_status_t {
		return C.fsdp_shard_tensors(u.ctx.ptr, u.ptr, &p, &g, &ptrs[0], C.size_t(nStates), &n)
	})
	if err != nil {
		return nil, nil, nil, err
	}
	view := func(q *C.float) []float32 {
		if q == nil || n == 0 {
			return nil
		}
		return unsafe.Slice((*float32)(unsafe.Pointer(q)), int(n))
	}
	for i := 0; i < nStates; i++ {
		states = append(states, view(ptrs[i]))
	}
	return view(p), view(g), states, nil
}

// ForwardBegin (collective) makes the full params usable through Param. On
// CUDA it orders against the legacy default stream; ForwardBeginOn takes the
// host's stream (stream.go).
func (u *Unit) ForwardBegin() error { return u.ForwardBeginOn(DefaultStream) }

// ForwardEnd ends the forward block; Param slices become invalid.
func (u *Unit) ForwardEnd() error { return u.ForwardEndOn(DefaultStream) }

// BackwardBegin (collective) makes the params and zeroed grad buffers usable.
func (u *Unit) BackwardBegin() error { return u.BackwardBeginOn(DefaultStream) }

// BackwardEnd (collective) reduces the grads; Param and Grad slices become invalid.
func (u *Unit) BackwardEnd() error { return u.BackwardEndOn(DefaultStream) }

// raw returns the library pointer of param i (grad: the grad buffer).
func (u *Unit) raw(i int, grad bool, want16 bool) (unsafe.Pointer, error) {
	op := "fsdp_param_ptr"
	if grad {
		op = "fsdp_grad_ptr"
	}
	if err := u.checkIndex(op, i); err != nil {
		return nil, err
	}
	if is16 := u.dtype != FP32; is16 != want16 {
		acc := "Param/Grad"
		if is16 {
			acc = "ParamU16/GradU16"
		}
		return nil, newError(op, StatusInvalidArgument, fmt.Sprintf("param_dtype is %v: use %s", u.dtype, acc))
	}
	var p unsafe.Pointer
	err := call(op, func() C.fsdp_status_t {
		if grad {
			return C.fsdp_grad_ptr(u.ptr, C.size_t(i), &p)
		}
		return C.fsdp_param_ptr(u.ptr, C.size_t(i), &p)
	})
	if err == nil && p == nil && u.params[i].Numel() > 0 {
		err = newError(op, StatusInternal, "library returned a NULL pointer")
	}
	return p, err
}

// hostOnly refuses a Go slice over memory the host cannot read.
func (u *Unit) hostOnly(op string) error {
	if d := u.ctx.device; d != "cpu" {
		return newError(op, StatusUnsupported, fmt.Sprintf(
			"the context runs on %s: its buffers are GPU memory, which a Go slice cannot view; use ParamPtr/GradPtr with a CUDA library", d))
	}
	return nil
}

// ParamPtr is param i's full values (param dtype) as a pointer on the
// context's device (Device()): GPU memory on CUDA. Valid as Param's slice is.
func (u *Unit) ParamPtr(i int) (unsafe.Pointer, error) {
	return u.raw(i, false, u.dtype != FP32)
}

// GradPtr is param i's grad buffer (param dtype) as a pointer on the
// context's device. Valid as Grad's slice is; add grads into it.
func (u *Unit) GradPtr(i int) (unsafe.Pointer, error) {
	return u.raw(i, true, u.dtype != FP32)
}

// Param is param i's full values, a slice over library memory valid only
// until the end of the current forward or backward block. Read only.
// fp32 contexts only (else ParamU16).
func (u *Unit) Param(i int) ([]float32, error) {
	if err := u.hostOnly("fsdp_param_ptr"); err != nil {
		return nil, err
	}
	p, err := u.raw(i, false, false)
	if err != nil || p == nil {
		return nil, err
	}
	return unsafe.Slice((*float32)(p), u.params[i].Numel()), nil
}

// Grad is param i's grad buffer, a slice over library memory valid only
// between BackwardBegin and BackwardEnd. Add grads into it. fp32 only.
func (u *Unit) Grad(i int) ([]float32, error) {
	if err := u.hostOnly("fsdp_grad_ptr"); err != nil {
		return nil, err
	}
	p, err := u.raw(i, true, false)
	if err != nil || p == nil {
		return nil, err
	}
	return unsafe.Slice((*float32)(p), u.params[i].Numel()), nil
}

// GradAccumulate adds g (the param's element count of fp32 values) into
// param i's grad as the host's own add into Grad would (each element in fp32,
// rounded once to the param dtype), for grads held in Go memory: any param
// dtype, no 16-bit conversion of one's own. CPU contexts (the add is done
// when it returns); on a GPU, GradAccumulateOn with device memory.
func (u *Unit) GradAccumulate(i int, g []float32) error {
	var p unsafe.Pointer
	if len(g) > 0 {
		p = unsafe.Pointer(&g[0])
	}
	return u.accumulateHost(i, p, len(g), FP32)
}

// GradAccumulateU16 is GradAccumulate for raw bf16 or fp16 values (dtype BF16
// or FP16), whatever the context's param dtype.
func (u *Unit) GradAccumulateU16(i int, g []uint16, dtype Dtype) error {
	if dtype != BF16 && dtype != FP16 {
		return newError("fsdp_grad_accumulate", StatusInvalidArgument,
			fmt.Sprintf("dtype %v: 16-bit values are BF16 or FP16", dtype))
	}
	var p unsafe.Pointer
	if len(g) > 0 {
		p = unsafe.Pointer(&g[0])
	}
	return u.accumulateHost(i, p, len(g), dtype)
}

func (u *Unit) accumulateHost(i int, p unsafe.Pointer, n int, dtype Dtype) error {
	if err := u.checkIndex("fsdp_grad_accumulate", i); err != nil {
		return err
	}
	if d := u.ctx.device; d != "cpu" {
		return newError("fsdp_grad_accumulate", StatusUnsupported, fmt.Sprintf(
			"the context runs on %s, whose kernels cannot read Go memory; use GradAccumulateOn with device memory", d))
	}
	if n != u.params[i].Numel() {
		return newError("fsdp_grad_accumulate", StatusInvalidArgument,
			fmt.Sprintf("param %q has %d elements, not %d", u.params[i].Name, u.params[i].Numel(), n))
	}
	// Go memory: the call (on the CPU's NULL stream) is done with it when it returns.
	return call("fsdp_grad_accumulate", func() C.fsdp_status_t {
		return C.fsdp_grad_accumulate(u.ptr, C.size_t(i), p, C.fsdp_dtype_t(dtype), C.size_t(n), nil)
	})
}

// ParamU16 is Param for bf16/fp16 contexts: the raw 16-bit values.
func (u *Unit) ParamU16(i int) ([]uint16, error) {
	if err := u.hostOnly("fsdp_param_ptr"); err != nil {
		return nil, err
	}
	p, err := u.raw(i, false, true)
	if err != nil || p == nil {
		return nil, err
	}
	return unsafe.Slice((*uint16)(p), u.params[i].Numel()), nil
}

// GradU16 is Grad for bf16/fp16 contexts: the raw 16-bit values.
func (u *Unit) GradU16(i int) ([]uint16, error) {
	if err := u.hostOnly("fsdp_grad_ptr"); err != nil {
		return nil, err
	}
	p, err := u.raw(i, true, true)
	if err != nil || p == nil {
		return nil, err
	}
	return unsafe.Slice((*uint16)(p), u.params[i].Numel()), nil
}

// Gather (collective) returns a copy of param i's full fp32 master values.
// Only while no unit is in use.
func (u *Unit) Gather(i int) ([]float32, error) {
	return u.gatherFull("fsdp_gather_param", i, func(out *C.float, n C.size_t) C.fsdp_status_t {
		return C.fsdp_gather_param(u.ptr, C.size_t(i), out, n)
	})
}

// GatherGrad (collective) returns a copy of param i's reduced fp32 grad: what
// the grad shards hold after backward, before Step unscales and clips it (for
// tests and debugging). Only while no unit is in use and no grads wait
// unreduced under SetGradSync(false).
func (u *Unit) GatherGrad(i int) ([]float32, error) {
	return u.gatherFull("fsdp_gather_grad", i, func(out *C.float, n C.size_t) C.fsdp_status_t {
		return C.fsdp_gather_grad(u.ptr, C.size_t(i), out, n)
	})
}

// gatherFull runs fsdp_gather_param or fsdp_gather_grad into a new slice of
// param i's element count.
func (u *Unit) gatherFull(what string, i int, fn func(out *C.float, n C.size_t) C.fsdp_status_t) ([]float32, error) {
	if err := u.checkIndex(what, i); err != nil {
		return nil, err
	}
	n := u.params[i].Numel()
	out := make([]float32, n+1) // +1: &out[0] exists for n == 0
	err := call(what, func() C.fsdp_status_t { return fn((*C.float)(unsafe.Pointer(&out[0])), C.size_t(n)) })
	if err != nil {
		return nil, err
	}
	return out[:n], nil
}

// ShardInfo is this rank's flat fp32 master shard of the unit: its offset in
// the unit's flat buffer and a slice over it (library memory, valid while the
// Context lives).
func (u *Unit) ShardInfo() (offset int, shard []float32, err error) {
	if err = u.hostOnly("fsdp_shard_info"); err != nil {
		return 0, nil, err
	}
	var p *C.float
	var off, n C.size_t
	if err = u.simple("fsdp_shard_info", func() C.fsdp_status_t { return C.fsdp_shard_info(u.ptr, &p, &off, &n) }); err != nil {
		return 0, nil, err
	}
	if p != nil && n > 0 {
		shard = unsafe.Slice((*float32)(unsafe.Pointer(p)), int(n))
	}
	return int(off), shard, nil
}

// FlatRange is where param i lies in the unit's flat buffer.
func (u *Unit) FlatRange(i int) (offset, numel int, err error) {
	if err = u.checkIndex("fsdp_param_flat_range", i); err != nil {
		return 0, 0, err
	}
	var off, n C.size_t
	err = call("fsdp_param_flat_range", func() C.fsdp_status_t {
		return C.fsdp_param_flat_range(u.ptr, C.size_t(i), &off, &n)
	})
	return int(off), int(n), err
}
