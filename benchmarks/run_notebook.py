"""Execute a notebook headlessly and save the executed copy (with its outputs) and an HTML-free text summary.

    python benchmarks/run_notebook.py notebooks/cluster.ipynb OUT.ipynb [--timeout 900]

Used on a GPU host to record ``notebooks/cluster.ipynb`` as users will see it (docs/cluster_h200x2.ipynb); the
kernel starts in the repository root and inherits this process's environment (PYTHONPATH, JAX_PLATFORMS).
"""

import argparse
import os
import sys
import time

import nbformat
from nbclient import NotebookClient
from nbclient.exceptions import CellExecutionError


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("notebook")
    ap.add_argument("out")
    ap.add_argument("--timeout", type=int, default=900)
    args = ap.parse_args()
    notebook = nbformat.read(args.notebook, as_version=4)
    client = NotebookClient(notebook, kernel_name="python3", timeout=args.timeout, startup_timeout=180,
                            resources={"metadata": {"path": os.getcwd()}})
    start, code = time.time(), 0
    try:
        client.execute()
    except CellExecutionError as e:
        print(f"cell error: {str(e)[:2000]}", file=sys.stderr)
        code = 1
    notebook.metadata["executed"] = {"seconds": round(time.time() - start, 1), "ok": code == 0}
    nbformat.write(notebook, args.out)
    print(f"wrote {args.out} ({'ok' if code == 0 else 'with a cell error'}, {time.time() - start:.0f} s)")
    return code


if __name__ == "__main__":
    sys.exit(main())
