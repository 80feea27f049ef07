// accumulate_test.go - Unit.GradAccumulate and GradAccumulateU16 (grads added from Go memory in any dtype,
// against the sum the test computes itself), RegisterUnitTrainable and ClipGradNorm.

package fsdp

import (
	"errors"
	"fmt"
	"math"
	"testing"
)

// roundTo is the param dtype's rounding of an fp32 value.
func roundTo(dt Dtype, f float32) float32 {
	switch dt {
	case BF16:
		return BF16ToFloat32(Float32ToBF16(f))
	case FP16:
		return FP16ToFloat32(Float32ToFP16(f))
	}
	return f
}

// Two ranks each add two grads into one param, the first from fp32 values, the
// second from 16-bit ones (or fp32 again): each add is in fp32 rounded once to
// the param dtype, and the reduced grad is the ranks' mean of what each holds.
func TestGradAccumulate(t *testing.T) {
	const n = 37
	for _, pd := range []Dtype{FP32, BF16, FP16} {
		for _, second := range []Dtype{FP32, BF16, FP16} {
			pd, second := pd, second
			t.Run(fmt.Sprintf("%v_then_%v", pd, second), func(t *testing.T) {
				first := func(rank, k int) float32 { return float32(rank+1)*0.3 + float32(k%5)*0.7 - 1 }
				again := func(rank, k int) float32 { return float32(k%3)*0.11 - float32(rank)*0.05 }
				want := make([]float64, n)
				for r := 0; r < 2; r++ {
					for k := 0; k < n; k++ {
						v := roundTo(second, again(r, k)) // what the 16-bit source holds
						want[k] += float64(roundTo(pd, roundTo(pd, first(r, k))+v)) / 2
					}
				}
				err := RunRanks(2, func(rank int, g *Group) error {
					ctx, err := newRankContext(g, rank, map[string]string{"param_dtype": pd.String(), "reduce_dtype": "fp32"})
					if err != nil {
						return err
					}
					defer ctx.Close()
					u, err := ctx.RegisterUnit("u", []Param{{Name: "w", Shape: []int64{n}}})
					if err != nil {
						return err
					}
					if err := u.BackwardBegin(); err != nil {
						return err
					}
					a := make([]float32, n)
					b32 := make([]float32, n)
					b16 := make([]uint16, n)
					for k := range a {
						a[k] = first(rank, k)
						b32[k] = again(rank, k)
						if second == BF16 {
							b16[k] = Float32ToBF16(b32[k])
						} else {
							b16[k] = Float32ToFP16(b32[k])
						}
					}
					if err := u.GradAccumulate(0, a); err != nil {
						return err
					}
					if second == FP32 {
						err = u.GradAccumulate(0, b32)
					} else {
						err = u.GradAccumulateU16(0, b16, second)
					}
					if err != nil {
						return err
					}
					// Refused, changing nothing: a wrong length, a 16-bit dtype that is none.
					if err := u.GradAccumulate(0, a[:n-1]); !errors.Is(err, ErrInvalidArgument) {
						return fmt.Errorf("a short slice gave %v, not ErrInvalidArgument", err)
					}
					if err := u.GradAccumulateU16(0, b16, FP32); !errors.Is(err, ErrInvalidArgument) {
						return fmt.Errorf("U16 with FP32 gave %v, not ErrInvalidArgument", err)
					}
					if err := u.BackwardEnd(); err != nil {
						return err
					}
					if err := u.GradAccumulate(0, a); !errors.Is(err, ErrInvalidState) {
						return fmt.Errorf("outside backward gave %v, not ErrInvalidState", err)
					}
					got, err := u.GatherGrad(0)
					if err != nil {
						return err
					}
					for k, v := range got {
						if math.Abs(float64(v)-want[k]) > 1e-6 {
							return fmt.Errorf("element %d: %v, want %v", k, v, want[k])
						}
					}
					return ctx.Finalize()
				})
				if err != nil {
					t.Fatal(err)
				}
			})
		}
	}
}

// A param registered frozen gets no grad or optimizer memory and no grads;
// the trainable one trains (SGD lr 1: it drops by the ranks' mean grad).
func TestRegisterUnitTrainable(t *testing.T) {
	err := RunRanks(2, func(rank int, g *Group) error {
		ctx, err := newRankContext(g, rank, map[string]string{"optimizer": "adamw", "lr": "0.01"})
		if err != nil {
			return err
		}
		defer ctx.Close()
		params := []Param{{Name: "w", Shape: []int64{64}}, {Name: "frozen", Shape: []int64{1024}}}
		if _, err := ctx.RegisterUnitTrainable("bad", params, []bool{true}); !errors.Is(err, ErrInvalidArgument) {
			return fmt.Errorf("one flag for two params gave %v, not ErrInvalidArgument", err)
		}
		u, err := ctx.RegisterUnitTrainable("u", params, []bool{true, false})
		if err != nil {
			return err
		}
		m, err := ctx.MemoryStats()
		if err != nil {
			return err
		}
		// Grads of the trainable param only (its shard: half of 64, padded), AdamW's two states of them.
		if m.ShardedGrads >= 1024*4/2 || m.OptimizerState != 2*m.ShardedGrads {
			return fmt.Errorf("grads %d B, optimizer %d B: the frozen param's memory is allocated", m.ShardedGrads, m.OptimizerState)
		}
		if tr, err := u.ParamTrainable(1); err != nil || tr {
			return fmt.Errorf("ParamTrainable(1) = %v, %v; want false", tr, err)
		}
		if err := u.BackwardBegin(); err != nil {
			return err
		}
		if _, err := u.Grad(1); !errors.Is(err, ErrInvalidState) {
			return fmt.Errorf("Grad of a frozen param gave %v, not ErrInvalidState", err)
		}
		if err := u.BackwardEnd(); err != nil {
			return err
		}
		return ctx.Finalize()
	})
	if err != nil {
		t.Fatal(err)
	}
}

// ClipGradNorm returns the global norm the test computes and the step applies
// the clipped grads: SGD lr 1 from zeros, rank r's grads r+1 everywhere, mean
// 1.5, norm 1.5*sqrt(n); clipped to 1 each param moves by 1.5 / (norm + 1e-6).
func TestClipGradNorm(t *testing.T) {
	const n = 16
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
		if _, err := ctx.ClipGradNorm(-1); !errors.Is(err, ErrInvalidArgument) {
			return fmt.Errorf("max norm -1 gave %v, not ErrInvalidArgument", err)
		}
		if err := u.BackwardBegin(); err != nil {
			return err
		}
		g0 := make([]float32, n)
		for i := range g0 {
			g0[i] = float32(rank + 1)
		}
		if err := u.GradAccumulate(0, g0); err != nil {
			return err
		}
		if err := u.BackwardEnd(); err != nil {
			return err
		}
		norm, err := ctx.ClipGradNorm(1)
		if err != nil {
			return err
		}
		want := 1.5 * math.Sqrt(n)
		if math.Abs(norm-want) > 1e-6*want {
			return fmt.Errorf("ClipGradNorm gave %v, want %v", norm, want)
		}
		if err := ctx.Step(); err != nil {
			return err
		}
		p, err := u.Gather(0)
		if err != nil {
			return err
		}
		move := 1.5 / (want + 1e-6)
		for i, v := range p {
			if math.Abs(float64(v)+move) > 1e-6 {
				return fmt.Errorf("param %d is %v after the clipped step, want %v", i, v, -move)
			}
		}
		return ctx.Finalize()
	})
	if err != nil {
		t.Fatal(err)
	}
}
