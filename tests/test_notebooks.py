"""The notebooks: stored without outputs, and the quickstart executed headlessly on the tiny CPU config."""

import json
import os
import re

import pytest

pytestmark = pytest.mark.slow  # minutes on 2 cores: `make test-fast` leaves it out

# the `notebook` extra (make test installs it); a bare GPU image may lack it
nbformat = pytest.importorskip("nbformat")
NotebookClient = pytest.importorskip("nbclient").NotebookClient

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NOTEBOOKS = os.path.join(REPO, "notebooks")
ALL = sorted(name for name in os.listdir(NOTEBOOKS) if name.endswith(".ipynb"))
CELL_TIMEOUT_S = 1200  # the first GRPO step compiles rollout, scoring and training; 2 busy cores can take minutes


def test_the_notebooks_are_found():
    assert "quickstart.ipynb" in ALL


@pytest.mark.parametrize("name", ALL)
def test_notebook_is_stored_without_outputs(name):
    notebook = nbformat.read(os.path.join(NOTEBOOKS, name), as_version=4)
    nbformat.validate(notebook)
    dirty = [i for i, cell in enumerate(notebook.cells)
             if cell.cell_type == "code" and (cell.outputs or cell.execution_count is not None)]
    assert not dirty, (f"notebooks/{name}: code cells {dirty} hold outputs or execution counts; clear all outputs "
                       f"before committing (Jupyter's 'Clear Outputs of All Cells', then save)")


def _execute(name: str, workdir, monkeypatch) -> nbformat.NotebookNode:
    """Run every cell of ``notebooks/<name>`` in a python3 kernel started in the repository root, on CPU."""
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")  # the kernel inherits this process's environment
    monkeypatch.setenv("FP8RL_NOTEBOOK_WORKDIR", str(workdir))
    monkeypatch.setenv("JUPYTER_PREFER_ENV_PATH", "1")  # the venv's python3 kernel, not a user-wide one
    notebook = nbformat.read(os.path.join(NOTEBOOKS, name), as_version=4)
    client = NotebookClient(notebook, kernel_name="python3", timeout=CELL_TIMEOUT_S, startup_timeout=120,
                            resources={"metadata": {"path": REPO}})
    client.execute()  # raises CellExecutionError (with the cell's traceback) on any cell error
    return notebook


def _text(notebook) -> str:
    return "".join(out.get("text", "") for cell in notebook.cells if cell.cell_type == "code" for out in cell.outputs)


@pytest.mark.slow
def test_quickstart_runs_and_the_resumed_trainer_continues_at_the_saved_step(tmp_path, monkeypatch):
    workdir = tmp_path / "quickstart"
    executed = _execute("quickstart.ipynb", workdir, monkeypatch)

    summary = json.loads((workdir / "quickstart_summary.json").read_text())
    assert summary["config"] == "configs/tiny.py"
    assert summary["saved_step"] == 4 and summary["resumed_step"] == 4 and summary["final_step"] == 6
    assert summary["record_steps"] == [1, 2, 3, 4, 5, 6]
    # independently of the notebook's own bookkeeping: the trainer's log and the checkpoints on disk
    logged = [json.loads(line)["step"] for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    assert logged == [1, 2, 3, 4, 5, 6]
    saved = {int(p.name) for p in (workdir / "checkpoints").iterdir() if p.name.isdigit()}
    assert {4, 6} <= saved
    text = _text(executed)
    assert "resumed at step 4 (saved at step 4)" in text
    assert re.search(r"^step 5: reward", text, re.M) and re.search(r"^step 6: reward", text, re.M)
    assert not re.search(r"^step 7:", text, re.M)

    images = [out for cell in executed.cells if cell.cell_type == "code" for out in cell.outputs
              if "image/png" in out.get("data", {})]
    tables = [out for cell in executed.cells if cell.cell_type == "code" for out in cell.outputs
              if "text/html" in out.get("data", {}) and "mismatch_kl_k3" in out["data"]["text/html"]]
    assert len(images) == 2, "the reward/mismatch plots (after the first trainer and after the resume) inline"
    assert len(tables) == 2, "the pandas metrics tables"
    assert (workdir / "quickstart_reward.png").stat().st_size > 10_000


def _tiny_parameter_count() -> int:
    """By hand from the ``tiny`` preset: L=2, d=64, 4 heads + 2 KV heads of 16, f=160, untied head, and the
    character tokenizer's 50-token vocabulary (the model's rows past it are dropped at load)."""
    layers, d, f, vocab = 2, 64, 160, 50
    q, kv = 4 * 16, 2 * 16
    per_layer = d + d * (q + 2 * kv) + q * d + d + d * 2 * f + f * d  # norm, wqkv, wo, norm, w_gate_up, w_down
    return layers * per_layer + vocab * d + d + d * vocab  # + embed, final_norm, lm_head


@pytest.mark.slow
def test_cluster_notebook_shows_where_the_params_live_on_8_cpu_devices(tmp_path, monkeypatch):
    workdir = tmp_path / "cluster"
    executed = _execute("cluster.ipynb", workdir, monkeypatch)

    summary = json.loads((workdir / "cluster_summary.json").read_text())
    assert summary["config"] == "configs/tiny.py" and summary["platform"] == "cpu" and summary["devices"] == 8
    assert summary["steps"] == 2
    assert summary["param_devices"] and set(summary["param_devices"]) <= {f"cpu:{i}" for i in range(8)}
    assert summary["param_bytes"] == 4 * _tiny_parameter_count()  # float32 master weights
    # every parameter element is held somewhere, at most once per device
    assert summary["param_bytes"] <= summary["param_bytes_held"] <= 8 * summary["param_bytes"]
    text = _text(executed)
    assert "device.memory_stats() is not available" in text
    pictures = [out for cell in executed.cells if cell.cell_type == "code" for out in cell.outputs
                if out.output_type == "display_data" and "CPU" in out.get("data", {}).get("text/plain", "")]
    assert len(pictures) == 3, "visualize_array_sharding of embed, wqkv and w_down"
