// cuda_test.go - the binding on a CUDA context: training through ParamPtr and
// GradPtr, with the host's copies queued on the legacy default stream (the
// plain calls) or on a non-blocking stream of its own (the *On calls), gives
// the bits of the same loop on device=cpu, at world 1 and as 2 goroutine-ranks
// sharing the GPU. The grads land late on purpose (a long memset queued first
// on the host's stream), so a BackwardEnd that did not wait for that stream
// would reduce zeros. Skips, saying why, where no GPU is there to use; fails
// where nvidia-smi lists a GPU that CUDA cannot use (the rule of
// tests/gpu_presence.h), and for any reason with FSDP_REQUIRE_GPU=1.

package fsdp

import (
	"errors"
	"fmt"
	"math"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strings"
	"testing"
	"unsafe"

	"github.com/libfsdp/fsdp-go/internal/cudart"
)

// needGPU returns when this libfsdp has CUDA, the runtime loads and a
// context can be made on cuda:0; otherwise it skips, or fails (gpuMissing).
func needGPU(t *testing.T) {
	t.Helper()
	why, fail := "", false
	if !strings.Contains(BuildInfo(), "cuda") {
		why = "this libfsdp has no CUDA device (" + BuildInfo() + ")"
	} else if err := cudart.Open(); err != nil {
		why = err.Error()
	} else if ctx, err := gpuContext("cuda:0", nil, 0); err != nil {
		why = "no CUDA device can be used here: " + err.Error()
		if n := gpusListed(); n > 0 {
			why, fail = fmt.Sprintf("nvidia-smi -L lists %d GPU(s), but %s", n, why), true
		}
	} else {
		ctx.Close()
	}
	if why == "" {
		return
	}
	if fail || os.Getenv("FSDP_REQUIRE_GPU") == "1" {
		t.Fatalf("GPU test could not run: %s", why)
	}
	t.Skipf("GPU test not run: %s", why)
}

// gpusListed is how many GPUs `nvidia-smi -L` lists: 0 without it, or when
// CUDA_VISIBLE_DEVICES is "" or -1 (hidden on purpose).
func gpusListed() int {
	if v, set := os.LookupEnv("CUDA_VISIBLE_DEVICES"); set && (v == "" || strings.HasPrefix(v, "-")) {
		return 0
	}
	out, err := exec.Command("nvidia-smi", "-L").Output()
	if err != nil {
		return 0
	}
	n := 0
	for _, line := range strings.Split(string(out), "\n") {
		if strings.HasPrefix(line, "GPU ") {
			n++
		}
	}
	return n
}

func gpuContext(device string, g *Group, rank int) (*Context, error) {
	cfg, err := NewConfig()
	if err != nil {
		return nil, err
	}
	defer cfg.Close()
	for k, v := range map[string]string{"device": device, "sharding": "FULL_SHARD", "optimizer": "adamw",
		"lr": "0.05", "weight_decay": "0.01", "loss_scale": "off", "timeout_s": "60"} {
		if err := cfg.Set(k, v); err != nil {
			return nil, err
		}
	}
	return NewContext(cfg, g, rank)
}

const (
	cudaRows, cudaCols = 16, 12
	cudaSteps          = 4
	lateBytes          = 256 << 20 // memset 8 times before the grads: milliseconds on any GPU
)

func cudaInit() (w, target []float32) {
	n := cudaRows * cudaCols
	w, target = make([]float32, n), make([]float32, n)
	for k := range w {
		w[k] = float32(-1 + 2*float64(k)/float64(n-1))
		target[k] = float32(math.Cos(float64(k)))
	}
	return w, target
}

// gradOf is 2 (w - target) / world in float32, the same bits on both devices.
func gradOf(w, target []float32, world int, out []float32) {
	scale := float32(1.0 / float64(world))
	for k := range w {
		out[k] = (w[k] - target[k]) * 2 * scale
	}
}

