// async_test.go - SaveAsync/SaveWait and Snapshot/Restore against the same
// 2-rank run without checkpoint calls (same init, data and ranks), bitwise.

package fsdp

import (
	"errors"
	"os"
	"path/filepath"
	"testing"
)

// ckptRun trains the MLP on 2 ranks from init: first(ctx) runs before the
// steps (its source returned), at(ctx, step) after each step. It returns
// rank 0's source and its gathered params before the first step and after
// each.
func ckptRun(t *testing.T, steps int, first func(*Context) (RestoreSource, error),
	at func(ctx *Context, step int) error) (RestoreSource, []tensors) {
	t.Helper()
	init := makeInit()
	x, y := makeData()
	var (
		source RestoreSource
		states []tensors
	)
	err := RunRanks(2, func(rank int, g *Group) error {
		ctx, err := newRankContext(g, rank, map[string]string{"sharding": "FULL_SHARD"})
		if err != nil {
			return err
		}
		defer ctx.Close()
		units, err := registerMLP(ctx, init)
		if err != nil {
			return err
		}
		var src RestoreSource
		if first != nil {
			if src, err = first(ctx); err != nil {
				return err
			}
		}
		p, err := gatherAll(units)
		if err != nil {
			return err
		}
		got := []tensors{p}
		for s := 1; s <= steps; s++ {
			io := &libIO{units: units}
			pass(io, x, y, rank*batch/2, batch/2)
			if io.err != nil {
				return io.err
			}
			if err := ctx.Step(); err != nil {
				return err
			}
			if at != nil {
				if err := at(ctx, s); err != nil {
					return err
				}
			}
			if p, err = gatherAll(units); err != nil {
				return err
			}
			got = append(got, p)
		}
		if rank == 0 {
			source, states = src, got
		}
		return ctx.Finalize()
	})
	if err != nil {
		t.Fatal(err)
	}
	return source, states
}

// sameBits reports whether a and b hold the same float32 bits.
func sameBits(a, b tensors) bool {
	for l := range b {
		for i := range b[l] {
			for k := range b[l][i] {
				if a[l][i][k] != b[l][i][k] {
					return false
				}
			}
		}
	}
	return true
}

// SaveAsync at step 3 of 5 leaves the run as the reference; after SaveWait
// a fresh context loads step 3 bitwise and trains on to the reference's
// step 5 (the optimizer state and step came back).
func TestSaveAsyncThenLoad(t *testing.T) {
	ck := filepath.Join(t.TempDir(), "ck")
	_, ref := ckptRun(t, 5, nil, nil)
	if sameBits(ref[3], ref[5]) {
		t.Fatal("the steps do not move the params: the test would prove nothing")
	}
	_, got := ckptRun(t, 5, nil, func(ctx *Context, step int) error {
		switch step {
		case 3:
			return ctx.SaveAsync(ck)
		case 5:
			if err := ctx.SaveWait(); err != nil {
				return err
			}
			return ctx.SaveWait() // none pending
		}
		return nil
	})
	for s := range ref {
		if !sameBits(got[s], ref[s]) {
			t.Errorf("step %d of the run with SaveAsync differs from the run without", s)
		}
	}
	_, loaded := ckptRun(t, 2, func(ctx *Context) (RestoreSource, error) {
		if err := ctx.Load(ck); err != nil {
			return 0, err
		}
		n, err := ctx.StepCount()
		if err == nil && n != 3 {
			t.Errorf("StepCount after Load = %d, want 3", n)
		}
		return 0, err
	}, nil)
	for k := 0; k < 3; k++ {
		if !sameBits(loaded[k], ref[3+k]) {
			t.Errorf("%d steps after Load: the params differ from the reference's step %d", k, 3+k)
		}
	}
}

