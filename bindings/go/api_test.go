// api_test.go - the binding's contract: errors (status, library message,
// errors.Is), closed handles, zero-copy grads, config, checkpoints, memory.

package fsdp

import (
	"errors"
	"fmt"
	"math"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"
)

func TestConfigErrors(t *testing.T) {
	cfg, err := NewConfig()
	if err != nil {
		t.Fatal(err)
	}
	defer cfg.Close()
	err = cfg.Set("no_such_key", "1")
	var fe *Error
	if !errors.Is(err, ErrInvalidArgument) || !errors.As(err, &fe) {
		t.Fatalf("unknown key: got %v, want ErrInvalidArgument", err)
	}
	if fe.Status != StatusInvalidArgument || fe.Name != "FSDP_ERR_INVALID_ARGUMENT" ||
		!strings.Contains(fe.Message, "no_such_key") || !strings.Contains(fe.Message, "sharding") {
		t.Errorf("unknown key: want the library's message naming the key and the valid keys, got %+v", fe)
	}
	if errors.Is(err, ErrInvalidState) {
		t.Errorf("errors.Is matched the wrong status")
	}
	if err := cfg.Set("sharding", "ZERO2"); err != nil {
		t.Fatal(err)
	}
	if v, err := cfg.Get("sharding"); err != nil || v != "SHARD_GRAD_OP" {
		t.Errorf("Get(sharding) = %q, %v; want SHARD_GRAD_OP", v, err)
	}
	if _, err := cfg.Get("nope"); !errors.Is(err, ErrInvalidArgument) {
		t.Errorf("Get(unknown) = %v", err)
	}
	t.Setenv("FSDP_SHARDING", "NO_SHARD")
	if err := cfg.FromEnv(); err != nil {
		t.Fatal(err)
	}
	if v, _ := cfg.Get("sharding"); v != "NO_SHARD" {
		t.Errorf("after FromEnv sharding = %q", v)
	}
	cfg.Close()
	cfg.Close() // idempotent
	if err := cfg.Set("lr", "1"); !errors.Is(err, ErrInvalidState) {
		t.Errorf("Set after Close = %v, want ErrInvalidState", err)
	}
}

// oneRank builds a world-of-one context with the MLP registered.
func oneRank(t *testing.T, opts map[string]string) (*Context, []*Unit) {
	t.Helper()
	ctx, err := newRankContext(nil, 0, opts)
	if err != nil {
		t.Fatal(err)
	}
	units, err := registerMLP(ctx, makeInit())
	if err != nil {
		ctx.Close()
		t.Fatal(err)
	}
	return ctx, units
}

func TestStateAndArgumentErrors(t *testing.T) {
	ctx, units := oneRank(t, nil)
	u := units[0]
	if _, err := u.Param(0); !errors.Is(err, ErrInvalidState) {
		t.Errorf("Param outside a block = %v, want ErrInvalidState", err)
	}
	if err := u.SetValues(0, make([]float32, 3)); !errors.Is(err, ErrInvalidArgument) {
		t.Errorf("SetValues of a wrong length = %v, want ErrInvalidArgument", err)
	}
	if _, err := u.Param(5); !errors.Is(err, ErrInvalidArgument) {
		t.Errorf("Param(5) = %v, want ErrInvalidArgument", err)
	}
	if _, err := u.ParamU16(0); !errors.Is(err, ErrInvalidArgument) {
		t.Errorf("ParamU16 on fp32 = %v, want ErrInvalidArgument", err)
	}
	if err := u.ForwardBegin(); err != nil {
		t.Fatal(err)
	}
	if _, err := u.Grad(0); err == nil {
		t.Errorf("Grad in a forward block succeeded")
	}
	if err := ctx.Step(); !errors.Is(err, ErrInvalidState) {
		t.Errorf("Step with a unit in use = %v, want ErrInvalidState", err)
	}
	if err := u.ForwardEnd(); err != nil {
		t.Fatal(err)
	}
	err := ctx.Load(filepath.Join(t.TempDir(), "missing"))
	var fe *Error
	if !errors.As(err, &fe) || fe.Message == "" {
		t.Errorf("Load of a missing dir = %v, want an *Error with a message", err)
	} else {
		t.Logf("Load of a missing dir: %v", err)
	}
	if r, err := ctx.Rank(); err != nil || r != 0 {
		t.Errorf("Rank = %d, %v", r, err)
	}
	if err := ctx.Finalize(); err != nil {
		t.Fatal(err)
	}
	if err := ctx.Step(); !errors.Is(err, ErrInvalidState) {
		t.Errorf("Step after Finalize = %v, want ErrInvalidState", err)
	}
	ctx.Close()
	ctx.Close() // idempotent
	for name, err := range map[string]error{
		"Step": ctx.Step(), "SetLR": ctx.SetLR(1), "Save": ctx.Save(t.TempDir(), "full"),
		"ForwardBegin": u.ForwardBegin(), "SetValues": u.SetValues(0, nil),
	} {
		if !errors.Is(err, ErrInvalidState) {
			t.Errorf("%s after Close = %v, want ErrInvalidState", name, err)
		}
	}
	if _, err := u.Gather(0); !errors.Is(err, ErrInvalidState) {
		t.Errorf("Gather after Close = %v", err)
	}
	if _, err := ctx.MemoryStats(); !errors.Is(err, ErrInvalidState) {
		t.Errorf("MemoryStats after Close = %v", err)
	}
	g, err := LocalGroup(2)
	if err != nil {
		t.Fatal(err)
	}
	g.Close()
	g.Close()
	if _, err := NewContext(&Config{}, nil, 0); !errors.Is(err, ErrInvalidState) {
		t.Errorf("NewContext with a closed config = %v", err)
	}
}

