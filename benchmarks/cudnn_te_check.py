"""Does cuDNN's flash attention (forward and backward) run in a process that loaded Transformer Engine?

    python benchmarks/cudnn_te_check.py default|ldpath|ctypes

``default``: TE preloaded as ``main`` does. ``ctypes``: JAX's wheel cuDNN loaded (RTLD_GLOBAL) before TE, so TE's
core binds to it. ``ldpath``: the same through LD_LIBRARY_PATH (set it to the wheel's cuDNN lib folder). Prints
which cuDNN libraries the process mapped (``(sys)``: from /usr).
"""

import ctypes
import os
import sys

mode = sys.argv[1]
if mode == "ctypes":
    import nvidia.cudnn

    lib = os.path.join(list(nvidia.cudnn.__path__)[0], "lib")
    for name in ("graph", "engines_precompiled", "engines_runtime_compiled", "heuristic", "ops", "cnn", "adv", ""):
        path = os.path.join(lib, f"libcudnn{'_' + name if name else ''}.so.9")
        if os.path.exists(path):
            ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
try:
    from fp8rl_jax.fp8 import te

    te.preload()
    te._te()
    print(mode, "TE imports", flush=True)
except Exception as e:  # noqa: BLE001 - report whatever the import raised
    print(mode, "TE import FAILED", str(e)[:300])
    sys.exit()
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

r = np.random.RandomState(0)
q, k, v = (jnp.asarray(r.randn(3, 200, h, 64), jnp.bfloat16) for h in (8, 2, 2))


def f(q, k, v):
    return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn").astype(jnp.float32).sum()


for name, fn in (("fwd", jax.jit(f)), ("grad", jax.jit(jax.grad(f, argnums=(0, 1, 2))))):
    try:
        out = fn(q, k, v)
        print(mode, name, "ok", float(jax.tree.leaves(out)[0].astype(jnp.float32).sum()), flush=True)
    except Exception as e:  # noqa: BLE001
        print(mode, name, "FAILED", str(e)[:120], flush=True)
        break
maps = open("/proc/self/maps").read().splitlines()
print(mode, sorted({os.path.basename(m.split()[-1]) + ("(sys)" if m.split()[-1].startswith("/usr") else "")
                    for m in maps if "cudnn" in m}))
