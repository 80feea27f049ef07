#!/usr/bin/env bash
# Checks a built libfsdp.so against the ABI recorded in abi/libfsdp.abi
# (libabigail's abidw and abidiff; the promise is in docs/abi.md). Builds nothing.
#
#   tools/check_abi.sh [LIBRARY]            compare (default build/default/src/libfsdp.so)
#   tools/check_abi.sh --update [LIBRARY]   record LIBRARY's ABI as the new baseline
#   --baseline FILE                         another baseline (tools/test_check_abi.py uses it)
#
# Exit 0: no change, only additions (listed), or a new SONAME (a new major:
# record its baseline with --update). Exit 1: under the same SONAME, a
# function or variable removed, a signature or public type changed (abidiff's
# report says which). Exit 2: usage, missing tools or files, abidiff errors.
#
# Only public types count: the headers in include/ say which types are public
# (an opaque handle's definition inside the library is private). Structs that
# carry a leading struct_size may grow at their end: abi/libfsdp.suppr names
# them, and this script checks that their old members kept name, type and
# offset (abidiff's suppression alone would also let a reordering through).
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
baseline="$root/abi/libfsdp.abi"
suppr="$root/abi/libfsdp.suppr"
headers="$root/include"
update=0
lib=""
usage() { echo "usage:" >&2; sed -n '5,7s/^# \{0,1\}//p' "$0" >&2; exit 2; }
while [ $# -gt 0 ]; do
  case "$1" in
    --update) update=1 ;;
    --baseline) [ $# -ge 2 ] || usage; baseline="$2"; shift ;;
    -h|--help) usage ;;
    -*) echo "check_abi: unknown option $1" >&2; usage ;;
    *) [ -z "$lib" ] || usage; lib="$1" ;;
  esac
  shift
done
lib="${lib:-$root/build/default/src/libfsdp.so}"

die() { echo "check_abi: $*" >&2; exit 2; }
for tool in abidw abidiff readelf python3; do
  command -v "$tool" >/dev/null || die "$tool not found: run tools/deps.sh (Debian's abigail-tools, binutils, python3)"
done
[ -f "$lib" ] || die "no library at $lib: build it first (cmake --preset default && cmake --build --preset default --target fsdp)"
[ -f "$headers/fsdp.h" ] || die "no public header at $headers/fsdp.h"
[ -f "$suppr" ] || die "no suppression file at $suppr"
# Without DWARF only symbol names could be compared, and a changed struct or
# signature would pass unseen.
sections="$(readelf -S -W "$lib")" || die "readelf cannot read $lib"
grep -q '\.debug_info' <<<"$sections" ||
  die "$lib has no debug info (.debug_info): build with -g (the default preset, RelWithDebInfo, does)"
