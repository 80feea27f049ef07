// train_mlp - the libfsdp Go demo: an MLP regression trained by N ranks that
// are goroutines of this process (FULL_SHARD by default), printing the loss
// and each rank's memory. The model code (forward and backward of Linear+tanh
// layers by hand) is the host's; libfsdp owns params, grads, optimizer state
// and collectives (the loss of a step is averaged over the ranks with
// MetricsReduce).
//
//	go run ./train_mlp [--ranks 4] [--steps 40] [--dtype fp32|bf16|fp16] [--sharding FULL_SHARD]
//	                   [--save DIR] [--resume DIR] [--check]
//
// --save DIR writes a sharded checkpoint after the last step; --resume DIR
// loads one (saved at any rank count) before the first step, and the steps go
// on from the checkpoint's optimizer step. --check exits with status 1 unless
// the loss fell at least 4x. The last line, "summary: first_step=.. first_loss=..
// last_step=.. last_loss=..", is for scripts (tools/test_go.sh).
// Go's flag package takes -x as well as --x. FSDP_* environment variables
// override options (e.g. FSDP_SHARDING=NO_SHARD).
package main

import (
	"flag"
	"fmt"
	"math"
	"os"

	fsdp "github.com/libfsdp/fsdp-go"
)

var dims = []int{32, 128, 128, 128, 8}

const batch = 64

// uniform is splitmix64 mapped to [-1, 1).
func uniform(s *uint64) float32 {
	*s += 0x9e3779b97f4a7c15
	z := *s
	z = (z ^ z>>30) * 0xbf58476d1ce4e5b9
	z = (z ^ z>>27) * 0x94d049bb133111eb
	z ^= z >> 31
	return float32(float64(z>>11)/9007199254740992.0*2 - 1)
}

// data: inputs and targets of a smooth teacher the MLP can fit.
func data() (x, y []float32) {
	s := uint64(42)
	in, out := dims[0], dims[len(dims)-1]
	x, y = make([]float32, batch*in), make([]float32, batch*out)
	for b := 0; b < batch; b++ {
		for i := 0; i < in; i++ {
			x[b*in+i] = uniform(&s)
		}
		for o := 0; o < out; o++ {
			var t float64
			for i := 0; i < in; i++ {
				t += float64(x[b*in+i]) * math.Sin(float64(o*in+i))
			}
			y[b*out+o] = float32(math.Tanh(0.3 * t))
		}
	}
	return x, y
}

// params reads param i of u as float32 whatever the context's dtype.
func params(u *fsdp.Unit, i int, dt fsdp.Dtype) ([]float32, error) {
	if dt == fsdp.FP32 {
		return u.Param(i)
	}
	h, err := u.ParamU16(i)
	if err != nil {
		return nil, err
	}
	f := make([]float32, len(h))
	for k, v := range h {
		if dt == fsdp.BF16 {
			f[k] = fsdp.BF16ToFloat32(v)
		} else {
			f[k] = fsdp.FP16ToFloat32(v)
		}
	}
	return f, nil
}

// addGrad adds g into the grad buffer of param i.
func addGrad(u *fsdp.Unit, i int, dt fsdp.Dtype, g []float32) error {
	if dt == fsdp.FP32 {
		buf, err := u.Grad(i)
		for k := range buf {
			buf[k] += g[k]
		}
		return err
	}
	buf, err := u.GradU16(i)
	for k := range buf {
		if dt == fsdp.BF16 {
			buf[k] = fsdp.Float32ToBF16(fsdp.BF16ToFloat32(buf[k]) + g[k])
		} else {
			buf[k] = fsdp.Float32ToFP16(fsdp.FP16ToFloat32(buf[k]) + g[k])
		}
	}
	return err
}

type options struct {
	ranks, steps                  int
	dtype, sharding, save, resume string
	check                         bool
}

// effective is the sharding and dtype in effect, read by rank 0.
var effective struct{ sharding, dtype string }

