# Sourced by scripts/test, scripts/node and the benchmarks: make sure .venv
# exists and holds the project as pyproject.toml currently describes it.
# Reinstalls only when pyproject.toml changed since the last install.
# The calling script sets the shell options (set -euo pipefail).

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="$ROOT/.venv"
STAMP="$VENV/.hmpnode-installed"
PY="${PYTHON:-python3}"
if [ ! -x "$VENV/bin/python" ]; then
    echo "scripts: creating $VENV" >&2
    "$PY" -m venv "$VENV"
fi
want="$(sha256sum "$ROOT/pyproject.toml" | cut -d' ' -f1)"
have="$(cat "$STAMP" 2>/dev/null || true)"
if [ "$want" != "$have" ]; then
    echo "scripts: installing hmpnode and its test extra into $VENV" >&2
    "$VENV/bin/python" -m pip install --quiet --upgrade pip >&2
    "$VENV/bin/python" -m pip install --quiet -e "$ROOT[test]" >&2
    echo "$want" > "$STAMP"
fi
export PATH="$VENV/bin:$PATH"
