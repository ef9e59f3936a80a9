# Sourced by run.sh and hist_run.sh: the checkout, its venv's python, torch's include and library
# flags for building a harness without Python, and a temporary folder removed on exit.
ROOT=$(git rev-parse --show-toplevel)
PY=$ROOT/.venv/bin/python
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
INC=$($PY -c "import torch.utils.cpp_extension as c; print(' '.join('-I'+p for p in c.include_paths()))" 2>/dev/null)
LIB=$($PY -c "import torch,os; print(os.path.join(os.path.dirname(torch.__file__),'lib'))")
