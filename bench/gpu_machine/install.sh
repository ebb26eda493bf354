#!/usr/bin/env bash
# On the GPU machine: join split wheels and install everything carried into a target folder.
#   bash bench/gpu_machine/install.sh .gpuwheels /tmp/site && export PYTHONPATH=/tmp/site
# Wheels may arrive over several calls (one transfer is 64 MiB): run this once all parts are there;
# it refuses to install a wheel whose parts are incomplete (the joined file must open as a zip).
set -euo pipefail
src=${1:-.gpuwheels}; target=${2:-/tmp/site}
# The wheels arrive in numbered subfolders (one per call, prepare.py --bin-mb); gather them first. One at a time:
# a wheel carried twice (in two folders) replaces the first copy instead of stopping `mv` (session 44 lost a call to
# "mv: will not overwrite just-created ..." when a reflow wheel came in two folders of one call).
find "$src" -mindepth 2 -type f -name '*.whl*' -exec mv -f -t "$src" {} \;
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
# That machine sets PYTHONDONTWRITEBYTECODE=1 and its torch ships without .pyc files, so every process
# (the command, Prefect's server, each Ray worker and actor; TRL's too) compiled torch's and these
# wheels' Python source again at each import: `import torch` 4.1 s, transformers with a model class
# 14-16 s (measured there, RESULTS.md 19). Compiled once here, the imports read the cached bytecode
# (Python reads .pyc files whatever that variable says; it only stops writing them).
site=$(python3 -c "import os, torch; print(os.path.dirname(os.path.dirname(torch.__file__)))")
python3 -m compileall -q -j 0 "$target" "$site" > /dev/null || true  # a file that does not compile is left as it was
echo "compiled bytecode for $target and $site"
