// checkpoint.go - a Context's checkpoints: Save, Load, LoadPartial,
// LoadReport, SaveAsync/SaveWait, Snapshot/Restore, LoadPretrained and Export
// (docs/checkpoints.md).

package fsdp

// #include <stdlib.h>
// #include "fsdp.h"
import "C"

import (
	"fmt"
	"strings"
	"unsafe"
)

// withCString runs f with s as a C string (freed afterwards).
func withCString(s string, f func(*C.char) error) error {
	cs := C.CString(s)
	defer C.free(unsafe.Pointer(cs))
	return f(cs)
}

// Save (collective) writes a checkpoint into dir; kind is "sharded" or "full".
func (c *Context) Save(dir, kind string) error {
	if err := c.live("fsdp_save"); err != nil {
		return err
	}
	return withCString(dir, func(d *C.char) error {
		return withCString(kind, func(k *C.char) error {
			return call("fsdp_save", func() C.fsdp_status_t { return C.fsdp_save(c.ptr, d, k) })
		})
	})
}

// Load (collective) restores a checkpoint of either kind from dir.
func (c *Context) Load(dir string) error {
	if err := c.live("fsdp_load"); err != nil {
		return err
	}
	return withCString(dir, func(d *C.char) error {
		return call("fsdp_load", func() C.fsdp_status_t { return C.fsdp_load(c.ptr, d) })
	})
}

// SaveAsync (collective) is Save(dir, "sharded") without the wait for the
// file system (fsdp_save_async): the state at the call (every step queued
// before it) is copied into host memory, and a background thread writes and
// commits the checkpoint as crash-safely as Save (dir holds the old checkpoint
// or the new one). Training may go on meanwhile. The next SaveAsync, Save,
// Load, LoadPartial or Restore first waits for it and, if it failed with no
// call reporting it yet, returns its error and does nothing else.
func (c *Context) SaveAsync(dir string) error {
	if err := c.live("fsdp_save_async"); err != nil {
		return err
	}
	return withCString(dir, func(d *C.char) error {
		return call("fsdp_save_async", func() C.fsdp_status_t { return C.fsdp_save_async(c.ptr, d) })
	})
}

// SaveWait (local) waits for the last SaveAsync to be written and committed
// and returns its error, once (a later wait returns nil); nil at once when
// none is pending. Close waits as well.
func (c *Context) SaveWait() error {
	return c.simple("fsdp_save_wait", func() C.fsdp_status_t { return C.fsdp_save_wait(c.ptr) })
}

// Snapshot (collective) copies the rank's state (what Save writes) into a
// snapshot under path, a directory every process of the job on this node
// sees, best on a memory file system (/dev/shm/<job>): path/rank<R>/ holds
// two slots and a marker, so a process killed mid-copy leaves the previous
// snapshot restorable. Not crash-safe across a reboot (fsdp_snapshot).
func (c *Context) Snapshot(path string) error {
	if err := c.live("fsdp_snapshot"); err != nil {
		return err
	}
	return withCString(path, func(p *C.char) error {
		return call("fsdp_snapshot", func() C.fsdp_status_t { return C.fsdp_snapshot(c.ptr, p) })
	})
}

// RestoreSource says what Restore restored (fsdp_restore_source_t).
type RestoreSource int

// The sources of fsdp.h.
const (
	RestoredNothing    RestoreSource = C.FSDP_RESTORED_NOTHING    // neither: the state is as it was
	RestoredSnapshot   RestoreSource = C.FSDP_RESTORED_SNAPSHOT   // Snapshot's copy
	RestoredCheckpoint RestoreSource = C.FSDP_RESTORED_CHECKPOINT // the checkpoint at checkpointDir
)

func (s RestoreSource) String() string {
	switch s {
	case RestoredNothing:
		return "nothing"
	case RestoredSnapshot:
		return "snapshot"
	case RestoredCheckpoint:
		return "checkpoint"
	}
	return fmt.Sprintf("RestoreSource(%d)", int(s))
}

