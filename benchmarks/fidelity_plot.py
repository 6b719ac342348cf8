"""Draw a ``bench fidelity`` result file (``fidelity.plot``): the gradient's error against f32 by source, by scaling,
per GEMM role and per block.

    python benchmarks/fidelity_plot.py benchmarks/results/fp8_fidelity_probe.json docs/fidelity_probe.png
"""

from __future__ import annotations

import argparse
import json

from fp8rl_jax.bench import fidelity


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("result", help="a bench fidelity JSON file (its rows are drawn)")
    ap.add_argument("png")
    args = ap.parse_args()
    with open(args.result) as f:
        doc = json.load(f)
    print(f"wrote {fidelity.plot(doc['rows'], args.png)}")


if __name__ == "__main__":
    main()
