"""Test setup: CPU only, 8 virtual CPU devices for sharding tests, shared fixtures."""

import os

from fp8rl_jax.xla_options import CPU_XLA_FLAG  # no JAX at its import: the flags below still come first

os.environ.setdefault("JAX_PLATFORMS", "cpu")
_DEVICE_COUNT = "--xla_force_host_platform_device_count"
_codegen = []  # the tests' code generation flags for XLA:CPU
if os.environ["JAX_PLATFORMS"] == "cpu":
    # YNNPACK's reduce fusions sum a softmax normaliser in an order that differs between two XLA:CPU programs of
    # one function (1 ulp), which the exact sampler's tests would see (the flag's note in fp8rl_jax/xla_options.py)
    _codegen.append(CPU_XLA_FLAG)
    if os.environ.get("FP8RL_TEST_XLA_OPT") != "default":
        # LLVM at -O0 for the tests' tiny programs, whose time is mostly compiling: the suite ran in 653 s against
        # 815 s on 2 cores (benchmarks/RESULTS.md, "CPU test suite time"). `make test` runs the exact sampler's
        # bit-for-bit tests in a pass of their own at XLA's default optimization (FP8RL_TEST_XLA_OPT=default), as the
        # product runs on CPU
        _codegen.append("--xla_backend_optimization_level=0")
        # and without XLA:CPU's fusion emitters (its default code generation for fusions; off, its older IR
        # emitter): the tests' programs compile in about half the time (tests/rl/test_packing.py alone: 95 CPU-s ->
        # 45 on 2 cores). A choice of code generation, as -O0 is; the exact sampler's pass runs XLA's defaults
        _codegen.append("--xla_cpu_use_fusion_emitters=false")
# a test's subprocess (the CLI, the launcher's processes) gets FP8RL_TEST_CHILD_XLA_FLAGS: the user's XLA_FLAGS less
# any device count, and the code generation flags, i.e. one device as a user's shell has it (or a count of its own)
_user = os.environ.get("XLA_FLAGS", "")
os.environ["FP8RL_TEST_CHILD_XLA_FLAGS"] = " ".join(
    [*(f for f in _user.split() if not f.startswith(_DEVICE_COUNT)), *_codegen])
# this process: 8 virtual CPU devices for the sharding tests
os.environ["XLA_FLAGS"] = " ".join([_user, f"{_DEVICE_COUNT}=8", *_codegen]).strip()

if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    # JAX's persistent compilation cache for the run, in a folder of its own that the run deletes: tests that
    # build the same tiny trainer (and their subprocesses, which inherit these variables) compile each program once
    import atexit
    import shutil
    import tempfile

    _cache = tempfile.mkdtemp(prefix="fp8rl-test-jax-cache-")
    atexit.register(shutil.rmtree, _cache, ignore_errors=True)
    os.environ["JAX_COMPILATION_CACHE_DIR"] = _cache
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")

import pytest  # noqa: E402

_TE = False  # whether Transformer Engine imported (te-marked tests skip where it did not)
if os.environ["JAX_PLATFORMS"] != "cpu" and not os.environ.get("FP8RL_TEST_NO_TE"):
    # Transformer Engine must load before JAX starts its GPU backend (a cuDNN symbol clash otherwise), and
    # collecting the test modules can start it (module-level arrays): so import TE here, before collection
    from fp8rl_jax.fp8 import te  # noqa: E402

    _TE = te.preload()


def pytest_collection_modifyitems(config, items):
    """GPU-marked tests run only where a GPU backend exists (the GPU host), never in CPU CI; te-marked ones only
    where Transformer Engine imports too."""
    import jax

    on_gpu = any(d.platform == "gpu" for d in jax.devices()) if os.environ.get("JAX_PLATFORMS") != "cpu" else False
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run with JAX_PLATFORMS=cuda on the GPU host)")
    no_te = pytest.mark.skip(reason="needs Transformer Engine, which does not import here (pip install "
                                    "'transformer-engine[jax]' on the GPU host)")
    for item in items:
        if "gpu" in item.keywords and not on_gpu:
            item.add_marker(skip)
        elif item.get_closest_marker("te") and not _TE:  # the marker, not a keyword: a parameter id may be "te"
            item.add_marker(no_te)


@pytest.fixture(scope="session")
def smollm2():
    """The embedded SmolLM2-135M-Instruct: (config, params f32, tokenizer). Downloaded once into the cache."""
    from fp8rl_jax.model import assets, weights
    from fp8rl_jax.model.tokenizer import Tokenizer

    path = assets.smollm2_gguf()
    config, params = weights.load_gguf(path)
    return config, params, Tokenizer.from_gguf(path)


def _custom_calls(fn, *args, read) -> list:
    """Lower ``fn`` for CUDA (on this CPU host) and return ``read(target, attributes)`` of each custom call in it
    (``target`` its call_target_name; ``read`` runs while the lowered module lives and may return None to skip)."""
    import jax
    from jax._src.lib.mlir import ir

    module = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).compiler_ir("stablehlo")
    found = []

    def walk(op):
        for region in op.regions:
            for block in region.blocks:
                for inner in block.operations:
                    if inner.operation.name == "stablehlo.custom_call":
                        target = ir.StringAttr(inner.attributes["call_target_name"]).value
                        if (value := read(target, inner.attributes)) is not None:
                            found.append(value)
                    walk(inner.operation)

    walk(module.operation)
    return found


def _triton_ir(fn, *args) -> list[str]:
    """The Triton IR text of each pallas_call (Triton backend) in ``fn`` lowered for CUDA on this host."""
    from jax._src.lib.mlir import ir
    from jax._src.pallas.triton import lowering as triton_lowering

    def read(target, attributes):
        if "triton" not in target:  # another kernel's call (a Mosaic GPU kernel's, XLA's own)
            return None
        config = ir.DictAttr(attributes["mhlo.backend_config"])
        if "ir" not in config:
            pytest.skip("this jaxlib compiles Pallas Triton calls at lowering time (no IR to read)")
        blob = ir.StringAttr(config["ir"]).value_bytes
        with triton_lowering._new_ir_context():
            return str(ir.Module.parse(blob))

    return _custom_calls(fn, *args, read=read)


def _mosaic_modules(fn, *args) -> list[bytes]:
    """The serialized module of each Mosaic GPU kernel in ``fn`` lowered for CUDA on this host."""
    from jax._src.lib.mlir import ir

    def read(target, attributes):
        if "mosaic_gpu" not in target:
            return None
        return ir.StringAttr(ir.DictAttr(attributes["mhlo.backend_config"])["module"]).value_bytes

    return _custom_calls(fn, *args, read=read)


@pytest.fixture
def triton_ir():
    """``triton_ir(fn, *args)``: the Triton IR of each Pallas kernel in ``fn`` lowered for CUDA on this host (the
    kernels' lowering checked without a GPU)."""
    return _triton_ir


@pytest.fixture
def mosaic_modules():
    """``mosaic_modules(fn, *args)``: the serialized module of each Mosaic GPU kernel in ``fn`` lowered for CUDA on
    this host."""
    return _mosaic_modules


def _benchmark_script(name: str):
    """benchmarks/NAME.py, loaded as a module (a script, not a package module)."""
    import importlib.util

    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks", f"{name}.py")
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def benchmark_script():
    """``benchmark_script(name)``: benchmarks/NAME.py loaded as a module, for tests that run a script's ``main``."""
    return _benchmark_script
