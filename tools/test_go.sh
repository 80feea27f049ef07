#!/usr/bin/env bash
# Tests the Go binding (bindings/go) and its example (examples/go) against an
# already built libfsdp: gofmt, go vet, go test, and a short training run.
# Offline, standard library only. Needs golang-go (go >= 1.19) and a C compiler.
#
#   tools/test_go.sh [BUILD_DIR]     (default: $FSDP_BUILD_DIR or build/default)
#
# With FSDP_GO_PKGCONFIG=1 it uses an installed libfsdp found by pkg-config
# (-tags fsdp_pkgconfig; set PKG_CONFIG_PATH) instead of BUILD_DIR.
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
build=${1:-${FSDP_BUILD_DIR:-build/default}}
build=$(cd "$build" 2>/dev/null && pwd) || { echo "test_go.sh: no build directory '${1:-${FSDP_BUILD_DIR:-build/default}}'" >&2; exit 2; }
command -v go >/dev/null || { echo "test_go.sh: go not found (apt-get install golang-go)" >&2; exit 2; }

export CGO_ENABLED=1 GOFLAGS=-mod=mod GOPROXY=off GOTOOLCHAIN=local GOTELEMETRY=off
export GOCACHE=$root/build/gocache GOPATH=$root/build/gopath GOMODCACHE=$root/build/gopath/pkg/mod
tags=()
if [ "${FSDP_GO_PKGCONFIG:-0}" = 1 ]; then
  tags=(-tags fsdp_pkgconfig)
  libdir=$(pkg-config --variable=libdir fsdp)
  export CGO_LDFLAGS="-Wl,-rpath,$libdir ${CGO_LDFLAGS:-}"
else
  [ -e "$build/src/libfsdp.so" ] || { echo "test_go.sh: $build/src/libfsdp.so missing: build libfsdp first" >&2; exit 2; }
  export CGO_LDFLAGS="-L$build/src -Wl,-rpath,$build/src ${CGO_LDFLAGS:-}"
fi

bad=$(gofmt -l bindings/go examples/go)
[ -z "$bad" ] || { echo "test_go.sh: not gofmt-ed: $bad" >&2; exit 1; }
echo "== bindings/go: go vet, go test"
(cd bindings/go && go vet "${tags[@]}" ./... && go test "${tags[@]}" -count=1 -timeout 120s ./...)
echo "== examples/go: go vet, train_mlp on 4 goroutine-ranks"
(cd examples/go && go vet "${tags[@]}" ./... && go run "${tags[@]}" ./train_mlp -ranks 4 -steps 30 -check)
echo "test_go.sh: OK"