// Restore (collective), in a job restarted at the same world size, restores
// the newest step that every rank's snapshot under path holds whole (params,
// optimizer state, step, learning rate, loss scale), else loads the
// checkpoint at checkpointDir, else changes nothing; "" skips either. A
// checkpoint that exists but does not load is an error (Load's).
func (c *Context) Restore(path, checkpointDir string) (RestoreSource, error) {
	if err := c.live("fsdp_restore"); err != nil {
		return RestoredNothing, err
	}
	var source C.int
	err := withCString(path, func(p *C.char) error {
		return withCString(checkpointDir, func(d *C.char) error {
			return call("fsdp_restore", func() C.fsdp_status_t { return C.fsdp_restore(c.ptr, p, d, &source) })
		})
	})
	if err != nil {
		return RestoredNothing, err
	}
	return RestoreSource(source), nil
}

// LoadPartial (collective) is Load, not strict: the registered params the
// checkpoint has get its values and optimizer state, the others keep theirs,
// and the checkpoint's params that are not registered are ignored; it
// returns the names of both (as LoadReport).
func (c *Context) LoadPartial(dir string) (missing, unexpected []string, err error) {
	if err = c.live("fsdp_load_partial"); err != nil {
		return nil, nil, err
	}
	err = withCString(dir, func(d *C.char) error {
		return call("fsdp_load_partial", func() C.fsdp_status_t { return C.fsdp_load_partial(c.ptr, d) })
	})
	if err != nil {
		return nil, nil, err
	}
	return c.LoadReport()
}

// LoadPretrained (collective) sets the params from safetensors weights that
// any program wrote (a file, or a Hugging Face directory with
// model.safetensors or its index), by name; options are fsdp_load_pretrained's
// "key=value" items separated by ';' (strip_prefix, add_prefix,
// rename=FROM:TO, transpose=GLOB, strict=0|1; "" for none). The optimizer
// state restarts. It returns what was left out, as LoadReport.
func (c *Context) LoadPretrained(path, options string) (missing, unexpected []string, err error) {
	if err = c.live("fsdp_load_pretrained"); err != nil {
		return nil, nil, err
	}
	err = withCString(path, func(p *C.char) error {
		return withCString(options, func(o *C.char) error {
			return call("fsdp_load_pretrained", func() C.fsdp_status_t { return C.fsdp_load_pretrained(c.ptr, p, o) })
		})
	})
	if err != nil {
		return nil, nil, err
	}
	return c.LoadReport()
}

// Export (collective) writes the params, consolidated, as safetensors files
// another program loads (fsdp_export): options are LoadPretrained's naming
// items, applied in reverse, plus dtype=fp32|bf16 and max_shard_bytes=N.
func (c *Context) Export(dir, options string) error {
	if err := c.live("fsdp_export"); err != nil {
		return err
	}
	return withCString(dir, func(d *C.char) error {
		return withCString(options, func(o *C.char) error {
			return call("fsdp_export", func() C.fsdp_status_t { return C.fsdp_export(c.ptr, d, o) })
		})
	})
}

// LoadReport is what the last successful Load or LoadPartial left out: the
// registered params the checkpoint lacked, and its params not registered.
func (c *Context) LoadReport() (missing, unexpected []string, err error) {
	if err = c.live("fsdp_load_report"); err != nil {
		return nil, nil, err
	}
	var n C.size_t
	// The length first (a NULL buffer is refused, but the length comes back).
	_ = call("fsdp_load_report", func() C.fsdp_status_t { return C.fsdp_load_report(c.ptr, nil, 0, &n) })
	buf := (*C.char)(C.malloc(n + 1))
	defer C.free(unsafe.Pointer(buf))
	if err = call("fsdp_load_report", func() C.fsdp_status_t { return C.fsdp_load_report(c.ptr, buf, n+1, &n) }); err != nil {
		return nil, nil, err
	}
	for _, line := range strings.Split(C.GoStringN(buf, C.int(n)), "\n") {
		if strings.HasPrefix(line, "missing: ") {
			missing = append(missing, strings.TrimPrefix(line, "missing: "))
		} else if strings.HasPrefix(line, "unexpected: ") {
			unexpected = append(unexpected, strings.TrimPrefix(line, "unexpected: "))
		}
	}
	return missing, unexpected, nil
}