// Snapshots at steps 3 and 5, then a step more: Restore gives step 5 and the
// next step is the reference's; with rank 1's snapshot gone it falls back to
// the checkpoint (step 2), and with neither it changes nothing.
func TestSnapshotRestore(t *testing.T) {
	tmp := t.TempDir()
	shm, ck := filepath.Join(tmp, "shm"), filepath.Join(tmp, "ck")
	_, ref := ckptRun(t, 6, nil, nil)
	_, got := ckptRun(t, 6, nil, func(ctx *Context, step int) error {
		switch step {
		case 2:
			return ctx.SaveAsync(ck)
		case 3, 5:
			return ctx.Snapshot(shm)
		case 6:
			return ctx.SaveWait()
		}
		return nil
	})
	if !sameBits(got[6], ref[6]) {
		t.Errorf("the run with snapshots differs from the run without")
	}
	restore := func(path, dir string) func(*Context) (RestoreSource, error) {
		return func(ctx *Context) (RestoreSource, error) { return ctx.Restore(path, dir) }
	}
	for _, c := range []struct {
		path, dir string
		want      RestoreSource
		step      int
	}{{shm, ck, RestoredSnapshot, 5}, {shm, "", RestoredSnapshot, 5}, {"", ck, RestoredCheckpoint, 2}} {
		source, states := ckptRun(t, 1, restore(c.path, c.dir), nil)
		if source != c.want {
			t.Errorf("Restore(%q, %q) = %v, want %v", c.path, c.dir, source, c.want)
		}
		if !sameBits(states[0], ref[c.step]) || !sameBits(states[1], ref[c.step+1]) {
			t.Errorf("Restore(%q, %q): the params or the next step differ from the reference's step %d", c.path,
				c.dir, c.step)
		}
	}
	if err := os.RemoveAll(filepath.Join(shm, "rank1")); err != nil {
		t.Fatal(err)
	}
	if source, states := ckptRun(t, 0, restore(shm, ck), nil); source != RestoredCheckpoint ||
		!sameBits(states[0], ref[2]) {
		t.Errorf("with rank 1's snapshot gone: %v, want the checkpoint's step 2 (%v)", source, RestoredCheckpoint)
	}
	if source, states := ckptRun(t, 0, restore(shm, filepath.Join(tmp, "none")), nil); source != RestoredNothing ||
		!sameBits(states[0], ref[0]) {
		t.Errorf("with neither: %v, want the params as they were (%v)", source, RestoredNothing)
	}
	if s := RestoredCheckpoint.String(); s != "checkpoint" {
		t.Errorf("RestoredCheckpoint.String() = %q", s)
	}
}

// Bad calls return errors: no dir, a unit in use; a closed context.
func TestAsyncCheckpointErrors(t *testing.T) {
	ctx, units := oneRank(t, nil)
	var fe *Error
	if err := ctx.SaveAsync(""); !errors.Is(err, ErrInvalidArgument) || !errors.As(err, &fe) || fe.Op != "fsdp_save_async" {
		t.Errorf(`SaveAsync("") = %v, want ErrInvalidArgument from fsdp_save_async`, err)
	}
	if err := ctx.Snapshot(""); !errors.Is(err, ErrInvalidArgument) {
		t.Errorf(`Snapshot("") = %v, want ErrInvalidArgument`, err)
	}
	if err := ctx.SaveWait(); err != nil {
		t.Errorf("SaveWait with none pending = %v", err)
	}
	if err := units[0].ForwardBegin(); err != nil {
		t.Fatal(err)
	}
	if err := ctx.SaveAsync(t.TempDir()); !errors.Is(err, ErrInvalidState) {
		t.Errorf("SaveAsync with a unit in use = %v, want ErrInvalidState", err)
	}
	if err := ctx.Snapshot(t.TempDir()); !errors.Is(err, ErrInvalidState) {
		t.Errorf("Snapshot with a unit in use = %v, want ErrInvalidState", err)
	}
	if err := units[0].ForwardEnd(); err != nil {
		t.Fatal(err)
	}
	if source, err := ctx.Restore("", ""); err != nil || source != RestoredNothing {
		t.Errorf(`Restore("", "") = %v, %v; want nothing`, source, err)
	}
	ctx.Close()
	if err := ctx.SaveWait(); !errors.Is(err, ErrInvalidState) {
		t.Errorf("SaveWait after Close = %v, want ErrInvalidState", err)
	}
	if _, err := ctx.Restore("", ""); !errors.Is(err, ErrInvalidState) {
		t.Errorf("Restore after Close = %v, want ErrInvalidState", err)
	}
}
