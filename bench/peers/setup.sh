#!/usr/bin/env bash
# A virtualenv for the peer tools ContextCite and AT2, apart from attnlens's: torch first (the CPU build this
# machine keeps on disk), then the two packages and their dependencies as wheels only (--only-binary: nothing
# is compiled). attnlens is not installed there; the peer scripts do not import it.
#
#   bash bench/peers/setup.sh [VENV]        # default /work/peers-venv
set -euo pipefail

VENV="${1:-/work/peers-venv}"
PYTHON="${PYTHON:-python3}"

if [ ! -x "$VENV/bin/python" ]; then
    "$PYTHON" -m venv "$VENV"
fi
"$VENV/bin/pip" install --quiet torch==2.13.0
# context-cite 0.0.4 and at2 0.0.1 are the versions the peer scripts were written against (they subclass
# ContextCiter and AT2's tasks); newer releases may move those extension points.
"$VENV/bin/pip" install --quiet --only-binary=:all: "context-cite==0.0.4" "at2==0.0.1"
"$VENV/bin/python" - <<'EOF'
import importlib.metadata as md
for name in ("torch", "transformers", "context-cite", "at2", "scikit-learn", "datasets"):
    print(f"{name} {md.version(name)}")
EOF
echo "peers virtualenv ready: $VENV"
