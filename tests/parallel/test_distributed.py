"""Multi-host settings: where they come from, and what is refused."""

import pytest

from fp8rl_jax.parallel import distributed as dist

pytestmark = pytest.mark.slow  # minutes on 2 cores: `make test-fast` leaves it out

_ENV = (dist.ENV_COORDINATOR, dist.ENV_NUM_PROCESSES, dist.ENV_PROCESS_ID, dist.K8S_INDEX, "SLURM_JOB_ID",
        "OMPI_COMM_WORLD_SIZE")


@pytest.fixture
def clean_env(monkeypatch):
    for name in _ENV:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def test_no_settings_is_a_single_process(clean_env):
    assert dist.cluster_spec() == dist.ClusterSpec(source="single")
    assert dist.initialize(dist.cluster_spec()) is False


def test_flags_win_over_the_environment(clean_env):
    clean_env.setenv(dist.ENV_COORDINATOR, "elsewhere:1")
    spec = dist.cluster_spec("10.0.0.1:1234", 4, 3)
    assert (spec.coordinator_address, spec.num_processes, spec.process_id, spec.source) == ("10.0.0.1:1234", 4, 3,
                                                                                              "flags")


def test_kubernetes_indexed_job_takes_the_completion_index(clean_env):
    clean_env.setenv(dist.ENV_COORDINATOR, "fp8rl-0.fp8rl:12355")
    clean_env.setenv(dist.ENV_NUM_PROCESSES, "2")
    clean_env.setenv(dist.K8S_INDEX, "1")
    spec = dist.cluster_spec()
    assert (spec.coordinator_address, spec.num_processes, spec.process_id, spec.source) == ("fp8rl-0.fp8rl:12355", 2,
                                                                                              1, "env")


def test_slurm_is_left_to_jax_detection(clean_env):
    clean_env.setenv("SLURM_JOB_ID", "77")
    assert dist.cluster_spec().source == "auto"


@pytest.mark.parametrize(
    "env, message",
    [
        ({dist.ENV_COORDINATOR: "h:1", dist.ENV_NUM_PROCESSES: "2"}, "process id"),
        ({dist.ENV_COORDINATOR: "h:1", dist.ENV_PROCESS_ID: "0"}, "number of processes"),
        ({dist.ENV_COORDINATOR: "h:1", dist.ENV_NUM_PROCESSES: "2", dist.ENV_PROCESS_ID: "2"}, "outside 0..1"),
        ({dist.ENV_COORDINATOR: "h:1", dist.ENV_NUM_PROCESSES: "two", dist.ENV_PROCESS_ID: "0"}, "not an integer"),
    ],
)
def test_incomplete_or_wrong_settings_name_what_is_wrong(clean_env, env, message):
    for k, v in env.items():
        clean_env.setenv(k, v)
    with pytest.raises(ValueError, match=message):
        dist.cluster_spec()
