#!/bin/sh
# tools/install.sh VENV_BIN PIP_INSTALL_ARGS...   (the Makefile's installs)
#
# Installs into the venv with uv where it is there (a clean set-up in seconds instead of minutes), else with pip;
# anything uv cannot do falls back to pip. uv reads none of pip's configuration, so what pip is configured with
# (`pip config list`: its files and PIP_* variables) is passed on: index URLs, find-links and constraints, so both
# install the same releases from the same places, and pip's CA bundle (behind a proxy whose certificate uv's own
# roots do not know, every uv install failed on "invalid peer certificate" and fell back to pip).
# pip runs with --no-compile: its bytecode compilation of every installed file was most of its time (uv
# compiles nothing either); Python compiles what is imported, once, on first import.
set -u
bin=$1; shift
if [ -x "$bin/uv" ]; then
  # two lines from pip's configuration: its CA bundle (or nothing), then the options uv takes for the rest
  conf=$("$bin/python" -m pip config list 2>/dev/null | "$bin/python" -c '
import shlex, sys
cert, opts = "", []
for line in sys.stdin:
    key, _, value = line.strip().partition("=")
    key, value = key.rsplit(".", 1)[-1], value.strip("\x27\"")
    if key in ("index-url", "extra-index-url", "find-links", "constraint"):
        opts += [f"--{key} {shlex.quote(v)}" for v in value.split()]
    elif key == "cert":
        cert = value
print(cert)
print(" ".join(opts))')
  cert=$(printf '%s\n' "$conf" | sed -n 1p)
  opts=$(printf '%s\n' "$conf" | sed -n 2p)
  # pip takes the best match over every index; uv's default is the first index that has the package
  [ -n "$cert" ] && [ -z "${SSL_CERT_FILE:-}" ] && export SSL_CERT_FILE="$cert"
  if eval "\"\$bin/uv\" pip install -q --python \"\$bin/python\" --index-strategy unsafe-best-match $opts \"\$@\""; then
    exit 0
  fi
  echo "tools/install.sh: uv could not install $*; trying pip" >&2
fi
exec "$bin/pip" install -q --no-compile "$@"
