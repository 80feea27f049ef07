// metrics_test.go - MetricsReduce at 3 goroutine-ranks against a Go reference
// that combines the ranks' values in rank order, bit for bit.

package fsdp

import (
	"errors"
	"fmt"
	"math"
	"testing"
)

const metricsRanks = 3

// metricsInput is rank r's values. Element 0 is 1e16, 1, -1e16 over the three
// ranks: in rank order the 1 is lost ((1e16+1)-1e16 = 0), in any other order
// it is kept, so the sum shows whether the ranks are combined in rank order.
// Element 1 (0.1, 0.2, 0.3) is another sum that depends on the order. The
// rest mix signs and magnitudes.
func metricsInput(r int) []float64 {
	v := []float64{[]float64{1e16, 1, -1e16}[r], []float64{0.1, 0.2, 0.3}[r]}
	g := rng(7 + r)
	for i := 0; i < 30; i++ {
		v = append(v, float64(g.uniform(-1, 1))*math.Pow(10, float64(i%7-3)))
	}
	return v
}

// reduceRef is what MetricsReduce must give: a left fold over ranks 0, 1, 2.
func reduceRef(in [][]float64, op ReduceOp) []float64 {
	out := append([]float64(nil), in[0]...)
	for r := 1; r < len(in); r++ {
		for i, x := range in[r] {
			switch op {
			case ReduceSum, ReduceAvg:
				out[i] += x
			case ReduceMax:
				out[i] = math.Max(out[i], x)
			case ReduceMin:
				out[i] = math.Min(out[i], x)
			}
		}
	}
	if op == ReduceAvg {
		for i := range out {
			out[i] /= float64(len(in))
		}
	}
	return out
}

func TestMetricsReduce(t *testing.T) {
	in := make([][]float64, metricsRanks)
	for r := range in {
		in[r] = metricsInput(r)
	}
	ops := []ReduceOp{ReduceSum, ReduceAvg, ReduceMax, ReduceMin}
	if s := reduceRef(in, ReduceSum); s[0] != 0 || (in[0][0]+in[2][0])+in[1][0] != 1 ||
		s[1] == in[0][1]+(in[1][1]+in[2][1]) {
		t.Fatalf("the inputs do not tell rank order from another: the test would prove nothing")
	}
	got := make([][][]float64, metricsRanks) // [rank][op]
	err := RunRanks(metricsRanks, func(rank int, g *Group) error {
		ctx, err := newRankContext(g, rank, nil)
		if err != nil {
			return err
		}
		defer ctx.Close()
		for _, op := range ops {
			v := append([]float64(nil), in[rank]...)
			if err := ctx.MetricsReduce(v, op); err != nil {
				return fmt.Errorf("%v: %w", op, err)
			}
			got[rank] = append(got[rank], v) // v itself: the reduction is in place
		}
		if err := ctx.MetricsReduce(nil, ReduceSum); err != nil { // no values: the ranks still meet
			return fmt.Errorf("nil values: %w", err)
		}
		if err := ctx.MetricsReduce([]float64{1}, ReduceOp(9)); !errors.Is(err, ErrInvalidArgument) {
			return fmt.Errorf("ReduceOp(9) = %v, want ErrInvalidArgument", err)
		}
		return ctx.Finalize()
	})
	if err != nil {
		t.Fatal(err)
	}
	for k, op := range ops {
		want := reduceRef(in, op)
		for r := 0; r < metricsRanks; r++ {
			for i := range want {
				if math.Float64bits(got[r][k][i]) != math.Float64bits(want[i]) {
					t.Errorf("%v: rank %d value %d = %v, want %v (the rank-order reference, bit for bit)",
						op, r, i, got[r][k][i], want[i])
					break // the first difference per op and rank
				}
			}
		}
	}
}

func TestMetricsReduceErrors(t *testing.T) {
	ctx, err := newRankContext(nil, 0, nil)
	if err != nil {
		t.Fatal(err)
	}
	v := []float64{2.5, -1}
	if err := ctx.MetricsReduce(v, ReduceAvg); err != nil || v[0] != 2.5 || v[1] != -1 {
		t.Errorf("world of one: MetricsReduce = %v, values %v; want nil and the values unchanged", err, v)
	}
	big := make([]float64, 1<<20+1)
	var fe *Error
	if err := ctx.MetricsReduce(big, ReduceSum); !errors.Is(err, ErrInvalidArgument) || !errors.As(err, &fe) ||
		fe.Message == "" {
		t.Errorf("2^20+1 values = %v, want ErrInvalidArgument with the library's message", err)
	}
	if s := ReduceMin.String() + ReduceOp(7).String(); s != "minReduceOp(7)" {
		t.Errorf("ReduceOp.String: %q", s)
	}
	ctx.Close()
	if err := ctx.MetricsReduce(v, ReduceSum); !errors.Is(err, ErrInvalidState) {
		t.Errorf("MetricsReduce after Close = %v, want ErrInvalidState", err)
	}
}
