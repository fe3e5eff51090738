#!/usr/bin/env bash
# Checks the layer order of src/ (docs/ARCHITECTURE.md, "Layers"): a file includes headers of
# its own part and of parts in lower layers only, never of a higher layer or of a peer. Parts
# are the folders of src/spes/ (each side of sync/ is a part of its own, ordered inside sync's
# layer) and src/cli. Prints every include that breaks the order, a folder the order does not
# name, and an ARCHITECTURE.md that states another order; exits 1 if there is any. CTest runs
# it as `layering_check`. Leaves out: tests/ and bench/ (they may include anything).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

# Lowest first; the parts of one layer are peers.
layers=("common" "io dashboard" "data" "model" "train" "sync eval interop" "cluster report" "cli")
sync_sides=("wire" "round" "server node")

join() {  # join SEP WORDS...: "a | b"
  local sep="$1" out="" w
  shift
  for w in "$@"; do out="${out:+$out$sep}$w"; done
  printf '%s' "$out"
}
order=""
for l in "${layers[@]}"; do order="${order:+$order < }$(join ' | ' $l)"; done
sides=""
for l in "${sync_sides[@]}"; do sides="${sides:+$sides < }$(join ' | ' $l)"; done
order_line="$order; inside sync: $sides"

declare -A rank side_rank
for i in "${!layers[@]}"; do for p in ${layers[$i]}; do rank[$p]=$i; done; done
for i in "${!sync_sides[@]}"; do for p in ${sync_sides[$i]}; do side_rank[$p]=$i; done; done

bad=0
complain() {
  echo "check_layers: $*"
  bad=1
}

# The part of a path below src/ ("spes/sync/node/node.h" -> "sync/node", "cli/x.cpp" -> "cli").
part_of() {
  local p="$1"
  p="${p#spes/}"
  local top="${p%%/*}"
  if [ "$top" = sync ]; then
    local rest="${p#sync/}"
    if [[ "$rest" == */* ]]; then printf 'sync/%s' "${rest%%/*}"; else printf 'sync/'; fi
  else
    printf '%s' "$top"
  fi
}

# Is part $2 allowed in a file of part $1?
allowed() {
  local from="$1" to="$2"
  [ "$from" = "$to" ] && return 0
  local ft="${from%%/*}" tt="${to%%/*}"
  if [ "$ft" = sync ] && [ "$tt" = sync ]; then
    [ "${side_rank[${to#sync/}]}" -lt "${side_rank[${from#sync/}]}" ]
    return
  fi
  [ "${rank[$tt]}" -lt "${rank[$ft]}" ]
}

known() {
  local part="$1" top="${1%%/*}"
  [ -n "${rank[$top]+x}" ] || return 1
  if [ "$top" = sync ]; then
    local side="${part#sync/}"
    [ -n "$side" ] && [ -n "${side_rank[$side]+x}" ] || return 1
  fi
  return 0
}

while IFS= read -r -d '' file; do
  rel="${file#src/}"
  from="$(part_of "$rel")"
  if ! known "$from"; then
    complain "$file: folder '$from' is not in the layer order; add it to" \
      "scripts/check_layers.sh and docs/ARCHITECTURE.md"
    continue
  fi
  while IFS=: read -r line inc; do
    to="$(part_of "$inc")"
    if ! known "$to"; then
      complain "$file:$line includes '$inc', outside every part of the layer order"
    elif ! allowed "$from" "$to"; then
      complain "$file:$line: $from includes $inc, but $to is not below $from"
    fi
  done < <(grep -no '^[[:space:]]*#[[:space:]]*include[[:space:]]*"\(spes\|cli\)/[^"]*"' "$file" |
           sed 's/:[^"]*"/:/; s/"$//')
done < <(find src/spes src/cli -type f \( -name '*.h' -o -name '*.cpp' -o -name '*.inc' \) \
           -print0 | sort -z)

if ! grep -qF -- "$order_line" docs/ARCHITECTURE.md; then
  complain "docs/ARCHITECTURE.md does not state the layer order '$order_line'"
fi
if [ "$bad" = 0 ]; then
  echo "check_layers: ok ($order_line)"
else
  echo "check_layers: the order, lowest first: $order_line"
fi
exit "$bad"
