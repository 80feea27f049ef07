package fsdp

import (
	"errors"
	"strings"
	"testing"
)

// On a CUDA context the host-memory accessors refuse (a Go slice over GPU
// memory would crash the program on first use) and name the pointer
// accessors instead. The refusal is checked before any library call, so a
// Unit of a context that says it runs on cuda:0 shows it without a GPU.
func TestSlicesAreRefusedOnACudaContext(t *testing.T) {
	u := &Unit{ctx: &Context{device: "cuda:0"}, params: []Param{{Name: "w", Shape: []int64{2, 3}}}, dtype: FP32}
	_, err := u.Param(0)
	if !errors.Is(err, ErrUnsupported) || !strings.Contains(err.Error(), "ParamPtr") {
		t.Fatalf("Param on cuda:0: got %v, want ErrUnsupported naming ParamPtr", err)
	}
	if _, err := u.Grad(0); !errors.Is(err, ErrUnsupported) {
		t.Fatalf("Grad on cuda:0: got %v", err)
	}
	if _, _, err := u.ShardInfo(); !errors.Is(err, ErrUnsupported) {
		t.Fatalf("ShardInfo on cuda:0: got %v", err)
	}
	cpu := &Unit{ctx: &Context{device: "cpu"}}
	if err := cpu.hostOnly("fsdp_param_ptr"); err != nil {
		t.Fatalf("a cpu context must allow slices: %v", err)
	}
}

// The *On calls hand their Stream to the library: on a CPU context only the
// NULL stream is accepted, so a non-zero one comes back refused by libfsdp
// itself, and DefaultStream trains as the plain calls do (the CPU half of
// cuda_test.go's comparison).
func TestStreamsReachTheLibrary(t *testing.T) {
	ctx, err := gpuContext("cpu", nil, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer ctx.Close()
	u, err := ctx.RegisterUnit("u", []Param{{Name: "w", Shape: []int64{3}}})
	if err != nil {
		t.Fatal(err)
	}
	for name, call := range map[string]func() error{
		"fsdp_forward_begin":  func() error { return u.ForwardBeginOn(Stream(0x7000)) },
		"fsdp_backward_begin": func() error { return u.BackwardBeginOn(Stream(0x7000)) },
		"fsdp_step":           func() error { return ctx.StepOn(Stream(0x7000)) },
	} {
		err := call()
		if !errors.Is(err, ErrInvalidArgument) || !strings.Contains(err.Error(), "stream must be NULL on the cpu device") {
			t.Fatalf("%s with a stream on the CPU: got %v, want the library's refusal", name, err)
		}
	}
	if err := u.ForwardBeginOn(DefaultStream); err != nil {
		t.Fatal(err)
	}
	if err := u.ForwardEndOn(Stream(0x7000)); !errors.Is(err, ErrInvalidArgument) {
		t.Fatalf("ForwardEndOn with a stream on the CPU: %v", err)
	}
	if err := u.ForwardEndOn(DefaultStream); err != nil {
		t.Fatal(err)
	}
	if err := u.BackwardBeginOn(DefaultStream); err != nil {
		t.Fatal(err)
	}
	if err := u.BackwardEndOn(Stream(0x7000)); !errors.Is(err, ErrInvalidArgument) {
		t.Fatalf("BackwardEndOn with a stream on the CPU: %v", err)
	}
	if err := u.BackwardEndOn(DefaultStream); err != nil {
		t.Fatal(err)
	}
	w := runCUDA(t, "cpu", 2, true)
	init, _ := cudaInit()
	if len(w) != 2 || w[0][0] == init[0] {
		t.Fatalf("the CPU run of the GPU test's loop did not train: %v", w)
	}
}

func TestCUDADevice(t *testing.T) {
	for device, want := range map[string]int{"cuda:0": 0, "cuda:3": 3, "cpu": -1, "cuda:x": -1} {
		n, ok := (&Context{device: device}).CUDADevice()
		if (want >= 0) != ok || (ok && n != want) {
			t.Fatalf("CUDADevice of %q: %d, %v", device, n, ok)
		}
	}
}
