// cgo_pkgconfig.go - build flags for an installed libfsdp found by pkg-config
// (fsdp.pc; set PKG_CONFIG_PATH to <prefix>/lib/pkgconfig if needed). Selected
// with: go build -tags fsdp_pkgconfig.

//go:build fsdp_pkgconfig

package fsdp

// #cgo pkg-config: fsdp
import "C"