// train runs one rank; it returns the loss per step (over all ranks' rows)
// and this rank's final memory.
// train runs one rank; step0 receives the optimizer steps a resumed checkpoint
// had taken (Context.StepCount after Load).
func train(o options, rank int, g *fsdp.Group, x, y []float32, step0 *uint64) ([]float64, fsdp.MemoryStats, error) {
	var mem fsdp.MemoryStats
	cfg, err := fsdp.NewConfig()
	if err != nil {
		return nil, mem, err
	}
	defer cfg.Close()
	if err := cfg.SetAll(map[string]string{"sharding": o.sharding, "param_dtype": o.dtype, "reduce_dtype": "fp32",
		"optimizer": "adamw", "lr": "3e-3", "weight_decay": "0.01", "no_weight_decay": "*bias",
		"max_grad_norm": "1.0", "timeout_s": "30"}); err != nil {
		return nil, mem, err
	}
	if err := cfg.FromEnv(); err != nil {
		return nil, mem, err
	}
	if rank == 0 { // what is in effect, FSDP_* variables included
		if effective.sharding, err = cfg.Get("sharding"); err != nil {
			return nil, mem, err
		}
		if effective.dtype, err = cfg.Get("param_dtype"); err != nil {
			return nil, mem, err
		}
	}
	ctx, err := fsdp.NewContext(cfg, g, rank)
	if err != nil {
		return nil, mem, err
	}
	defer ctx.Close()
	dt, err := ctx.ParamDtype()
	if err != nil {
		return nil, mem, err
	}
	n := len(dims) - 1
	units := make([]*fsdp.Unit, n)
	for l := range units { // one unit per layer: weight [out, in], bias [out]
		in, out := dims[l], dims[l+1]
		if units[l], err = ctx.RegisterUnit(fmt.Sprintf("layer%d", l), []fsdp.Param{
			{Name: "weight", Shape: []int64{int64(out), int64(in)}}, {Name: "bias", Shape: []int64{int64(out)}}}); err != nil {
			return nil, mem, err
		}
		s, w := uint64(1000+l), make([]float32, in*out) // same init on every rank
		for k := range w {
			w[k] = uniform(&s) * float32(math.Sqrt(3/float64(in)))
		}
		if err := units[l].SetValues(0, w); err != nil {
			return nil, mem, err
		}
		if err := units[l].SetValues(1, make([]float32, out)); err != nil {
			return nil, mem, err
		}
	}
	if o.resume != "" { // after registering (and initializing) the units
		if err := ctx.Load(o.resume); err != nil {
			return nil, mem, err
		}
		if *step0, err = ctx.StepCount(); err != nil {
			return nil, mem, err
		}
	}
	rows := batch / o.ranks
	row0, out := rank*rows, dims[n]
	losses := make([]float64, o.steps)
	for step := range losses {
		scale, _, err := ctx.LossScale() // 1 unless fp16 loss scaling
		if err != nil {
			return nil, mem, err
		}
		acts := [][]float32{x[row0*dims[0] : (row0+rows)*dims[0]]}
		for l, u := range units { // forward: a = tanh(W a + b), linear last layer
			if err := u.ForwardBegin(); err != nil {
				return nil, mem, err
			}
			w, err1 := params(u, 0, dt)
			b, err2 := params(u, 1, dt)
			if err1 != nil || err2 != nil {
				return nil, mem, fmt.Errorf("params: %v %v", err1, err2)
			}
			in, o := dims[l], dims[l+1]
			a := make([]float32, rows*o)
			for r := 0; r < rows; r++ {
				for j := 0; j < o; j++ {
					s := b[j]
					for i := 0; i < in; i++ {
						s += w[j*in+i] * acts[l][r*in+i]
					}
					if l+1 < n {
						s = float32(math.Tanh(float64(s)))
					}
					a[r*o+j] = s
				}
			}
			acts = append(acts, a)
			if err := u.ForwardEnd(); err != nil {
				return nil, mem, err
			}
		}
		d := make([]float32, rows*out) // loss = mean over rows of sum of squared errors / 2
		for k := range d {
			e := acts[n][k] - y[row0*out+k]
			losses[step] += 0.5 * float64(e*e) / float64(rows)
			d[k] = float32(float64(e) * scale / float64(rows))
		}
		for l := n - 1; l >= 0; l-- { // backward
			u := units[l]
			if err := u.BackwardBegin(); err != nil {
				return nil, mem, err
			}
			w, err := params(u, 0, dt)
			if err != nil {
				return nil, mem, err
			}
			in, o := dims[l], dims[l+1]
			gw, gb, dx := make([]float32, in*o), make([]float32, o), make([]float32, rows*in)
			for r := 0; r < rows; r++ {
				for j := 0; j < o; j++ {
					dj := d[r*o+j]
					if l+1 < n {
						dj *= 1 - acts[l+1][r*o+j]*acts[l+1][r*o+j]
					}
					gb[j] += dj
					for i := 0; i < in; i++ {
						gw[j*in+i] += dj * acts[l][r*in+i]
						dx[r*in+i] += dj * w[j*in+i]
					}
				}
			}
			if err := addGrad(u, 0, dt, gw); err != nil {
				return nil, mem, err
			}
			if err := addGrad(u, 1, dt, gb); err != nil {
				return nil, mem, err
			}
			if err := u.BackwardEnd(); err != nil {
				return nil, mem, err
			}
			d = dx
		}
		if err := ctx.Step(); err != nil {
			return nil, mem, err
		}
		// The loss over the global batch: the mean of the ranks' losses (each
		// rank has as many rows), the same bits on every rank.
		mean := losses[step : step+1]
		if err := ctx.MetricsReduce(mean, fsdp.ReduceAvg); err != nil {
			return nil, mem, err
		}
	}
	if o.save != "" {
		if err := ctx.Save(o.save, "sharded"); err != nil {
			return nil, mem, err
		}
	}
	if mem, err = ctx.MemoryStats(); err != nil {
		return nil, mem, err
	}
	return losses, mem, ctx.Finalize()
}

