"""What a ``Trainer`` says when it starts: precision and backend, decode slots, row widths, microbatches, resume
and data notes, and how an asynchronous or dynamically sampled run schedules its rollouts."""

from __future__ import annotations

from fp8rl_jax.rollout import exact


def startup_notes(trainer, resumed: bool) -> list[str]:
    """The lines ``trainer`` (a ``Trainer`` just built; ``resumed`` from a checkpoint) prints at the start."""
    c, notes = trainer.config, []
    notes.append(f"precision: {c.precision.mode}, FP8 backend {trainer.backend} ({trainer.backend_reason})")
    if trainer.exact_sampler is None:
        notes.append(trainer.sampler.slot_plan.describe())
        if waves := trainer.sampler.slot_plan.waves_message():
            notes.append(waves)
    notes.append(trainer.batches.row_widths())
    if trainer.restore_note:
        notes.append(trainer.restore_note)
    if note := trainer.step_shapes.microbatches():
        notes.append(note)
    if trainer.exact_sampler is not None:
        notes.append("rollout.exact: the rollouts are drawn by the trainer's own forward")
    if note := exact.cpu_flag_note(trainer.exact_sampler is not None):  # the Python API (the CLI sets the flag)
        notes.append(note)
    if (lock := trainer._workdir_lock) is not None and lock.took_over:
        notes.append(lock.took_over_message())
    if resumed:
        notes.append(f"resumed from {trainer.workdir / 'checkpoints'} at step {trainer.step_count}")
    if trainer.prompts.dropped:
        notes.append(f"{trainer.prompts.dropped} of {trainer.prompts.total} prompts are longer than "
                     f"data.max_prompt_tokens={c.data.max_prompt_tokens} and were dropped")
    if c.rollout.max_staleness:
        notes.append(f"asynchronous: rollout.max_staleness={c.rollout.max_staleness}, the rollout samples up to "
                     f"{c.rollout.max_staleness} step(s) ahead; every token trains at most that many updates after "
                     "the version that sampled it (async/staleness_*)")
    if c.rl.dynamic_sampling:
        notes.append(f"dynamic sampling: groups with all-equal rewards are dropped and replaced, up to "
                     f"{c.rl.dynamic_sampling_max_rounds} x {c.rollout.prompts_per_step} prompts a step (dynamic/*)")
    return notes
