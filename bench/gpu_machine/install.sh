#!/usr/bin/env bash
# On the GPU machine: join split wheels and install everything carried into a target folder.
#   bash bench/gpu_machine/install.sh .gpuwheels /tmp/site && export PYTHONPATH=/tmp/site
# Wheels may arrive over several calls (one transfer is 64 MiB): run this once all parts are there;
# it refuses to install a wheel whose parts are incomplete (the joined file must open as a zip).
set -euo pipefail
src=${1:-.gpuwheels}; target=${2:-/tmp/site}
# The wheels arrive in numbered subfolders (one per call, prepare.py --bin-mb); gather them first.
find "$src" -mindepth 2 -type f -name '*.whl*' -exec mv -t "$src" {} +
for first in "$src"/*.whl.part00; do
  [ -e "$first" ] || continue
  whl=${first%.part00}
  cat "$whl".part* > "$whl.joined"
  python3 -c "import sys, zipfile; zipfile.ZipFile(sys.argv[1]).testzip()" "$whl.joined" \
    || { echo "install.sh: $whl: parts missing or damaged" >&2; exit 2; }
  mv "$whl.joined" "$whl"
done
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$target" "$src"/*.whl
echo "installed $(ls "$src"/*.whl | wc -l) wheels into $target"