lib_soname="$(readelf -d -W "$lib" | sed -n 's/.*Library soname: \[\(.*\)\]$/\1/p')"
[ -n "$lib_soname" ] || die "$lib has no SONAME"
rel() { case "$1" in "$root"/*) echo "${1#"$root"/}" ;; *) echo "$1" ;; esac; }
name="$(rel "$lib") ($lib_soname)"

# The ABI as abidw writes it: exported functions and variables and the types
# they reach, public types only. Keep the locations (file names only):
# abidiff decides which of the baseline's types are public by the header they
# were declared in, and without locations it silently drops changes to public
# structs. Hash type ids keep the diff of a new baseline small.
abidw_() {
  abidw --headers-dir "$headers" --drop-private-types --exported-interfaces-only \
    --no-corpus-path --no-comp-dir-path --short-locs --no-elf-needed \
    --type-id-style hash --out-file "$2" "$1"
}

if [ "$update" = 1 ]; then
  tmp="$baseline.tmp.$$"
  abidw_ "$lib" "$tmp" || { rm -f "$tmp"; die "abidw failed on $lib"; }
  mv "$tmp" "$baseline"
  nfun=$(grep -c "<elf-symbol .*type='func-type'" "$baseline" || true)
  nvar=$(grep -c "<elf-symbol .*type='object-type'" "$baseline" || true)
  echo "check_abi: recorded the ABI of $name in $(rel "$baseline"): $nfun functions, $nvar variables."
  exit 0
fi

[ -f "$baseline" ] || die "no baseline at $(rel "$baseline"): record one with tools/check_abi.sh --update"
base_soname="$(sed -n "s/^<abi-corpus .*soname='\([^']*\)'.*/\1/p" "$baseline" | head -n1)"
[ -n "$base_soname" ] || die "$(rel "$baseline") records no SONAME: not written by check_abi.sh --update?"

work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
abidiff_() {
  abidiff --no-default-suppression --suppressions "$suppr" \
    --headers-dir2 "$headers" --drop-private-types --exported-interfaces-only \
    --fail-no-debug-info "$@" "$baseline" "$lib"
}
# abidiff's status is a bit set: 1 error, 2 usage, 4 ABI change, 8
# incompatible change. Additions count as changes (4); compared again with
# --no-added-syms, a library whose only changes are additions gives 0.
set +e
report="$(abidiff_ 2>&1)"; rc=$?
set -e
if (( rc & 3 )); then
  printf '%s\n' "$report" >&2
  die "abidiff failed (status $rc) comparing $(rel "$baseline") with $lib"
fi
indent() { sed 's/^./  &/'; }
if [ "$lib_soname" != "$base_soname" ]; then
  echo "ABI check: $name: the SONAME changed from $base_soname (the baseline's) to $lib_soname:"
  echo "a new major version, where incompatible changes are allowed. Against the old baseline:"
  printf '%s\n' "$report" | grep -E '^(Functions|Variables) changes summary' | indent
  echo "Record this version's ABI in the same change: tools/check_abi.sh --update  (docs/abi.md)"
  exit 0
fi
problems=""
prc=0
if [ "$rc" != 0 ]; then
  set +e
  problems="$(abidiff_ --no-added-syms 2>&1)"; prc=$?
  set -e
  if (( prc & 3 )); then
    printf '%s\n' "$problems" >&2
    die "abidiff --no-added-syms failed (status $prc)"
  fi
fi

# What abidiff lets through by design: enumerators appended (a harmless change
# to it) and versioned structs grown (abi/libfsdp.suppr). Listed as additions;
# for the versioned structs, the old members must be the new struct's first
# members, unchanged.
abidw_ "$lib" "$work/lib.abi" || die "abidw failed on $lib"
types="$(python3 - "$baseline" "$work/lib.abi" "$suppr" <<'PY'
import re, sys
import xml.etree.ElementTree as ET

def load(path):
    root = ET.parse(path).getroot()
    by_id = {e.get("id"): e for e in root.iter() if e.get("id")}
    def tname(tid, depth=0):
        e = by_id.get(tid)
        if e is None or depth > 20:
            return tid
        if e.get("name") and e.tag != "pointer-type-def":
            return e.get("name")
        inner = tname(e.get("type-id"), depth + 1)
        if e.tag == "pointer-type-def":
            return inner + "*"
        if e.tag == "qualified-type-def":
            return ("const " if e.get("const") == "yes" else "") + ("volatile " if e.get("volatile") == "yes" else "") + inner
        if e.tag == "array-type-def":
            return f"{inner}[{e.get('size-in-bits', '?')} bits]"
        return f"{e.tag} {inner}"
    structs, enums = {}, {}
    for e in root.iter("class-decl"):
        if e.get("is-declaration-only") != "yes":
            members = [(m.find("var-decl").get("name"), tname(m.find("var-decl").get("type-id")),
                        int(m.get("layout-offset-in-bits", "0"))) for m in e.findall("data-member")]
            structs.setdefault(e.get("name"), []).append(members)
    for e in root.iter("enum-decl"):
        if e.get("is-declaration-only") != "yes":
            enums.setdefault(e.get("name"), []).append({x.get("name"): x.get("value") for x in e.findall("enumerator")})
    return structs, enums

old_structs, old_enums = load(sys.argv[1])
new_structs, new_enums = load(sys.argv[2])
versioned = []
for section in re.split(r"^\s*\[", open(sys.argv[3]).read(), flags=re.M)[1:]:
    if section.startswith("suppress_type]") and re.search(r"has_data_member_inserted_at\s*=\s*end", section):
        versioned += re.findall(r"^\s*name\s*=\s*(\S+)", section, flags=re.M)
out = set()
for s in versioned:
    if s not in old_structs:
        continue
    old = old_structs[s][0]
    if s not in new_structs:
        out.add(f"BROKEN struct {s}: gone from the ABI")
    for new in new_structs.get(s, []):
        for i, (o, n) in enumerate(zip(old, new + [None] * len(old))):
            if o != n:
                was = f"'{o[1]} {o[0]}' at bit {o[2]}"
                now = f"'{n[1]} {n[0]}' at bit {n[2]}" if n else "nothing"
                out.add(f"BROKEN struct {s} may only grow at its end (abi/libfsdp.suppr): member {i} was {was}, is now {now}")
                break
        else:
            for n in new[len(old):]:
                out.add(f"ADDED struct {s} grew at its end: '{n[1]} {n[0]}' at bit {n[2]}")
for e, old_list in old_enums.items():
    old = old_list[0]
    for new in new_enums.get(e, []):
        for k, v in old.items():
            if k not in new:
                out.add(f"BROKEN enum {e}: enumerator {k} = {v} is gone")
            elif new[k] != v:
                out.add(f"BROKEN enum {e}: enumerator {k} was {v}, is now {new[k]}")
        for k, v in new.items():
            if k not in old:
                out.add(f"ADDED enum {e}: enumerator {k} = {v}")
print("\n".join(sorted(out)))
PY
)" || die "comparing the public types failed"
broken="$(printf '%s\n' "$types" | sed -n 's/^BROKEN //p')"
added="$(printf '%s\n' "$report" | sed -n "s/^ *\(\[A\] .*\)/\1/p"; printf '%s\n' "$types" | sed -n 's/^ADDED //p')"

if [ "$prc" = 0 ] && [ -z "$broken" ]; then
  if [ -z "$added" ]; then
    echo "ABI check: $name matches $(rel "$baseline"): no change."
  else
    echo "ABI check: $name is compatible with $(rel "$baseline"): only additions:"
    printf '%s\n' "$added" | indent
    echo "(The baseline is refreshed at release time: tools/check_abi.sh --update; docs/abi.md.)"
  fi
  exit 0
fi
echo "ABI check FAILED: $name breaks the ABI recorded in $(rel "$baseline") (same SONAME)."
if [ -n "$broken" ]; then
  printf '%s\n' "$broken" | indent
fi
if [ "$prc" != 0 ]; then
  echo "abidiff's report (additions left out):"
  printf '%s\n' "$problems" | indent
fi
cat <<EOF
Within a major version the ABI only grows (docs/abi.md): undo the change, or add
a new function beside the old one. A new major instead bumps the SONAME (the
major of VERSION in CMakeLists.txt) and runs tools/check_abi.sh --update in the
same change.
EOF
exit 1
