#!/usr/bin/env bash
# Prints the Python that has the packages of dev/requirements.txt (import name = package name, unless the line says
# "# module: NAME"), installing them on first use:
#   - python3 itself when it already has them all (nothing is installed, the network is not touched);
#   - else .venv/bin/python, a virtual environment made once in the repo with --system-site-packages (so a
#     system-wide PyTorch or numpy stays visible), where pip installs only what is missing. This works where the
#     system Python refuses `pip install` (PEP 668).
# Make calls it for every recipe that runs Python; PYTHON=... on the make command line skips it.
set -euo pipefail
cd "$(dirname "$0")/.."
requirements=dev/requirements.txt
missing() {  # missing PYTHON: the requirements PYTHON cannot import, one per line (module name = package name)
    "$1" - "$requirements" <<'PY'
import importlib.util, re, sys
for line in open(sys.argv[1]):
    name = re.split(r"[<>=~!;\[ ]", line.split("#")[0].strip())[0]
    module = re.search(r"#\s*module:\s*(\w+)", line)  # where the import name differs from the package's
    if name and importlib.util.find_spec(module.group(1) if module else name) is None:
        print(name)
PY
}
if ! command -v python3 >/dev/null; then
    echo "Error: python3 not found: install Python 3" >&2
    exit 1
fi
if [ -z "$(missing python3)" ]; then
    echo python3
    exit 0
fi
if [ ! -x .venv/bin/python ]; then
    echo "setting up .venv (a virtual environment for the packages in $requirements)" >&2
    if ! python3 -m venv --system-site-packages .venv >&2; then
        rm -rf .venv
        echo "Error: python3 -m venv failed: install the venv module (Debian/Ubuntu: apt install python3-venv)" >&2
        exit 1
    fi
fi
need=$(missing .venv/bin/python)
if [ -n "$need" ]; then
    echo "installing into .venv:" $need >&2
    .venv/bin/python -m pip install -q $need >&2 || { echo "Error: pip could not install:" $need >&2; exit 1; }
fi
echo .venv/bin/python