func mib(n uint64) float64 { return float64(n) / (1 << 20) }

func fail(format string, a ...interface{}) {
	fmt.Fprintf(os.Stderr, "train_mlp: "+format+"\n", a...)
	os.Exit(1)
}

func main() {
	var o options
	flag.IntVar(&o.ranks, "ranks", 4, "goroutine-ranks (must divide 64)")
	flag.IntVar(&o.steps, "steps", 40, "training steps")
	flag.StringVar(&o.dtype, "dtype", "fp32", "param_dtype: fp32, bf16, fp16")
	flag.StringVar(&o.sharding, "sharding", "FULL_SHARD", "FULL_SHARD, SHARD_GRAD_OP, NO_SHARD, HYBRID_SHARD, HYBRID_SHARD_ZERO2")
	flag.StringVar(&o.save, "save", "", "after the last step, save a sharded checkpoint into `DIR`")
	flag.StringVar(&o.resume, "resume", "", "before the first step, load the checkpoint in `DIR` (any rank count)")
	flag.BoolVar(&o.check, "check", false, "exit 1 unless the loss fell at least 4x")
	flag.Parse()
	if flag.NArg() > 0 || o.ranks < 1 || batch%o.ranks != 0 || o.steps < 1 {
		fmt.Fprintf(os.Stderr, "train_mlp: --ranks must divide %d, --steps be >= 1, and no other arguments\n", batch)
		flag.Usage()
		os.Exit(2)
	}
	x, y := data()
	losses := make([][]float64, o.ranks) // every rank has the same
	mems := make([]fsdp.MemoryStats, o.ranks)
	steps0 := make([]uint64, o.ranks)
	err := fsdp.RunRanks(o.ranks, func(rank int, g *fsdp.Group) (err error) {
		losses[rank], mems[rank], err = train(o, rank, g, x, y, &steps0[rank])
		return err
	})
	if err != nil {
		fail("%v", err)
	}
	step0 := int(steps0[0]) // the optimizer steps taken before this run
	fmt.Printf("%s\nMLP %v, %d units, global batch %d over %d goroutine-ranks, %s, param_dtype %s, AdamW\n",
		fsdp.BuildInfo(), dims, len(dims)-1, batch, o.ranks, effective.sharding, effective.dtype)
	if o.resume != "" {
		fmt.Printf("resumed from %s (optimizer step %d)\n", o.resume, step0)
	}
	fmt.Printf("\nstep: optimizer step; loss: 0.5 * squared error summed over the %d outputs, mean over the %d rows,\n"+
		"in the step's forward (before its update)\n", dims[len(dims)-1], batch)
	fmt.Printf("%6s  %10s\n", "step", "loss")
	loss := losses[0]
	for s := range loss {
		if s%10 == 0 || s == o.steps-1 {
			fmt.Printf("%6d  %10.6f\n", step0+s+1, loss[s])
		}
	}
	if o.save != "" {
		fmt.Printf("saved a sharded checkpoint to %s after step %d\n", o.save, step0+o.steps)
	}
	fmt.Printf("\nper-rank memory in MiB: params = this rank's param shard (fp32 master, and a param_dtype copy where kept);\n" +
		"grads = its fp32 grad shard; optim = its AdamW state (m, v); gathered-peak = the most held by full\n" +
		"params gathered for forward and backward; total-peak = the most this rank held at once, all included\n")
	fmt.Printf("%-16s  %7s %7s %7s  %13s  %10s\n", "", "params", "grads", "optim", "gathered-peak", "total-peak")
	for r, m := range mems {
		fmt.Printf("%-16s  %7.3f %7.3f %7.3f  %13.3f  %10.3f\n", fmt.Sprintf("  rank %d of %d", r, o.ranks),
			mib(m.ShardedParams), mib(m.ShardedGrads), mib(m.OptimizerState), mib(m.GatheredParamsPeak), mib(m.TotalPeak))
	}
	fmt.Printf("\nsummary: first_step=%d first_loss=%.7g last_step=%d last_loss=%.7g\n",
		step0+1, loss[0], step0+o.steps, loss[o.steps-1])
	if o.check && !(loss[o.steps-1]*4 < loss[0]) {
		fail("check failed: loss %g -> %g did not fall 4x", loss[0], loss[o.steps-1])
	}
}
