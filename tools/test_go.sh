#!/usr/bin/env bash
# Tests the Go binding (bindings/go) and its example (examples/go) against an
# already built libfsdp: gofmt, go vet, go test, and the example: a 4-rank run
# that must learn (--check) and saves a checkpoint, a 2-rank run resumed from
# it, and an uninterrupted 4-rank run to compare the resumed one with.
# Offline, standard library only. Needs golang-go (go >= 1.19) and a C compiler.
#
#   tools/test_go.sh [BUILD_DIR]     (default: $FSDP_BUILD_DIR or build/default)
#
# For build/default it sets no CGO_LDFLAGS: the binding's own flags
# (bindings/go/cgo_repo.go) find the library there, as for a user's `go run`.
# For another BUILD_DIR it puts -L and -rpath for BUILD_DIR/src in CGO_LDFLAGS,
# which come first on the link line. Either way it checks that the example is
# linked against BUILD_DIR/src/libfsdp.so.
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
  lib=$libdir/libfsdp.so
else
  [ -e "$build/src/libfsdp.so" ] || { echo "test_go.sh: $build/src/libfsdp.so missing: build libfsdp first" >&2; exit 2; }
  if [ "$build" != "$root/build/default" ]; then
    export CGO_LDFLAGS="-L$build/src -Wl,-rpath,$build/src ${CGO_LDFLAGS:-}"
  fi
  lib=$build/src/libfsdp.so
fi

bad=$(gofmt -l bindings/go examples/go)
[ -z "$bad" ] || { echo "test_go.sh: not gofmt-ed: $bad" >&2; exit 1; }
echo "== bindings/go: go vet, go test"
(cd bindings/go && go vet "${tags[@]}" ./... && go test "${tags[@]}" -count=1 -timeout 120s ./...)

echo "== examples/go: go vet, go build, the library it loads"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
(cd examples/go && go vet "${tags[@]}" ./... && go build "${tags[@]}" -o "$tmp/train_mlp" ./train_mlp)
loaded=$(ldd "$tmp/train_mlp" | awk '$1 ~ /^libfsdp\.so/ {print $3}')
[ -n "$loaded" ] && [ "$(readlink -f "$loaded")" = "$(readlink -f "$lib")" ] ||
  { echo "test_go.sh: the example loads libfsdp from '${loaded:-nowhere}', not $lib" >&2; exit 1; }
echo "loads $loaded"

# summary FILE KEY: the KEY=value of the example's last line, "summary: ...".
summary() { sed -n "s/^summary: .*\<$2=\([^ ]*\).*/\1/p" "$1"; }
run() { # run NAME ARGS...: the example, its output shown and kept in $tmp/NAME
  local name=$1
  shift
  echo "== examples/go: train_mlp $*"
  "$tmp/train_mlp" "$@" | tee "$tmp/$name"
}
run saved --ranks 4 --steps 30 --check --save "$tmp/ckpt"
run resumed --ranks 2 --steps 10 --resume "$tmp/ckpt"
run whole --ranks 4 --steps 40

# The resumed run goes on where the saved one stopped: its steps continue the
# count, its first loss (the params after the saved run's last update) is a
# little below the saved run's last loss, not the fresh start's (about 200x
# higher), and after 10 more steps (params and AdamW state restored) its loss
# is that of an uninterrupted 40-step run (fp32; 2 and 4 ranks sum in another
# order, a relative difference far below 1e-4).
echo "== resume: saved run's last step and loss, resumed run's first and last, uninterrupted run's last"
read -r saved_step saved_loss first_step first_loss resumed_loss whole_loss <<<"$(summary "$tmp/saved" last_step) \
$(summary "$tmp/saved" last_loss) $(summary "$tmp/resumed" first_step) $(summary "$tmp/resumed" first_loss) \
$(summary "$tmp/resumed" last_loss) $(summary "$tmp/whole" last_loss)"
echo "saved: step $saved_step loss $saved_loss; resumed: step $first_step loss $first_loss ... loss $resumed_loss;" \
  "uninterrupted: loss $whole_loss"
[ -n "$whole_loss" ] || { echo "test_go.sh: no summary line in the example's output" >&2; exit 1; }
[ "$first_step" = $((saved_step + 1)) ] ||
  { echo "test_go.sh: the resumed run starts at step $first_step, not $((saved_step + 1))" >&2; exit 1; }
awk -v s="$saved_loss" -v f="$first_loss" 'BEGIN { exit !(f <= 1.05 * s && f >= 0.5 * s) }' ||
  { echo "test_go.sh: the resumed run's first loss $first_loss does not continue from $saved_loss" >&2; exit 1; }
awk -v r="$resumed_loss" -v w="$whole_loss" 'BEGIN { d = r - w; if (d < 0) d = -d; exit !(d <= 1e-4 * w) }' ||
  { echo "test_go.sh: after resuming, loss $resumed_loss differs from the uninterrupted run's $whole_loss" >&2; exit 1; }
echo "test_go.sh: OK"
