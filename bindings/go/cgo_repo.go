// cgo_repo.go - build flags for a libfsdp source checkout (the default): the
// header from ../../include, the library from CGO_LDFLAGS (tools/test_go.sh
// sets -L<build>/src -Wl,-rpath,<build>/src). Build with -tags fsdp_pkgconfig
// to use an installed libfsdp through pkg-config instead (cgo_pkgconfig.go).

//go:build !fsdp_pkgconfig

package fsdp

// #cgo CFLAGS: -I${SRCDIR}/../../include
// #cgo LDFLAGS: -lfsdp
import "C"
