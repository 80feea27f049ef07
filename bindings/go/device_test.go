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
