#!/usr/bin/env bash
# A cluster node's Python environment WITHOUT qkgeom, for the `ray up` end-to-end test:
#
#   bash .ci/node-venv.sh [DIR]      # default ~/qkgeom-venv (the path cluster/local.yaml uses)
#
# Run from the activated CI venv (or set QKGEOM_VENV). DIR becomes a fresh venv whose
# site-packages links every package of the CI venv (torch, ray, ...: the dependencies the
# cloud files install from the package index) except qkgeom's own files (its editable
# install), plus a `ray` command. No network, about a second. The cluster file's setup
# commands must then install qkgeom there from the wheel `qkgeom sweep --cluster` ships.
set -euo pipefail
base=${QKGEOM_VENV:-${VIRTUAL_ENV:?activate the CI venv or set QKGEOM_VENV}}
node=${1:-$HOME/qkgeom-venv}
[ "$(cd "$base" && pwd -P)" != "$(mkdir -p "$node" && cd "$node" && pwd -P)" ] \
  || { echo "node-venv.sh: $node is the CI venv itself" >&2; exit 1; }
rm -rf "$node"
"$base/bin/python" -m venv --without-pip "$node"
purelib() { "$1/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])'; }
from=$(purelib "$base")
to=$(purelib "$node")
for entry in "$from"/*; do
  name=$(basename "$entry")
  case "$name" in *qkgeom*) continue ;; esac   # qkgeom/, its dist-info, its editable hooks
  ln -s "$entry" "$to/$name"
done
cat >"$node/bin/ray" <<PY
#!$node/bin/python
import sys
from ray.scripts.scripts import main
sys.exit(main())
PY
chmod +x "$node/bin/ray"
if (cd / && env -u PYTHONPATH "$node/bin/python" -c 'import qkgeom' 2>/dev/null); then
  echo "node-venv.sh: qkgeom is importable in $node; it must not be" >&2; exit 1
fi
echo "node-venv.sh: $node (torch, ray, ... without qkgeom)" >&2
