# Sourced by scripts/test, scripts/node and the benchmarks: make sure .venv
# exists and holds the project as pyproject.toml currently describes it.
# The caller may set VENV_EXTRA before sourcing: "" (scripts/node: only what the
# node needs) or "test" (the default: the test extra too, which the benchmarks'
# helpers under tests/ and the suite use). Each install leaves a stamp (the hash
# of pyproject.toml) per extra, so a .venv made by scripts/node gets the test
# extra the first time scripts/test runs, and nothing is reinstalled otherwise.
# The calling script sets the shell options (set -euo pipefail).

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="$ROOT/.venv"
VENV_EXTRA="${VENV_EXTRA-test}"
STAMP="$VENV/.hmpnode-installed"           # the node's dependencies
EXTRA_STAMP="$STAMP${VENV_EXTRA:+-$VENV_EXTRA}"  # ... and the extra's
PY="${PYTHON:-python3}"
if [ ! -x "$VENV/bin/python" ]; then
    echo "scripts: creating $VENV (first start: about a minute, needs the Python package index)..." >&2
    "$PY" -m venv "$VENV"
fi
want="$(sha256sum "$ROOT/pyproject.toml" | cut -d' ' -f1)"
if [ "$want" != "$(cat "$STAMP" 2>/dev/null || true)" ] || [ "$want" != "$(cat "$EXTRA_STAMP" 2>/dev/null || true)" ]; then
    echo "scripts: installing hmpnode${VENV_EXTRA:+ and its $VENV_EXTRA extra} into $VENV..." >&2
    "$VENV/bin/python" -m pip install --quiet --upgrade pip >&2
    "$VENV/bin/python" -m pip install --quiet -e "$ROOT${VENV_EXTRA:+[$VENV_EXTRA]}" >&2
    echo "$want" > "$STAMP"
    echo "$want" > "$EXTRA_STAMP"
    echo "scripts: $VENV is ready" >&2
fi
export PATH="$VENV/bin:$PATH"
