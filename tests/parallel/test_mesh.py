"""The mesh from config.mesh: -1 resolution, the errors, the devices it spans; the memory reading."""

import importlib.util

import jax
import ml_collections
import pytest

from fp8rl_jax.config import ConfigError, base_config, validate
from fp8rl_jax.fp8 import linear
from fp8rl_jax.parallel.mesh import AXES, make_mesh, mesh_context, mesh_shape, peak_memory_gib


def _mesh_config(data, fsdp, tensor):
    return ml_collections.ConfigDict({"data": data, "fsdp": fsdp, "tensor": tensor})


@pytest.mark.parametrize("sizes, devices, expected", [
    ((1, -1, 1), 8, (1, 8, 1)),
    ((2, -1, 1), 8, (2, 4, 1)),
    ((1, -1, 2), 8, (1, 4, 2)),
    ((1, 2, -1), 8, (1, 2, 4)),
    ((2, 2, 2), 8, (2, 2, 2)),
    ((1, 1, 1), 8, (1, 1, 1)),  # fewer than all: the first device
    ((1, -1, 1), 1, (1, 1, 1)),
])
def test_mesh_shape_resolves_the_remaining_devices(sizes, devices, expected):
    assert mesh_shape(sizes, devices) == expected


@pytest.mark.parametrize("sizes, message", [
    ((3, -1, 1), "hold 3 devices, which does not divide the 8"),
    ((1, 16, 1), "hold 16 devices, which does not divide the 8"),
    ((1, -1, -1), "at most one axis may be -1"),
    ((0, -1, 1), "positive int or -1"),
])
def test_mesh_shape_errors_name_the_keys(sizes, message):
    with pytest.raises(ValueError, match=message) as e:
        mesh_shape(sizes, 8)
    assert "mesh.data=" in str(e.value) and "mesh.tensor=" in str(e.value)


def test_make_mesh_over_the_forced_cpu_devices():
    assert len(jax.devices()) == 8  # tests/conftest.py
    mesh = make_mesh(_mesh_config(2, -1, 2))
    assert mesh.axis_names == AXES and dict(mesh.shape) == {"data": 2, "fsdp": 2, "tensor": 2}
    assert sorted(d.id for d in mesh.devices.flat) == list(range(8))
    small = make_mesh(_mesh_config(1, 2, 1))
    assert small.devices.size == 2 and {d.id for d in small.devices.flat} <= {d.id for d in jax.devices()}


def test_mesh_context_sets_the_mesh_for_tracing_only_inside():
    mesh = make_mesh(_mesh_config(1, -1, 1))
    assert jax.sharding.get_abstract_mesh().empty
    with mesh_context(mesh):
        assert dict(jax.sharding.get_abstract_mesh().shape) == {"data": 1, "fsdp": 8, "tensor": 1}
    with mesh_context(None):
        assert jax.sharding.get_abstract_mesh().empty
    assert jax.sharding.get_abstract_mesh().empty


def test_config_validation_rejects_two_remaining_axes_and_unknown_remat():
    c = base_config()
    validate(c)
    c.mesh.tensor = -1
    with pytest.raises(ConfigError, match="config.mesh="):
        validate(c)
    c = base_config()
    c.model.remat = "everything"
    with pytest.raises(ConfigError, match="config.model.remat='everything'"):
        validate(c)


class _Device:
    def __init__(self, stats):
        self.stats = stats

    def memory_stats(self):
        return self.stats


def test_peak_memory_is_the_largest_device_peak_and_absent_without_statistics():
    gib = 2**30
    devices = [_Device({"peak_bytes_in_use": 3 * gib, "bytes_in_use": gib}), _Device({"peak_bytes_in_use": 5 * gib})]
    assert peak_memory_gib(devices) == 5.0
    assert peak_memory_gib([_Device(None), _Device({})]) is None
    assert peak_memory_gib() is None  # XLA:CPU keeps no allocator statistics: no memory/* metrics on CPU


def test_te_backend_names_the_mesh_axes_for_transformer_engine():
    mesh = make_mesh(_mesh_config(1, -1, 1))
    if importlib.util.find_spec("transformer_engine") is None:  # CPU CI: TE absent, a clear error (not a crash)
        with pytest.raises(ImportError, match="transformer-engine"), linear.mesh_context(mesh, "te"):
            pass
        assert jax.sharding.get_abstract_mesh().empty  # the mesh context unwound
        return
    from transformer_engine.jax.sharding import global_mesh_resource  # the GPU host

    with linear.mesh_context(mesh, "te"):
        resource = global_mesh_resource()
        assert (resource.dp_resource, resource.fsdp_resource, resource.tp_resource) == ("data", "fsdp", "tensor")