// trainCUDA trains one rank; own: the host queues on a stream of its own
// and passes it (the *On calls), else on the legacy default stream.
func trainCUDA(device string, world, rank int, g *Group, own bool) ([]float32, error) {
	ctx, err := gpuContext(device, g, rank)
	if err != nil {
		return nil, err
	}
	defer ctx.Close()
	init, target := cudaInit()
	u, err := ctx.RegisterUnit("layer", []Param{{Name: "w", Shape: []int64{cudaRows, cudaCols}}})
	if err != nil {
		return nil, err
	}
	if err := u.SetValues(0, init); err != nil {
		return nil, err
	}
	n := cudaRows * cudaCols
	gpu := device != "cpu"
	var (
		s             uintptr
		params, grads *cudart.Pinned
		late          unsafe.Pointer
	)
	if gpu {
		dev, ok := ctx.CUDADevice()
		if !ok {
			return nil, errors.New("CUDADevice: not a cuda context: " + ctx.Device())
		}
		if err := cudart.SetDevice(dev); err != nil { // RunRanks locked this goroutine to its thread
			return nil, err
		}
		if own {
			if s, err = cudart.StreamCreate(); err != nil {
				return nil, err
			}
			defer func() { _ = cudart.StreamDestroy(s) }()
		}
		if params, err = cudart.NewPinned(n); err != nil {
			return nil, err
		}
		defer func() { _ = params.Free() }()
		if grads, err = cudart.NewPinned(n); err != nil {
			return nil, err
		}
		defer func() { _ = grads.Free() }()
		if late, err = cudart.Malloc(lateBytes); err != nil {
			return nil, err
		}
		defer func() { _ = cudart.Free(late) }()
	}
	stream := Stream(s)
	for step := 0; step < cudaSteps; step++ {
		if err := u.ForwardBeginOn(stream); err != nil {
			return nil, err
		}
		if err := u.ForwardEndOn(stream); err != nil {
			return nil, err
		}
		if err := u.BackwardBeginOn(stream); err != nil {
			return nil, err
		}
		if !gpu {
			p, _ := u.Param(0)
			gr, _ := u.Grad(0)
			x := make([]float32, n)
			gradOf(p, target, world, x)
			for k := range gr {
				gr[k] += x[k]
			}
		} else {
			p, err := u.ParamPtr(0)
			if err != nil {
				return nil, err
			}
			gp, err := u.GradPtr(0)
			if err != nil {
				return nil, err
			}
			// The host reads the params on its stream (and waits for that stream
			// only), computes the grads, and queues them behind a long memset:
			// BackwardEndOn returns before they are there.
			if err := cudart.CopyAsync(params.Ptr(), p, 4*n, s); err != nil {
				return nil, err
			}
			if err := cudart.StreamSynchronize(s); err != nil {
				return nil, err
			}
			gradOf(params.Floats(), target, world, grads.Floats()) // the grad buffer is zero: writing is adding
			for k := 0; k < 8; k++ {
				if err := cudart.MemsetAsync(late, k, lateBytes, s); err != nil {
					return nil, err
				}
			}
			if err := cudart.CopyAsync(gp, grads.Ptr(), 4*n, s); err != nil {
				return nil, err
			}
		}
		if err := u.BackwardEndOn(stream); err != nil {
			return nil, err
		}
		if err := ctx.StepOn(stream); err != nil { // waits for the stream: the pinned grads are free again
			return nil, err
		}
	}
	out, err := u.Gather(0)
	if err != nil {
		return nil, err
	}
	return out, ctx.Finalize()
}

func runCUDA(t *testing.T, device string, world int, own bool) [][]float32 {
	t.Helper()
	out := make([][]float32, world)
	err := RunRanks(world, func(rank int, g *Group) error {
		w, err := trainCUDA(device, world, rank, g, own)
		out[rank] = w
		return err
	})
	if err != nil {
		t.Fatalf("%s, world %d: %v", device, world, err)
	}
	return out
}

func TestCudaTrainingThroughDevicePointersMatchesTheCPUBitwise(t *testing.T) {
	needGPU(t)
	init, _ := cudaInit()
	for _, world := range []int{1, 2} {
		for _, own := range []bool{false, true} {
			cpu := runCUDA(t, "cpu", world, own)
			gpu := runCUDA(t, "cuda:0", world, own)
			for r := 0; r < world; r++ {
				for k := range cpu[r] {
					if math.Float32bits(gpu[r][k]) != math.Float32bits(cpu[r][k]) {
						t.Fatalf("world %d, own stream %v, rank %d: w[%d] = %v on the GPU, %v on the CPU",
							world, own, r, k, gpu[r][k], cpu[r][k])
					}
				}
			}
			if cpu[0][0] == init[0] {
				t.Fatalf("world %d: the weights did not change", world)
			}
		}
	}
}

