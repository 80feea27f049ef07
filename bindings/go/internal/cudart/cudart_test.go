package cudart

import (
	"strings"
	"testing"
)

func TestCandidates(t *testing.T) {
	t.Setenv("FSDP_CUDART_LIBRARY", "")
	t.Setenv("CUDA_HOME", "/opt/cuda-x")
	c := Candidates()
	if c[0] != "libcudart.so.13" || c[1] != "/opt/cuda-x/lib64/libcudart.so.13" || c[len(c)-1] != "libcudart.so" {
		t.Fatalf("candidates: %v", c)
	}
	t.Setenv("FSDP_CUDART_LIBRARY", "/x/libcudart.so.13")
	if c := Candidates(); len(c) != 1 || c[0] != "/x/libcudart.so.13" {
		t.Fatalf("with FSDP_CUDART_LIBRARY: %v", c)
	}
	t.Setenv("FSDP_CUDART_LIBRARY", "/nonexistent/libcudart.so.13")
	if err := Open(); err == nil || !strings.Contains(err.Error(), "/nonexistent/libcudart.so.13") {
		t.Fatalf("Open of a missing runtime: %v", err)
	}
}
