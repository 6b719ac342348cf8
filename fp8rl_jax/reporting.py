"""Where a run's metrics go: ``metrics.jsonl``, TensorBoard, a progress bar, and PNG plots at the end.

One record per RL step (a flat dict of floats, and the FP8 backend's name). The JSONL file is the source of truth;
on resume, records past the restored step are dropped so the file reads as one uninterrupted run. Every write
happens in the calling thread, so that a failed one (a full disk) raises there: ``Trainer`` then reports a failed
checkpoint save on the same disk instead, if there is one.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import time
from collections.abc import Iterator
from pathlib import Path

PLOTS = {
    "reward.png": ("reward_mean", "accuracy", "eval_accuracy"),
    "mismatch.png": ("mismatch_kl_k3", "token_mult_prob_error", "is_weight_mean"),
    "training.png": ("loss", "grad_norm", "entropy", "clip_fraction"),
    "length.png": ("response_length_mean",),
}


# JAX's compile-time events (tracing, lowering, XLA's compile), summed by ``compile_seconds``
COMPILE_EVENTS = ("/jax/core/compile/jaxpr_trace_duration", "/jax/core/compile/jaxpr_to_mlir_module_duration",
                  "/jax/core/compile/backend_compile_duration")
_compile_total = {"seconds": 0.0, "listening": False}


@contextlib.contextmanager
def timed(times: dict[str, float], phase: str) -> Iterator[None]:
    """Wall seconds of the ``with`` block into ``times[phase]``; the block waits for its device results itself."""
    start = time.perf_counter()
    try:
        yield
    finally:
        times[phase] = time.perf_counter() - start


def compile_seconds() -> float:
    """Seconds this process has spent compiling since its first call (``jax.monitoring``'s duration events): the
    difference over a phase is what compiled in it (a new row width, a new packed shape)."""
    if not _compile_total["listening"]:
        import jax

        def listen(event: str, seconds: float, **kwargs) -> None:
            if event in COMPILE_EVENTS:
                _compile_total["seconds"] += seconds

        jax.monitoring.register_event_duration_secs_listener(listen)
        _compile_total["listening"] = True
    return _compile_total["seconds"]


class _TensorBoard:
    """Scalars into a TensorBoard events file (``events.out.tfevents.*``, as tensorboardX's ``SummaryWriter`` names
    it), written and flushed by the caller. ``SummaryWriter`` writes from a worker thread: a write that failed there
    (a full disk) printed a traceback and ended the thread, and the next records filled its queue (10 events) and
    blocked the trainer for good. Here the failure is an ``OSError`` from ``Reporter.log`` or ``close``."""

    def __init__(self, logdir: Path):
        from tensorboardX.event_file_writer import EventsWriter

        logdir.mkdir(parents=True, exist_ok=True)
        self._writer = EventsWriter(str(logdir / "events"))

    def scalars(self, values: dict[str, float], step: int) -> None:
        from tensorboardX.proto.event_pb2 import Event
        from tensorboardX.summary import scalar

        now = time.time()
        for tag, value in values.items():
            self._writer.write_event(Event(wall_time=now, step=step, summary=scalar(tag, value)))
        self._writer.flush()

    def close(self) -> None:
        writer, self._writer = self._writer, None  # once, even if it fails
        if writer is not None:
            writer.close()


class Reporter:
    def __init__(self, workdir: str | os.PathLike, *, tensorboard: bool = True, progress: bool = True,
                 total_steps: int | None = None, resume_step: int = 0, write: bool = True):
        """``write=False`` (every process but 0 of a multi-host run): records are kept in memory, no file is
        read or written (process 0 owns it), no message printed, no plot made."""
        self.dir = Path(workdir)
        self.write = write
        self.path = self.dir / "metrics.jsonl"
        self.records = [r for r in self._read() if r.get("step", 0) <= resume_step] if write else []
        if write:
            self.dir.mkdir(parents=True, exist_ok=True)
            with open(self.path, "w") as f:  # rewrite: drop records of steps a resumed run will redo
                for r in self.records:
                    f.write(json.dumps(r) + "\n")
        self._tb = None
        if tensorboard:
            self._tb = _TensorBoard(self.dir / "tensorboard")
        self._bar = None
        if progress:
            from tqdm.auto import tqdm

            self._bar = tqdm(total=total_steps, initial=resume_step, desc="GRPO", unit="step", dynamic_ncols=True)

    def _read(self) -> list[dict]:
        if not self.path.exists():
            return []
        out = []
        for n, line in enumerate(self.path.read_text().splitlines(), 1):
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                print(f"{self.path}:{n}: unreadable metrics line dropped (an interrupted write?)")
        return out

    def log(self, record: dict, *, advance: bool = True) -> None:
        """Append ``record`` (it has a ``step``); ``advance=False`` for a record that is not an RL step (the
        evaluation before the first step) leaves the progress bar where it is."""
        record = {k: (float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else v)
                  for k, v in record.items()}
        self.records.append(record)
        if not self.write:
            return
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")
        step = int(record["step"])
        if self._tb is not None:
            self._tb.scalars({k: v for k, v in record.items() if isinstance(v, float) and math.isfinite(v)}, step)
        if self._bar is not None and advance:
            self._bar.update(1)
            self._bar.set_postfix(reward=f"{record.get('reward_mean', float('nan')):.3f}",
                                  acc=f"{record.get('accuracy', float('nan')):.3f}",
                                  tok_s=f"{record.get('rollout_tokens_per_s', 0):.0f}")

    def message(self, text: str) -> None:
        """Print ``text`` (above the progress bar); nothing on a process that does not write (one line per job)."""
        if not self.write:
            return
        if self._bar is not None:
            self._bar.write(text)
        else:
            print(text, flush=True)

    def plot(self) -> list[Path]:
        """One PNG per group of metrics over steps (files in ``workdir/plots``)."""
        if not self.records or not self.write:
            return []
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        out_dir = self.dir / "plots"
        out_dir.mkdir(exist_ok=True)
        written = []
        for name, keys in PLOTS.items():
            keys = [k for k in keys if any(k in r for r in self.records)]
            if not keys:
                continue
            fig, axes = plt.subplots(1, len(keys), figsize=(4.2 * len(keys), 3.2), squeeze=False)
            try:
                for ax, key in zip(axes[0], keys, strict=True):
                    have = [r for r in self.records if key in r]  # eval metrics come every data.eval_every steps
                    ax.plot([r["step"] for r in have], [r[key] for r in have], marker=".")
                    ax.set_title(key)
                    ax.set_xlabel("step")
                    ax.grid(alpha=0.3)
                fig.tight_layout()
                fig.savefig(out_dir / name, dpi=100)
            finally:  # a failed save (a full disk) leaves no open figure behind
                plt.close(fig)
            written.append(out_dir / name)
        return written

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
        if self._tb is not None:
            self._tb.close()