// A single-context program drives its GPU from one OS thread: the CUDA
// current device is per thread, and Go moves goroutines between threads.
func TestCudaSingleContextOnALockedThread(t *testing.T) {
	needGPU(t)
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	ctx, err := gpuContext("cuda", nil, 0) // device=cuda: LOCAL_RANK or 0, read back as cuda:N
	if err != nil {
		t.Fatal(err)
	}
	defer ctx.Close()
	dev, ok := ctx.CUDADevice()
	if !ok || !strings.HasPrefix(ctx.Device(), "cuda:") {
		t.Fatalf("Device() = %q, CUDADevice() = %d, %v", ctx.Device(), dev, ok)
	}
	if err := cudart.SetDevice(dev); err != nil {
		t.Fatal(err)
	}
	u, err := ctx.RegisterUnit("u", []Param{{Name: "w", Shape: []int64{4}}})
	if err != nil {
		t.Fatal(err)
	}
	if err := u.ForwardBegin(); err != nil {
		t.Fatal(err)
	}
	if _, err := u.Param(0); !errors.Is(err, ErrUnsupported) {
		t.Fatalf("Param on a CUDA context: %v, want ErrUnsupported", err)
	}
	if p, err := u.ParamPtr(0); err != nil || p == nil {
		t.Fatalf("ParamPtr: %v, %v", p, err)
	}
	if err := u.ForwardEnd(); err != nil {
		t.Fatal(err)
	}
	if err := ctx.Step(); err != nil {
		t.Fatal(err)
	}
}

// The rule of needGPU, with a stand-in nvidia-smi: a listed GPU counts
// unless CUDA_VISIBLE_DEVICES hides it.
func TestGpusListedByAStandInNvidiaSmi(t *testing.T) {
	dir := t.TempDir()
	smi := filepath.Join(dir, "nvidia-smi")
	if err := os.WriteFile(smi, []byte("#!/bin/sh\nprintf 'GPU 0: NVIDIA H100 (UUID: GPU-0)\\nGPU 1: NVIDIA H100 (UUID: GPU-1)\\n'\n"), 0o755); err != nil {
		t.Fatal(err)
	}
	t.Setenv("PATH", dir)
	t.Setenv("CUDA_VISIBLE_DEVICES", "") // restored at the end
	os.Unsetenv("CUDA_VISIBLE_DEVICES")
	if n := gpusListed(); n != 2 {
		t.Fatalf("gpusListed with two GPUs listed: %d", n)
	}
	t.Setenv("CUDA_VISIBLE_DEVICES", "")
	if n := gpusListed(); n != 0 {
		t.Fatalf("gpusListed with CUDA_VISIBLE_DEVICES=\"\": %d", n)
	}
	t.Setenv("CUDA_VISIBLE_DEVICES", "-1")
	if n := gpusListed(); n != 0 {
		t.Fatalf("gpusListed with CUDA_VISIBLE_DEVICES=-1: %d", n)
	}
	t.Setenv("PATH", t.TempDir())
	os.Unsetenv("CUDA_VISIBLE_DEVICES")
	if n := gpusListed(); n != 0 {
		t.Fatalf("gpusListed without nvidia-smi: %d", n)
	}
}

// Where no GPU is usable here, the GPU tests skip; with a stand-in
// nvidia-smi listing one they fail instead, saying why (run as a child of
// this test binary).
func TestGpuTestsFailWhereAListedGpuIsUnusable(t *testing.T) {
	if ctx, err := gpuContext("cuda:0", nil, 0); err == nil {
		ctx.Close()
		t.Skip("a GPU is usable here: the GPU tests run for real")
	}
	dir := t.TempDir()
	if err := os.WriteFile(filepath.Join(dir, "nvidia-smi"), []byte("#!/bin/sh\necho 'GPU 0: NVIDIA H100 (UUID: GPU-0)'\n"), 0o755); err != nil {
		t.Fatal(err)
	}
	run := func(env ...string) (string, error) {
		cmd := exec.Command(os.Args[0], "-test.run=^TestCudaSingleContextOnALockedThread$", "-test.v")
		cmd.Env = append(os.Environ(), "PATH="+dir+string(os.PathListSeparator)+os.Getenv("PATH"), "FSDP_REQUIRE_GPU=")
		cmd.Env = append(cmd.Env, env...)
		out, err := cmd.CombinedOutput()
		return string(out), err
	}
	out, err := run()
	if err == nil || !strings.Contains(out, "nvidia-smi -L lists 1 GPU(s), but") {
		t.Fatalf("with a listed GPU that CUDA cannot use: err %v, output:\n%s", err, out)
	}
	out, err = run("CUDA_VISIBLE_DEVICES=-1")
	if err != nil || !strings.Contains(out, "--- SKIP") {
		t.Fatalf("with the GPUs hidden: err %v, output:\n%s", err, out)
	}
}
