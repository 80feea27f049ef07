// cgo_repo.go - build flags for a libfsdp source checkout (the default): the
// header from ../../include and the library from ../../build/default/src (what
// ./tools/demo.sh or `cmake --build --preset default` builds), linked with an
// rpath to that directory, so the program finds libfsdp.so at run time without
// LD_LIBRARY_PATH. CGO_LDFLAGS comes first on the link line, so
// CGO_LDFLAGS="-L<dir> -Wl,-rpath,<dir>" picks another build, and its rpath
// comes first too, so the program also loads that one (tools/test_go.sh does
// this for its BUILD_DIR; for the GPU build of tools/gpu-check.sh,
// CGO_LDFLAGS="-L$PWD/build/gpu/src -Wl,-rpath,$PWD/build/gpu/src"). Build with -tags fsdp_pkgconfig to use an
// installed libfsdp through pkg-config instead (cgo_pkgconfig.go).

//go:build !fsdp_pkgconfig

package fsdp

// #cgo CFLAGS: -I${SRCDIR}/../../include
// #cgo LDFLAGS: -L${SRCDIR}/../../build/default/src -Wl,-rpath,${SRCDIR}/../../build/default/src -lfsdp
import "C"
