"""Does cuDNN's flash attention (forward and backward) run in a process that loaded Transformer Engine?

    python benchmarks/cudnn_te_check.py te_first|preload|ldpath

``te_first``: TE imported before JAX's GPU backend with nothing else (what ``fp8.te.preload`` did before it loaded
JAX's cuDNN first; measured as ``default`` at 077e23f). ``preload``: ``fp8.te.preload()``, which loads the cuDNN of
JAX's wheels (RTLD_GLOBAL, ``fp8.te._load_jax_cudnn``) and then TE, so TE's core binds to it (measured as
``ctypes``). ``ldpath``: TE first with LD_LIBRARY_PATH set to the wheel's cuDNN lib folder. Prints which cuDNN
libraries the process mapped (``(sys)``: from /usr).
"""

import os
import sys

mode = sys.argv[1]
try:
    if mode == "preload":
        from fp8rl_jax.fp8 import te

        te.preload()
        te._te()
        print(mode, "TE imports; shares JAX's cuDNN:", te.shares_jax_cudnn(), flush=True)
    else:
        import transformer_engine.jax  # noqa: F401

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
