// config.go - Config: the key/value options of docs/configuration.md.

package fsdp

// #include <stdlib.h>
// #include "fsdp.h"
import "C"

import "unsafe"

// Config holds options (key/value strings). Close it when done; a Context
// copies it at creation.
type Config struct {
	ptr *C.fsdp_config_t
}

// NewConfig creates a Config with every option at its default.
func NewConfig() (*Config, error) {
	var p *C.fsdp_config_t
	if err := call("fsdp_config_create", func() C.fsdp_status_t { return C.fsdp_config_create(&p) }); err != nil {
		return nil, err
	}
	return &Config{ptr: p}, nil
}

// Set sets option key to value; an unknown key or a bad value is
// ErrInvalidArgument with a message listing the valid choices.
func (c *Config) Set(key, value string) error {
	if c == nil || c.ptr == nil {
		return closedError("Config")
	}
	k, v := C.CString(key), C.CString(value)
	defer C.free(unsafe.Pointer(k))
	defer C.free(unsafe.Pointer(v))
	return call("fsdp_config_set", func() C.fsdp_status_t { return C.fsdp_config_set(c.ptr, k, v) })
}

// SetAll sets several options, stopping at the first error.
func (c *Config) SetAll(opts map[string]string) error {
	for k, v := range opts {
		if err := c.Set(k, v); err != nil {
			return err
		}
	}
	return nil
}

// Get returns the canonical value of key (e.g. "SHARD_GRAD_OP" after "ZERO2").
func (c *Config) Get(key string) (string, error) {
	if c == nil || c.ptr == nil {
		return "", closedError("Config")
	}
	k := C.CString(key)
	defer C.free(unsafe.Pointer(k))
	for size := 128; ; {
		buf := (*C.char)(C.malloc(C.size_t(size)))
		var n C.size_t
		err := call("fsdp_config_get", func() C.fsdp_status_t {
			return C.fsdp_config_get(c.ptr, k, buf, C.size_t(size), &n)
		})
		if err == nil {
			s := C.GoStringN(buf, C.int(n))
			C.free(unsafe.Pointer(buf))
			return s, nil
		}
		C.free(unsafe.Pointer(buf))
		if int(n)+1 <= size { // not a too-small buffer: a real error
			return "", err
		}
		size = int(n) + 1
	}
}

// FromEnv applies every FSDP_<KEY> environment variable naming an option;
// they override values already set.
func (c *Config) FromEnv() error {
	if c == nil || c.ptr == nil {
		return closedError("Config")
	}
	return call("fsdp_config_from_env", func() C.fsdp_status_t { return C.fsdp_config_from_env(c.ptr) })
}

// Close frees the Config; calling it again does nothing.
func (c *Config) Close() {
	if c != nil && c.ptr != nil {
		C.fsdp_config_destroy(c.ptr)
		c.ptr = nil
	}
}