// Ranks registering different units fail together with ErrMismatch.
func TestMismatch(t *testing.T) {
	err := RunRanks(2, func(rank int, g *Group) error {
		ctx, err := newRankContext(g, rank, nil)
		if err != nil {
			return err
		}
		defer ctx.Close()
		_, err = ctx.RegisterUnit("u", []Param{{Name: "w", Shape: []int64{4, int64(3 + rank)}}})
		if !errors.Is(err, ErrMismatch) {
			return errors.New("want ErrMismatch, got " + errString(err))
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
}

// A rank that fails makes RunRanks abort the group: the ranks waiting for it in
// a collective get ErrComm naming it at once. timeout_s is 60, so without the
// abort they would fail with ErrTimeout instead.
func TestFailingRankAbortsTheGroup(t *testing.T) {
	errBatch := errors.New("bad batch")
	var mu sync.Mutex
	seen := map[int]error{}
	err := RunRanks(3, func(rank int, g *Group) error {
		ctx, err := newRankContext(g, rank, map[string]string{"timeout_s": "60"})
		if err != nil {
			return err
		}
		defer ctx.Close()
		u, err := ctx.RegisterUnit("u", []Param{{Name: "w", Shape: []int64{8}}})
		if err != nil {
			return err
		}
		if rank == 2 {
			time.Sleep(200 * time.Millisecond) // the others wait in the forward all-gather by now
			return errBatch
		}
		err = u.ForwardBegin()
		if err == nil {
			err = ctx.Step()
		}
		mu.Lock()
		seen[rank] = err
		mu.Unlock()
		return err
	})
	if !errors.Is(err, errBatch) || !strings.Contains(err.Error(), "rank 2") {
		t.Fatalf("RunRanks returned %v, want rank 2's own error", err)
	}
	for rank := 0; rank < 2; rank++ {
		e := seen[rank]
		if !errors.Is(e, ErrComm) || !strings.Contains(errString(e), "rank 2 failed: bad batch") {
			t.Errorf("rank %d got %v, want ErrComm naming rank 2 and its error", rank, e)
		}
	}
	g, err := LocalGroup(1)
	if err != nil {
		t.Fatal(err)
	}
	defer g.Close()
	if err := g.Abort("stop"); err != nil {
		t.Fatal(err)
	}
	if _, err := newRankContext(g, 0, nil); !errors.Is(err, ErrComm) || !strings.Contains(err.Error(), "stop") {
		t.Errorf("NewContext on an aborted group = %v, want ErrComm with the reason", err)
	}
	g.Close()
	if err := g.Abort("again"); !errors.Is(err, ErrInvalidState) {
		t.Errorf("Abort on a closed group = %v, want ErrInvalidState", err)
	}
}

func errString(err error) string {
	if err == nil {
		return "nil"
	}
	return err.Error()
}

// What a rank writes through the Grad slice is what the library reduces: with
// SGD lr=1, rank r writes r+1 into every grad element; the average over 2
// ranks is 1.5, so every param drops by 1.5 and the grad norm is 1.5*sqrt(n).
func TestZeroCopyGrad(t *testing.T) {
	const n = 10
	err := RunRanks(2, func(rank int, g *Group) error {
		ctx, err := newRankContext(g, rank, map[string]string{"optimizer": "sgd", "lr": "1", "weight_decay": "0"})
		if err != nil {
			return err
		}
		defer ctx.Close()
		u, err := ctx.RegisterUnit("u", []Param{{Name: "w", Shape: []int64{n}}})
		if err != nil {
			return err
		}
		if err := u.SetValues(0, make([]float32, n)); err != nil {
			return err
		}
		if err := u.BackwardBegin(); err != nil {
			return err
		}
		gr, err := u.Grad(0)
		if err != nil {
			return err
		}
		for i := range gr {
			if gr[i] != 0 {
				return errors.New("grad buffer not zeroed at BackwardBegin")
			}
			gr[i] = float32(rank + 1)
		}
		if err := u.BackwardEnd(); err != nil {
			return err
		}
		// The reduced grad, read back before the step: the ranks' mean.
		reduced, err := u.GatherGrad(0)
		if err != nil {
			return err
		}
		for _, v := range reduced {
			if v != 1.5 {
				return fmt.Errorf("GatherGrad gave %v, not the ranks' mean 1.5", v)
			}
		}
		if err := ctx.Step(); err != nil {
			return err
		}
		norm, err := ctx.LastGradNorm()
		if err != nil {
			return err
		}
		if math.Abs(norm-1.5*math.Sqrt(n)) > 1e-5 {
			return errors.New("grad norm differs from 1.5*sqrt(n)")
		}
		p, err := u.Gather(0)
		if err != nil {
			return err
		}
		for _, v := range p {
			if v != -1.5 {
				return errors.New("param is not -1.5: the Grad slice is not the library's buffer")
			}
		}
		return ctx.Finalize()
	})
	if err != nil {
		t.Fatal(err)
	}
}

// Save on 2 ranks (sharded and full), train on, load into a 1-rank context:
// the params equal those saved.
func TestSaveLoadRoundTrip(t *testing.T) {
	init := makeInit()
	x, y := makeData()
	dir := t.TempDir()
	var saved tensors
	err := RunRanks(2, func(rank int, g *Group) error {
		ctx, err := newRankContext(g, rank, nil)
		if err != nil {
			return err
		}
		defer ctx.Close()
		units, err := registerMLP(ctx, init)
		if err != nil {
			return err
		}
		for s := 0; s < 3; s++ {
			io := &libIO{units: units}
			pass(io, x, y, rank*batch/2, batch/2)
			if io.err != nil {
				return io.err
			}
			if err := ctx.Step(); err != nil {
				return err
			}
			if s == 1 {
				for _, kind := range []string{"sharded", "full"} {
					if err := ctx.Save(filepath.Join(dir, kind), kind); err != nil {
						return err
					}
				}
				p, err := gatherAll(units)
				if err != nil {
					return err
				}
				if rank == 0 {
					saved = p
				}
			}
		}
		return ctx.Finalize()
	})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(filepath.Join(dir, "full", "model.safetensors")); err != nil {
		t.Errorf("full checkpoint: %v", err)
	}
	for _, kind := range []string{"sharded", "full"} {
		ctx, units := oneRank(t, nil) // fresh init, then load
		if err := ctx.Load(filepath.Join(dir, kind)); err != nil {
			t.Fatal(err)
		}
		got, err := gatherAll(units)
		if err != nil {
			t.Fatal(err)
		}
		if e := relErr(got, saved); e != 0 {
			t.Errorf("%s: loaded params differ from saved ones (relative %.3g)", kind, e)
		}
		ctx.Close()
	}
}

func TestContextAccessors(t *testing.T) {
	ctx, units := oneRank(t, map[string]string{"sharding": "NO_SHARD"})
	defer ctx.Close()
	if w, err := ctx.WorldSize(); err != nil || w != 1 {
		t.Errorf("WorldSize = %d, %v", w, err)
	}
	if d, err := ctx.ParamDtype(); err != nil || d != FP32 {
		t.Errorf("ParamDtype = %v, %v", d, err)
	}
	if s, skipped, err := ctx.LossScale(); err != nil || s != 1 || skipped != 0 {
		t.Errorf("LossScale = %v %v %v", s, skipped, err)
	}
	if n, err := ctx.StepCount(); err != nil || n != 0 {
		t.Errorf("StepCount = %v %v before any step", n, err)
	}
	if err := ctx.SetLR(0.5); err != nil {
		t.Error(err)
	}
	if err := ctx.SetGradSync(false); err != nil {
		t.Error(err)
	}
	if err := ctx.SetGradSync(true); err != nil {
		t.Error(err)
	}
	m, err := ctx.MemoryStats()
	if err != nil {
		t.Fatal(err)
	}
	numel := 0
	for l := range units {
		for _, p := range units[l].Params() {
			numel += p.Numel()
		}
	}
	if m.ShardedParams < uint64(4*numel) || m.OptimizerState < uint64(8*numel) || m.Total == 0 {
		t.Errorf("memory stats too small for %d params: %+v", numel, m)
	}
	off, shard, err := units[0].ShardInfo()
	if err != nil || off != 0 || len(shard) < units[0].Params()[0].Numel() {
		t.Errorf("ShardInfo = %d, len %d, %v", off, len(shard), err)
	}
	if o, n, err := units[0].FlatRange(1); err != nil || o < 16*32 || n != 32 {
		t.Errorf("FlatRange(1) = %d %d %v", o, n, err)
	}
	trace := filepath.Join(t.TempDir(), "trace.json")
	if err := ctx.TraceBegin(); err != nil {
		t.Fatal(err)
	}
	if err := ctx.TraceWrite(trace); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(trace); err != nil {
		t.Error(err)
	}
	if Version() != 100 || !strings.Contains(BuildInfo(), "libfsdp") {
		t.Errorf("Version %d BuildInfo %q", Version(), BuildInfo())
	}
}

func TestHalfConversions(t *testing.T) {
	for _, f := range []float32{0, 1, -2.5, 0.1, 65504, 1e-6} {
		if g := BF16ToFloat32(Float32ToBF16(f)); math.Abs(float64(g-f)) > math.Abs(float64(f))/128 {
			t.Errorf("bf16 round trip %v -> %v", f, g)
		}
		if g := FP16ToFloat32(Float32ToFP16(f)); math.Abs(float64(g-f)) > math.Abs(float64(f))/1024+6e-8 {
			t.Errorf("fp16 round trip %v -> %v", f, g)
		}
	}
	// Bit patterns from IEEE 754 binary16 and bfloat16 (the top half of a
	// float32), with ties rounded to even: not from the converters themselves.
	inf := float32(math.Inf(1))
	type pattern struct {
		f     float32
		bits  uint16
		exact bool // f is representable: the bits decode back to it
	}
	fp16 := []pattern{
		{1, 0x3C00, true}, {-2, 0xC000, true}, {0.333251953125, 0x3555, true}, {65504, 0x7BFF, true},
		{inf, 0x7C00, true}, {float32(math.Ldexp(1, -14)), 0x0400, true}, {float32(math.Ldexp(1, -24)), 0x0001, true},
		{65520, 0x7C00, false}, {1 + float32(math.Ldexp(1, -11)), 0x3C00, false},
		{1 + 3*float32(math.Ldexp(1, -11)), 0x3C02, false},
	}
	for _, c := range fp16 {
		if got := Float32ToFP16(c.f); got != c.bits {
			t.Errorf("Float32ToFP16(%v) = %#04x, want %#04x", c.f, got, c.bits)
		}
		if got := FP16ToFloat32(c.bits); c.exact && got != c.f {
			t.Errorf("FP16ToFloat32(%#04x) = %v, want %v", c.bits, got, c.f)
		}
	}
	bf16 := []pattern{{1, 0x3F80, true}, {-2, 0xC000, true}, {inf, 0x7F80, true}, {1.00390625, 0x3F80, false},
		{1.01171875, 0x3F82, false}}
	for _, c := range bf16 {
		if got := Float32ToBF16(c.f); got != c.bits {
			t.Errorf("Float32ToBF16(%v) = %#04x, want %#04x", c.f, got, c.bits)
		}
		if got := BF16ToFloat32(c.bits); c.exact && got != c.f {
			t.Errorf("BF16ToFloat32(%#04x) = %v, want %v", c.bits, got, c.f)
		}
	}
	nan := float32(math.NaN())
	if g := FP16ToFloat32(Float32ToFP16(nan)); g == g {
		t.Errorf("fp16 NaN became %v", g)
	}
	if g := BF16ToFloat32(Float32ToBF16(nan)); g == g {
		t.Errorf("bf16 NaN became %v", g)
	}
}

// A bf16 context serves 16-bit buffers through ParamU16/GradU16 only.
func TestBF16Accessors(t *testing.T) {
	ctx, err := newRankContext(nil, 0, map[string]string{"param_dtype": "bf16"})
	if err != nil {
		t.Fatal(err)
	}
	defer ctx.Close()
	u, err := ctx.RegisterUnit("u", []Param{{Name: "w", Shape: []int64{2, 3}}})
	if err != nil {
		t.Fatal(err)
	}
	if err := u.SetValues(0, []float32{1.5, -2, 0.25, 3, 0, 1}); err != nil {
		t.Fatal(err)
	}
	if err := u.BackwardBegin(); err != nil {
		t.Fatal(err)
	}
	if _, err := u.Param(0); !errors.Is(err, ErrInvalidArgument) {
		t.Errorf("Param on bf16 = %v, want ErrInvalidArgument", err)
	}
	p, err := u.ParamU16(0)
	if err != nil || len(p) != 6 || BF16ToFloat32(p[0]) != 1.5 || BF16ToFloat32(p[1]) != -2 {
		t.Errorf("ParamU16 = %v, %v", p, err)
	}
	g, err := u.GradU16(0)
	if err != nil || len(g) != 6 || BF16ToFloat32(g[0]) != 0 {
		t.Errorf("GradU16 = %v, %v", g, err)
	}
	if err := u.BackwardEnd(); err != nil {
		t.Fatal(err)
	}
}

// Get grows its buffer for a value longer than its first guess.
func TestConfigLongValue(t *testing.T) {
	cfg, err := NewConfig()
	if err != nil {
		t.Fatal(err)
	}
	defer cfg.Close()
	long := strings.Repeat("*some_long_param_name_pattern,", 20) + "*bias"
	if err := cfg.Set("no_weight_decay", long); err != nil {
		t.Fatal(err)
	}
	if v, err := cfg.Get("no_weight_decay"); err != nil || v != long {
		t.Errorf("Get of a %d-char value = %d chars, %v", len(long), len(v), err)
	}
}

// CommIDCreate gives NCCL's id as 256 hex digits, or says why it cannot.
func TestCommIDIsHexTextOrUnsupported(t *testing.T) {
	id, err := CommIDCreate()
	if err != nil {
		if !errors.Is(err, ErrUnsupported) || !strings.Contains(strings.ToLower(err.Error()), "nccl") {
			t.Fatalf("CommIDCreate: %v, want an id or ErrUnsupported naming NCCL", err)
		}
		return
	}
	if len(id) != 256 || strings.Trim(id, "0123456789abcdef") != "" {
		t.Fatalf("CommIDCreate: %q is not 256 hex digits", id)
	}
}

// A checkpoint of units a = {x, y} loads by name into units {x}, {w}: Load
// refuses (w missing, y unexpected), LoadPartial loads x, keeps w and reports
// both.
func TestLoadPartialByName(t *testing.T) {
	dir := t.TempDir()
	ctx, err := newRankContext(nil, 0, nil)
	if err != nil {
		t.Fatal(err)
	}
	a, err := ctx.RegisterUnit("a", []Param{{Name: "x", Shape: []int64{3}}, {Name: "y", Shape: []int64{2}}})
	if err != nil {
		t.Fatal(err)
	}
	if err := a.SetValues(0, []float32{1, 2, 3}); err != nil {
		t.Fatal(err)
	}
	if err := ctx.Save(dir, "sharded"); err != nil {
		t.Fatal(err)
	}
	ctx.Close()
	ctx, err = newRankContext(nil, 0, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer ctx.Close()
	x, err := ctx.RegisterUnit("ux", []Param{{Name: "x", Shape: []int64{3}}})
	if err != nil {
		t.Fatal(err)
	}
	w, err := ctx.RegisterUnit("uw", []Param{{Name: "w", Shape: []int64{2}}})
	if err != nil {
		t.Fatal(err)
	}
	if err := w.SetValues(0, []float32{5, 6}); err != nil {
		t.Fatal(err)
	}
	if err := ctx.Load(dir); !errors.Is(err, ErrInvalidArgument) {
		t.Fatalf("strict Load of a checkpoint without w: %v", err)
	}
	missing, unexpected, err := ctx.LoadPartial(dir)
	if err != nil {
		t.Fatal(err)
	}
	if fmt.Sprint(missing, unexpected) != "[w] [y]" {
		t.Errorf("LoadPartial reported missing %v, unexpected %v; want [w] [y]", missing, unexpected)
	}
	gx, err := x.Gather(0)
	if err != nil {
		t.Fatal(err)
	}
	gw, err := w.Gather(0)
	if err != nil {
		t.Fatal(err)
	}
	if fmt.Sprint(gx, gw) != "[1 2 3] [5 6]" {
		t.Errorf("after LoadPartial x = %v, w = %v; want [1 2 3] [5 6]", gx, gw)
	}
}

// A full checkpoint's model.safetensors is a plain safetensors file: loaded as
// pretrained weights into a fresh context, by name, it gives the saved values;
// a rename that leaves a param without a tensor is refused in strict mode.
func TestLoadPretrainedFromASafetensorsFile(t *testing.T) {
	dir := t.TempDir()
	ctx, err := newRankContext(nil, 0, nil)
	if err != nil {
		t.Fatal(err)
	}
	a, err := ctx.RegisterUnit("a", []Param{{Name: "x", Shape: []int64{2, 2}}})
	if err != nil {
		t.Fatal(err)
	}
	if err := a.SetValues(0, []float32{1, 2, 3, 4}); err != nil {
		t.Fatal(err)
	}
	if err := ctx.Save(dir, "full"); err != nil {
		t.Fatal(err)
	}
	ctx.Close()
	ctx, err = newRankContext(nil, 0, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer ctx.Close()
	b, err := ctx.RegisterUnit("b", []Param{{Name: "w", Shape: []int64{2, 2}}})
	if err != nil {
		t.Fatal(err)
	}
	file := filepath.Join(dir, "model.safetensors")
	if _, _, err := ctx.LoadPretrained(file, ""); !errors.Is(err, ErrInvalidArgument) {
		t.Fatalf("LoadPretrained without a rename: %v, want an invalid-argument error", err)
	}
	missing, unexpected, err := ctx.LoadPretrained(file, "rename=x:w;transpose=w")
	if err != nil || len(missing)+len(unexpected) != 0 {
		t.Fatalf("LoadPretrained: %v (missing %v, unexpected %v)", err, missing, unexpected)
	}
	got, err := b.Gather(0)
	if err != nil {
		t.Fatal(err)
	}
	if fmt.Sprint(got) != "[1 3 2 4]" {
		t.Errorf("w = %v, want x transposed: [1 3 2 4]", got)
	}
	// Exported with the same options, the file holds x again: loading it
	// under the name x (no options) gives the first values back.
	out := filepath.Join(t.TempDir(), "export")
	if err := ctx.Export(out, "rename=x:w;transpose=w;dtype=bf16"); err != nil {
		t.Fatal(err)
	}
	ctx2, err := newRankContext(nil, 0, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer ctx2.Close()
	x, err := ctx2.RegisterUnit("a", []Param{{Name: "x", Shape: []int64{2, 2}}})
	if err != nil {
		t.Fatal(err)
	}
	if _, _, err := ctx2.LoadPretrained(out, ""); err != nil {
		t.Fatal(err)
	}
	if got, err := x.Gather(0); err != nil || fmt.Sprint(got) != "[1 2 3 4]" {
		t.Errorf("x after Export and LoadPretrained = %v, %v; want [1 2 3 4]", got, err)
	}
}

// A frozen unit (SetTrainable(false)) hands out no grads and keeps its
// params through a step; the unit beside it trains as SGD says (param -=
// the ranks' mean grad).
func TestFrozenUnit(t *testing.T) {
	const n = 8
	err := RunRanks(2, func(rank int, g *Group) error {
		ctx, err := newRankContext(g, rank, map[string]string{"optimizer": "sgd", "lr": "1", "weight_decay": "0"})
		if err != nil {
			return err
		}
		defer ctx.Close()
		frozen, err := ctx.RegisterUnit("frozen", []Param{{Name: "w", Shape: []int64{n}}})
		if err != nil {
			return err
		}
		live, err := ctx.RegisterUnit("live", []Param{{Name: "w", Shape: []int64{n}}})
		if err != nil {
			return err
		}
		ones := make([]float32, n)
		for i := range ones {
			ones[i] = 1
		}
		for _, u := range []*Unit{frozen, live} {
			if err := u.SetValues(0, ones); err != nil {
				return err
			}
		}
		if err := frozen.SetTrainable(false); err != nil {
			return err
		}
		if tr, err := frozen.Trainable(); err != nil || tr {
			return fmt.Errorf("Trainable() = %v, %v after SetTrainable(false)", tr, err)
		}
		if err := ctx.ResetCommStats(); err != nil {
			return err
		}
		for _, u := range []*Unit{live, frozen} {
			if err := u.BackwardBegin(); err != nil {
				return err
			}
			gr, err := u.Grad(0)
			if u == frozen {
				if !errors.Is(err, ErrInvalidState) {
					return fmt.Errorf("Grad of a frozen unit gave %v, not ErrInvalidState", err)
				}
			} else {
				if err != nil {
					return err
				}
				for i := range gr {
					gr[i] = float32(rank + 1)
				}
			}
			if err := u.BackwardEnd(); err != nil {
				return err
			}
		}
		if err := ctx.Step(); err != nil {
			return err
		}
		// One reduce-scatter, of the live unit's padded fp32 grads (both ranks' shards).
		_, shard, err := live.ShardInfo()
		if err != nil {
			return err
		}
		cs, err := ctx.CommStats()
		if err != nil {
			return err
		}
		// ShardInfo waited for the step (a read); the brackets and the step did not.
		if cs.HostWaits != 1 {
			return fmt.Errorf("CommStats: %d host waits, want 1 (ShardInfo's)", cs.HostWaits)
		}
		if want := uint64(2 * len(shard) * 4); cs.ReduceScatterCalls != 1 || cs.ReduceScatterBytes != want {
			return fmt.Errorf("CommStats: %d reduce-scatters of %d bytes, want 1 of %d", cs.ReduceScatterCalls, cs.ReduceScatterBytes, want)
		}
		for _, c := range []struct {
			u    *Unit
			want float32
		}{{frozen, 1}, {live, 1 - 1.5}} {
			p, err := c.u.Gather(0)
			if err != nil {
				return err
			}
			for _, v := range p {
				if v != c.want {
					return fmt.Errorf("unit %s: param %v, want %v", c.u.Name(), v, c.want)
				}
			}
		}
		return ctx.Finalize()
	})
	if err != nil {
		t.Fatal(err)
	}
}

// A param frozen inside its unit (SetParamTrainable(0, false)) hands out no
// grads and keeps its values through a step; the param beside it in the
// same unit trains as SGD says, and only its bytes are reduced.
func TestFrozenParam(t *testing.T) {
	const n = 8
	err := RunRanks(2, func(rank int, g *Group) error {
		ctx, err := newRankContext(g, rank, map[string]string{"optimizer": "sgd", "lr": "1", "weight_decay": "0"})
		if err != nil {
			return err
		}
		defer ctx.Close()
		u, err := ctx.RegisterUnit("u", []Param{{Name: "w", Shape: []int64{n}}, {Name: "b", Shape: []int64{n}}})
		if err != nil {
			return err
		}
		ones := make([]float32, n)
		for i := range ones {
			ones[i] = 1
		}
		for i := 0; i < 2; i++ {
			if err := u.SetValues(i, ones); err != nil {
				return err
			}
		}
		if err := u.SetParamTrainable(0, false); err != nil {
			return err
		}
		if tr, err := u.ParamTrainable(0); err != nil || tr {
			return fmt.Errorf("ParamTrainable(0) = %v, %v after SetParamTrainable(0, false)", tr, err)
		}
		if err := ctx.ResetCommStats(); err != nil {
			return err
		}
		if err := u.BackwardBegin(); err != nil {
			return err
		}
		if _, err := u.Grad(0); !errors.Is(err, ErrInvalidState) {
			return fmt.Errorf("Grad of a frozen param gave %v, not ErrInvalidState", err)
		}
		gr, err := u.Grad(1)
		if err != nil {
			return err
		}
		for i := range gr {
			gr[i] = float32(rank + 1)
		}
		if err := u.BackwardEnd(); err != nil {
			return err
		}
		if err := ctx.Step(); err != nil {
			return err
		}
		cs, err := ctx.CommStats()
		if err != nil {
			return err
		}
		// b's block alone: 8 elements padded to the alignment (16 per rank by default) over 2 ranks, fp32.
		if cs.ReduceScatterCalls != 1 || cs.ReduceScatterBytes > 2*16*4 {
			return fmt.Errorf("CommStats: %d reduce-scatters of %d bytes, want 1 of b's block alone", cs.ReduceScatterCalls, cs.ReduceScatterBytes)
		}
		for i, want := range []float32{1, 1 - 1.5} {
			p, err := u.Gather(i)
			if err != nil {
				return err
			}
			for _, v := range p {
				if v != want {
					return fmt.Errorf("param %d: %v, want %v", i, v, want)
				}
			}
		}
		return ctx.Finalize()
	})
	if err != nil {
		t.Fatal(err)
	}
}

// SetParamGroup: SGD with lr 1, a group at lr_scale 0.25 moves by a quarter
// of the ranks' mean grad, the other param by all of it.
func TestParamGroup(t *testing.T) {
	const n = 4
	err := RunRanks(2, func(rank int, g *Group) error {
		ctx, err := newRankContext(g, rank, map[string]string{"optimizer": "sgd", "lr": "1", "weight_decay": "0"})
		if err != nil {
			return err
		}
		defer ctx.Close()
		u, err := ctx.RegisterUnit("u", []Param{{Name: "enc.w", Shape: []int64{n}}, {Name: "dec.w", Shape: []int64{n}}})
		if err != nil {
			return err
		}
		ones := []float32{1, 1, 1, 1}
		for i := 0; i < 2; i++ {
			if err := u.SetValues(i, ones); err != nil {
				return err
			}
		}
		if m, err := ctx.SetParamGroup("enc.*", "lr_scale=0.25"); err != nil || m != 1 {
			return fmt.Errorf("SetParamGroup matched %d, %v; want 1 param", m, err)
		}
		if _, err := ctx.SetParamGroup("*", "colour=blue"); !errors.Is(err, ErrInvalidArgument) {
			return fmt.Errorf("an unknown key gave %v, not ErrInvalidArgument", err)
		}
		if err := u.BackwardBegin(); err != nil {
			return err
		}
		for i := 0; i < 2; i++ {
			gr, err := u.Grad(i)
			if err != nil {
				return err
			}
			for k := range gr {
				gr[k] = float32(rank + 1)
			}
		}
		if err := u.BackwardEnd(); err != nil {
			return err
		}
		if err := ctx.Step(); err != nil {
			return err
		}
		for i, want := range []float32{1 - 0.375, 1 - 1.5} {
			p, err := u.Gather(i)
			if err != nil {
				return err
			}
			for _, v := range p {
				if v != want {
					return fmt.Errorf("param %d is %v, want %v", i, v, want)
				}
			}
		}
		return ctx.Finalize()
	})
	if err != nil {
		t.Fatal(err)
	}
}

// optimizer=host: SGD with momentum written here on ShardTensors; with lr 1
// and momentum 0.5 the param follows p -= buf, buf = 0.5 buf + mean grad.
func TestHostOptimizer(t *testing.T) {
	const n = 6
	err := RunRanks(2, func(rank int, g *Group) error {
		ctx, err := newRankContext(g, rank, map[string]string{"optimizer": "host", "host_state": "1"})
		if err != nil {
			return err
		}
		defer ctx.Close()
		u, err := ctx.RegisterUnit("u", []Param{{Name: "w", Shape: []int64{n}}})
		if err != nil {
			return err
		}
		if err := u.SetValues(0, []float32{1, 1, 1, 1, 1, 1}); err != nil {
			return err
		}
		for step := 0; step < 2; step++ {
			if err := u.BackwardBegin(); err != nil {
				return err
			}
			gr, err := u.Grad(0)
			if err != nil {
				return err
			}
			for i := range gr {
				gr[i] = float32(rank + 1)
			}
			if err := u.BackwardEnd(); err != nil {
				return err
			}
			update, scale, err := ctx.StepBegin()
			if err != nil || !update || scale != 1 {
				return fmt.Errorf("StepBegin: %v %v %v", update, scale, err)
			}
			p, grads, states, err := u.ShardTensors(1)
			if err != nil {
				return err
			}
			for i := range p {
				states[0][i] = 0.5*states[0][i] + grads[i]*scale
				p[i] -= states[0][i]
			}
			if err := ctx.StepEnd(); err != nil {
				return err
			}
		}
		w, err := u.Gather(0)
		if err != nil {
			return err
		}
		for _, v := range w {
			if v != -2.75 {
				return fmt.Errorf("param %v, want -2.75", v)
			}
		}
		return ctx.Finalize()
	})
	if err != nil {
		t.Fatal(err)
	}
}
