"""The GRPO trainer with end-to-end FP8: a small library API that ``main.py`` wraps and notebooks use directly.

    from fp8rl_jax.trainer import Trainer
    trainer = Trainer.from_file("configs/tiny.py", steps=10)   # or Trainer(config_dict)
    records = trainer.run()                 # or trainer.step() -> one metrics record
    trainer.sample(["What is 2+3?"])        # completions from the current policy
    trainer.save(); trainer.close()

One RL step: prompts -> rollout (n samples each, FP8 rollout weights quantized once with the current scales,
continuous batching) -> rewards on the host -> group advantages -> old-policy logprobs from the scoring forward
-> minibatch updates of the IS-corrected clipped surrogate -> FP8 histories rolled -> KV scales recalibrated.

Where this departs from GRPO as published (DeepSeekMath): the importance ratio of the surrogate is taken against
the trainer's own old-policy logprobs (recomputed, not the sampler's), and the sampler/trainer mismatch is
corrected separately by an IS weight (``rl.is_correction``, TIS with cap 2 by default); the KL term is off by
default (``rl.kl_coef``), and the reference model shares the current FP8 state when it is on.

Devices: everything runs on the mesh of ``config.mesh`` (``fp8rl_jax.parallel``): params created sharded, the train
state placed by the sharding rules, the jitted step functions and the rollout engine on that mesh, checkpoints
restored onto the current mesh's shardings (whatever mesh saved them).
"""

from __future__ import annotations

import contextlib
import functools
import json
import time
from collections.abc import Iterator
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from fp8rl_jax import plan, streaming
from fp8rl_jax.batches import StepBatches, score_packed, score_right_padded
from fp8rl_jax.checkpoint import Checkpointer, latest_complete_step
from fp8rl_jax.config import ConfigError, check_fits_model, validate
from fp8rl_jax.config_values import config_list
from fp8rl_jax.data.prompts import build_prompt, load_prompts, prompt_iterator
from fp8rl_jax.eval import evaluate_policy
from fp8rl_jax.fp8 import kv as kvq
from fp8rl_jax.fp8.policy import choose_backend
from fp8rl_jax.memory import DeviceOutOfMemory as DeviceOutOfMemory  # raised by Trainer: one line, phase and knobs
from fp8rl_jax.memory import out_of_memory_report
from fp8rl_jax.model import llama
from fp8rl_jax.model.sharded import load_model_sharded
from fp8rl_jax.parallel import rules
from fp8rl_jax.parallel.distributed import host_get, is_primary, place
from fp8rl_jax.parallel.mesh import peak_memory_gib
from fp8rl_jax.parallel.state import init_sharded
from fp8rl_jax.policy_io import ADDED_STATE, calibrate_state, initial_calibration, right_pad
from fp8rl_jax.reporting import Reporter, compile_seconds, timed
from fp8rl_jax.rl.advantages import group_advantages
from fp8rl_jax.rl.metrics import mismatch_metrics, step_record
from fp8rl_jax.rl.rewards import combined_rewards, reward_names
from fp8rl_jax.rl.step import build_optimizer, make_calibrate, make_score, make_train_step
from fp8rl_jax.rollout import exact
from fp8rl_jax.rollout.sampler import Sampler
from fp8rl_jax.rollout.sampling import SamplingParams
from fp8rl_jax.startup import startup_notes
from fp8rl_jax.step_shapes import StepShapes
from fp8rl_jax.workdir import lock_workdir, prepare_workdir, write_run_json


class Trainer:
    def __init__(self, config, *, report: bool = True):
        validate(config, known_rewards=reward_names)
        self.config = config
        self.workdir = Path(config.workdir)
        self._workdir_lock = lock_workdir(self.workdir)  # before prepare_workdir: an overwrite must not hit a live run
        try:
            self._build(config, report)
        except BaseException:  # a Trainer that failed to start holds no workdir (notebooks keep the traceback)
            self._release_workdir()
            raise

    def _build(self, c, report: bool) -> None:
        prepare_workdir(self.workdir, c.checkpoint.resume)
        self.train_precision = plan.run_precision(c, "train")  # precision.backend=te where it cannot run fails here
        self.rollout_precision = plan.run_precision(c, "rollout")
        self.backend, self.backend_reason = (choose_backend(c.precision.backend) if self.train_precision.fp8
                                             or self.rollout_precision.fp8 else ("bf16", "precision.mode=bf16: no FP8"))
        # the trainer's mesh, and the rollout's own devices (mesh.rollout_devices; None: the trainer's); a mesh these
        # devices cannot hold is the config's fault, said in one ConfigError line
        self.mesh, self.rollout_devices = plan.meshes(c)
        self.model, params, self.tokenizer = load_model_sharded(plan.model_spec(c), self.mesh)
        check_fits_model(c, self.model.max_position_embeddings,
                         f"preset {c.model.preset!r}" if c.model.source == "preset" else c.model.source)
        self.prompts = prompt_iterator(plan.data_spec(c), self.tokenizer, "train")
        self.group = c.rollout.samples_per_prompt
        self.sequences = c.rollout.prompts_per_step * self.group
        self.minibatch = self.sequences // c.rl.minibatches
        # fixed here for the longest row the run can make: one microbatch shape per row width, whatever a step draws
        self.row_tokens = plan.longest_row_tokens(c)
        self.microbatch = plan.microbatch_sequences(c, self.minibatch, self.row_tokens)
        self.calibration_rows = min(c.precision.kv_calibration_sequences, self.sequences)  # what step() recalibrates on
        self.packing = None  # rl.packing: the [microbatches, rows, width] shape of a packed minibatch
        self._step_packed = c.rl.packing  # whether this step's rows are packed (StepBatches.packed may decline)
        if c.rl.packing:
            batch_devices = self.mesh.shape["data"] * self.mesh.shape["fsdp"]  # the devices the rows split over
            self.packing = plan.packing_plan(c, batch_devices)
        self.batches = StepBatches(self.tokenizer.pad_id or 0, self.row_tokens, self.minibatch, c.rl.minibatches,
                                   c.precision.kv_calibration_sequences, self.packing)
        self.reward_fns = config_list(c.reward.fns)
        self.reward_weights = config_list(c.reward.weights, float)

        self.optimizer, self.schedule = build_optimizer(c.optim, c.steps * c.rl.minibatches)
        self.state = {
            "params": params,
            "opt_state": init_sharded(self.optimizer.init, params, mesh=self.mesh),
            "fp8_state": llama.init_fp8_state(self.model, self.rollout_precision.replace(
                lm_head_fp8=c.precision.lm_head_fp8)),
            "kv_scales": kvq.init_kv_scales(self.model.num_layers),
            "rng": jax.random.PRNGKey(c.seed),
            "step": jnp.int32(0),
        }
        self.state_sharding = rules.state_shardings(self.state, self.mesh)
        self.state = place(self.state, self.state_sharding)  # the FP8 state, KV scales, key, counter: host values
        self.ref_params = jax.tree.map(jnp.copy, params) if c.rl.kl_coef > 0 else None
        loss_cfg = plan.loss_config(c)
        on_mesh = {"state_sharding": self.state_sharding}
        self._score = make_score(self.model, self.train_precision, loss_cfg.temperature, **on_mesh)
        # one minibatch per step: the old-policy logprobs are the loss's own forward (ratio exactly 1, no scoring)
        self._own_old_logp = c.rl.minibatches == 1
        train_step = functools.partial(make_train_step, self.model, self.train_precision, self.optimizer, loss_cfg,
                                       old_logp_from_forward=self._own_old_logp, remat=c.model.remat, **on_mesh)
        self._train_step = train_step()
        if self.packing:  # a step whose packed rows would run no fewer tokens runs right-padded (StepBatches.packed)
            self._train_step_packed = train_step(packed_sequences=self.minibatch)
        # after an update: FP8 observations only where training does not make them (fp8_rollout), and K/V amaxes
        calibration_microbatch = plan.microbatch_sequences(c, self.calibration_rows, self.row_tokens)
        self._calibrate = make_calibrate(self.model, self.rollout_precision, c.precision.kv_margin,
                                         observe_fp8=not self.train_precision.fp8, remat=c.model.remat,
                                         microbatch=calibration_microbatch, **on_mesh)
        # RL rollouts, sample() and evaluate() draw through one sampler: an engine per sampling setup
        held = {**self.state, "ref_params": self.ref_params}  # on the device while the rollout runs
        self.sampler = Sampler(plan.sampler_spec(c, rl=True), self.model, self.tokenizer, self.rollout_precision,
                               self.mesh, sequences=self.sequences, held=held, rollout_devices=self.rollout_devices)
        rl_sampling = SamplingParams(temperature=c.rollout.temperature, top_k=c.rollout.top_k, top_p=c.rollout.top_p)
        self.engine = self.sampler.engine(rl_sampling, c.rollout.max_new_tokens)
        self.exact_sampler = None  # rollout.exact: the RL rollouts drawn by the train precision's scoring forward
        if c.rollout.exact:
            if self.mesh.size > 1:
                raise ConfigError(f"config.rollout.exact=True runs on one device; the mesh has {self.mesh.size}")
            self.exact_sampler = exact.ExactSampler(
                self.model, self.train_precision, rl_sampling, max_new_tokens=c.rollout.max_new_tokens,
                microbatch=self.microbatch, stop_ids=tuple(self.tokenizer.stop_ids),
                pad_id=self.tokenizer.pad_id or 0, mesh=self.mesh)
        self.step_shapes = StepShapes(  # the step in words: what an out-of-memory message says of a phase
            c, self.model, self.rollout_precision, self.train_precision, self.sampler.slot_plan,
            exact=self.exact_sampler is not None, mesh_size=self.mesh.size, group=self.group, sequences=self.sequences,
            minibatch=self.minibatch, microbatch=self.microbatch, row_tokens=self.row_tokens,
            calibration_rows=self.calibration_rows, packing=self.packing)
        self.bad_steps = 0
        self.stream, self._restored_groups = None, None  # rollout.stream: a run()'s, and a checkpoint's queue
        self.length_limits = None  # benchmarks (bench async): the stream's samples stop at these lengths

        self.checkpointer = Checkpointer(self.workdir / "checkpoints", keep=c.checkpoint.keep,
                                         async_save=c.checkpoint.async_save, save_every=c.checkpoint.every)
        self.restore_note = None  # what a resume from an earlier version's checkpoint had to make fresh
        resumed = c.checkpoint.resume == "auto" and latest_complete_step(self.workdir / "checkpoints") is not None
        if resumed:
            self.restore()
        else:
            self._initial_calibration()
        primary = is_primary()  # multi-host: process 0 writes metrics, events, plots and messages
        report = report and primary
        self.reporter = Reporter(self.workdir, tensorboard=c.logging.tensorboard and report,
                                 progress=c.logging.progress and report, total_steps=c.steps,
                                 resume_step=self.step_count, write=primary)
        if primary:
            write_run_json(self.workdir, c, self.step_count, self.backend, self.backend_reason)
        for note in startup_notes(self, resumed):
            self.reporter.message(note)

    @classmethod
    def from_file(cls, path: str, arg: str | None = None, **overrides) -> Trainer:
        """Build from a config file; ``overrides`` set existing top-level or dotted keys (``steps=10``,
        ``**{"rl.kl_coef": 0.01}``; list keys take tuples: ``**{"reward.fns": ("gsm8k_answer",)}``)."""
        from fp8rl_jax.config import load_config_file

        config = load_config_file(path, arg)
        for key, value in overrides.items():  # one at a time, to name the one that does not fit
            try:
                config.update_from_flattened_dict({key: value})
            except (KeyError, AttributeError, TypeError) as e:
                raise ConfigError(f"{path}: override {key}={value!r}: {e.args[0] if e.args else e}") from None
        return cls(config)

    @property
    def step_count(self) -> int:
        return int(self.state["step"])

    # -- the RL step ----------------------------------------------------------------------------------------

    def step(self) -> dict:
        """One RL step; returns its metrics record (also logged). Arrays stay on the device from scoring on."""
        if self.stream is None and plan.streaming(self.config):  # a stream of this one step (run() keeps one)
            with self._streaming(1):
                return self.step()
        c, times, t_start = self.config, {}, time.perf_counter()
        step = self.step_count
        if self.stream is not None:  # sampled ahead and judged by the stream: the wait is the trainer's idle time
            with self._phase(times, "rollout"):
                batch = self.stream.take(step)
            records, rewards, per_fn = streaming.batch_rewards(batch)
            per_row, extra = [records[p] for p in batch.prompt_index], streaming.stream_metrics(batch, step)
        else:
            records, batch = self._rollout(step, times)
            with self._phase(times, "reward"):
                per_row, extra = [records[p] for p in batch.prompt_index], {}
                rewards, per_fn = combined_rewards(self.reward_fns, self.reward_weights, per_row,
                                                   self.sampler.texts(batch))
        memory = {"rollout": peak_memory_gib(self.rollout_devices)}  # None on CPU (no allocator statistics)
        # [prompts * group] -> [prompts, group] -> advantages [prompts * group]
        advantages = group_advantages(jnp.asarray(rewards).reshape(-1, self.group), c.rl.advantage).reshape(-1)

        # the minibatches' sequences: row order[mb * minibatch + i] of the batch is row i of minibatch mb
        order = np.random.default_rng([c.seed, step]).permutation(self.sequences)
        with self._phase(times, "score"):
            # [minibatches, microbatches, rows, width] arrays, each minibatch packed on its own, where that runs
            # fewer tokens than right-padding
            packed = None
            if self.packing:
                packed, self._packing_record = self.batches.packed(records, batch, advantages, order)
            self._step_packed = packed is not None  # what an out-of-memory message describes
            if packed:
                arrays, active, calibration_tokens = packed
                score = functools.partial(score_packed, self._score, self.state, arrays=arrays, active=active)
            else:
                arrays = self.batches.right_padded(records, batch, advantages)
                calibration_tokens = arrays["tokens"]
                score = functools.partial(score_right_padded, self._score, self.state, tokens=arrays["tokens"],
                                          microbatch=self.microbatch)
            if not self._own_old_logp:
                arrays["old_logp"] = score(self.state["params"])
            if self.ref_params is not None:
                arrays["ref_logp"] = score(self.ref_params)
            # the phase's own time: unwaited, the scoring would run on into the train phase's
            jax.block_until_ready([arrays.get("old_logp"), arrays.get("ref_logp")])
        memory["score"] = peak_memory_gib()

        with self._phase(times, "train"):
            step_fn = self._train_step_packed if packed else self._train_step
            self.state, train_metrics = self.batches.train(step_fn, self.state, arrays, order, packed=bool(packed),
                                                           microbatch=self.microbatch)
        memory["train"] = peak_memory_gib()
        mismatch = host_get(mismatch_metrics(arrays["rollout_logp"], arrays["old_logp"], arrays["mask"]))

        with self._phase(times, "calibrate"):
            self._recalibrate(calibration_tokens[: c.precision.kv_calibration_sequences])
            jax.block_until_ready((self.state["fp8_state"], self.state["kv_scales"]))
        memory["calibrate"] = peak_memory_gib()
        # placed like the restored counter: an uncommitted scalar would make the next train step compile again
        self.state["step"] = place(np.int32(step + 1), self.state_sharding["step"])
        if self.stream is not None:  # version step + 1 to the rollout: quantized here, moved as FP8 bytes
            with self._phase(times, "weights"):
                self.stream.publish(step + 1, jax.block_until_ready(self.sampler.weights(self.engine, self.state)))
            self.stream.forget(step)
            extra.update(streaming.refit_metrics(self.engine))
        times["step"] = time.perf_counter() - t_start

        record = step_record(step, batch, per_row, rewards, per_fn, train_metrics, mismatch, times,
                             backend=self.backend, accuracy_fn=self.reward_fns[0],
                             lr=float(self.schedule(step * c.rl.minibatches)),
                             packing=self._packing_record if self.packing else {})
        # device memory high-water mark (max over local devices) by the end of each phase; absent on CPU
        record.update({f"memory/{k}_peak_gib": v for k, v in memory.items() if v is not None})
        record.update(extra)
        skipped = int(record["skipped_updates"])
        self.bad_steps = self.bad_steps + 1 if skipped else 0
        if self._eval_due(step + 1):  # in the step's record, so metrics.jsonl and TensorBoard have it
            record.update(self.evaluate())
        with self._writing():
            self.reporter.log(record)
        if skipped:
            self.reporter.message(f"step {step + 1}: {skipped} update(s) skipped: non-finite loss or gradient, or an "
                                  f"update that made params or optimizer state non-finite "
                                  f"({self.bad_steps} bad step(s) in a row)")
            if self.bad_steps >= c.faults.max_consecutive_bad_steps:
                raise FloatingPointError(
                    f"{self.bad_steps} consecutive RL steps had non-finite losses, gradients or updates "
                    f"(faults.max_consecutive_bad_steps={c.faults.max_consecutive_bad_steps}); aborting. "
                    f"The last good state is in {self.workdir / 'checkpoints'}: lower optim.lr, or check the data")
        if self.checkpointer.should_save(step + 1):
            self.save()
        return record

    def _rollout(self, step: int, times: dict) -> tuple[list, object]:
        """The synchronous step's rollout: the step's prompts, sampled by the current policy."""
        records = self.prompts.take(self.config.rollout.prompts_per_step)
        key = jax.random.fold_in(self.state["rng"], step)
        prompts = [r.prompt_ids for r in records]
        if self.exact_sampler is not None:  # the trainer's own forward, on its own weights
            with self._phase(times, "rollout"):
                return records, self.exact_sampler.rollout(self.state, prompts, self.group, key)
        with self._phase(times, "weights"):  # the sampler's copy of the policy: FP8 kernels quantized once
            params = jax.block_until_ready(self.sampler.weights(self.engine, self.state))
        with self._phase(times, "rollout"):
            return records, self.sampler.rollout(self.engine, self.state, prompts, self.group, key, params=params)

    def _eval_due(self, step: int) -> bool:
        """Periodic evaluation (``data.num_eval`` problems every ``data.eval_every`` steps) is due after ``step``
        steps; step 0 is the policy before training, evaluated by ``run`` at the start of a fresh run."""
        c = self.config.data
        return bool(c.num_eval and c.eval_every and step % c.eval_every == 0)

    def run(self, steps: int | None = None) -> list[dict]:
        """RL steps, then a final checkpoint and the plots; returns the new steps' records.

        ``run()`` trains to the run's total, ``config.steps`` (after a resume: the steps left, none for a finished
        run). ``run(n)`` does ``n`` more steps, for notebooks; it may not pass ``config.steps``, where the
        learning-rate schedule ends (build the Trainer with a larger ``config.steps`` to train longer).
        """
        total, done = self.config.steps, self.step_count
        if steps is None:
            count = max(total - done, 0)
        elif steps < 1:
            raise ValueError(f"run(steps={steps}): steps must be positive (None: to config.steps={total})")
        elif done + steps > total:
            raise ValueError(f"run(steps={steps}) at step {done} would pass the run's total config.steps={total} "
                             "(the learning-rate schedule ends there); build the Trainer with a larger config.steps")
        else:
            count = steps
        if count == 0:
            self.reporter.message(f"{self.workdir}: the run is at step {done} of {total}; nothing to do")
        if count and done == 0 and self._eval_due(0) and not any(r.get("step") == 0 for r in self.reporter.records):
            # the starting point of the eval curve; a resumed run has it from its first start
            record = {"step": 0, **self.evaluate()}
            with self._writing():
                self.reporter.log(record, advance=False)
        with self._streaming(count) if count and plan.streaming(self.config) else contextlib.nullcontext():
            out = [self.step() for _ in range(count)]
        if self.config.checkpoint.save_final:
            self.save(force=True)
        if self.config.logging.plots:
            with self._writing():  # while the final save may still be writing, on the same disk
                self.reporter.plot()
        return out

    @contextlib.contextmanager
    def _streaming(self, count: int) -> Iterator[None]:
        """The rollout stream of the next ``count`` steps (``plan.streaming`` runs), with a barrier at each
        checkpoint step and at the last; in a thread of its own where the rollout has devices of its own, else
        driven by ``step``. Closed after them: a later ``run`` starts a new one from the policy it finds."""
        self.stream, self._restored_groups = streaming.open_stream(self, count), None
        try:
            yield
        finally:
            self.stream.close()
            self.stream = None

    @contextlib.contextmanager
    def _writing(self) -> Iterator[None]:
        """Around the reporter's writes (metrics.jsonl, TensorBoard, plots): where one fails (``OSError``) and a
        checkpoint save has failed too (a full disk fails both; an async save's failure may show only now), the
        save's ``CheckpointSaveError`` is raised instead of the writer's error: it says what the user needs (the
        folder, the cause, the step a rerun resumes from), and ``python -m fp8rl_jax.main`` exits with 4 on it."""
        try:
            yield
        except OSError:
            failure = self.checkpointer.failed_save()
            if failure is None:
                raise
            raise failure  # noqa: B904 - not caused by the writer's error: that one stays as its context

    # -- pieces ---------------------------------------------------------------------------------------------

    def _recalibrate(self, tokens: np.ndarray) -> None:
        """After an update: KV scales; in ``fp8_rollout`` mode also the rollout's FP8 scales (BF16 training observes
        no FP8 amaxes)."""
        rollout = self.rollout_precision
        self.state = calibrate_state(self.state, self._calibrate, tokens, rollout,
                                     fp8=rollout.fp8 and not self.train_precision.fp8, kv=rollout.kv_fp8)

    def _initial_calibration(self) -> None:
        """Scales before the first rollout, from the first prompts (the iterator is rewound; ``initial_calibration``)
        and with FP8 training a real backward pass."""
        position = self.prompts.get_state()
        records = self.prompts.take(self.config.rollout.prompts_per_step)
        self.prompts.set_state(position)
        tokens = right_pad([r.prompt_ids for r in records], self.tokenizer.pad_id or 0)
        rows = plan.microbatch_sequences(self.config, *tokens.shape)
        shapes = (f"{len(tokens)} prompts in microbatches of {rows} x {tokens.shape[1]} tokens"
                  + (", forward and backward" if self.train_precision.fp8 else ""))
        with out_of_memory_report("initial calibration", shapes, lambda: self._knobs("initial calibration")):
            self.state = initial_calibration(self.config, self.model, self.rollout_precision, self.state, tokens,
                                             gradients=self.train_precision.fp8, state_sharding=self.state_sharding)
            jax.block_until_ready((self.state["fp8_state"], self.state["kv_scales"]))

    # -- device memory ----------------------------------------------------------------------------------------

    @contextlib.contextmanager
    def _phase(self, times: dict[str, float], phase: str) -> Iterator[None]:
        """A phase of ``step``: timed (``timed``), and a failed device allocation in it raised as one
        ``DeviceOutOfMemory`` line naming the phase, its shapes and the keys that lower it."""
        compiled = compile_seconds()
        try:
            with timed(times, phase), out_of_memory_report(phase, lambda: self._shapes(phase),
                                                           lambda: self._knobs(phase)):
                yield
        finally:  # of which compiling: time/<phase>_compile (a new row width or packed shape compiles in a step)
            times[f"{phase}_compile"] = compile_seconds() - compiled

    def _shapes(self, phase: str) -> str:
        """``phase``'s device shapes in words (``StepShapes.shapes``), as this step lays out its rows."""
        return self.step_shapes.shapes(phase, self._step_packed)

    def _knobs(self, phase: str) -> list[str]:
        """The config keys that lower ``phase``'s device memory (``StepShapes.knobs``), as this step lays out its
        rows."""
        return self.step_shapes.knobs(phase, self._step_packed)

    # -- sampling and evaluation ----------------------------------------------------------------------------

    def sample(self, prompts: list[str] | str, n: int = 1, *, greedy: bool = False,
               max_new_tokens: int | None = None, top_k: int | None = None,
               top_p: float | None = None) -> list[list[str]]:
        """``n`` completions per prompt (questions, formatted like the training prompts) from the current policy;
        ``top_k`` / ``top_p`` may truncate it for display (training samples the untruncated policy)."""
        c = self.config
        prompts = [prompts] if isinstance(prompts, str) else list(prompts)
        ids = [build_prompt(self.tokenizer, q, prompt_format=c.data.prompt_format,
                            system_prompt=c.data.system_prompt)[1] for q in prompts]
        sampling = SamplingParams(temperature=c.rollout.temperature,
                                  top_k=c.rollout.top_k if top_k is None else top_k,
                                  top_p=c.rollout.top_p if top_p is None else top_p, greedy=greedy)
        engine = self.sampler.engine(sampling, max_new_tokens or c.rollout.max_new_tokens)
        rng = jax.random.fold_in(self.state["rng"], 2**31 - 1 - self.step_count)
        texts = self.sampler.texts(self.sampler.rollout(engine, self.state, ids, n, rng))
        return [texts[i * n : (i + 1) * n] for i in range(len(ids))]

    def evaluate(self, num: int | None = None, *, k: int = 1) -> dict:
        """Greedy accuracy on the first ``num`` problems of the test split (``data.num_eval``, else 100), by the first
        reward fn: ``fp8rl_jax.eval.evaluate_policy``, the code ``python -m fp8rl_jax.eval`` runs. ``eval_accuracy``
        is pass@1 (the fraction of problems whose greedy completion earns reward 1), ``eval_reward`` the greedy
        completions' mean reward; with ``k`` > 1 also ``eval_mean@k`` over ``k`` samples at
        ``rollout.temperature``."""
        c = self.config
        records = load_prompts(plan.data_spec(c), self.tokenizer, "test", limit=num or c.data.num_eval or 100).records
        shapes = (f"{len(records)} problems x {k} completion(s) through {self.sampler.slot_plan.slots} decode slots of "
                  f"{c.data.max_prompt_tokens} + {c.rollout.max_new_tokens} positions")
        with out_of_memory_report("eval", shapes, lambda: self._knobs("eval")):
            run = evaluate_policy(self.sampler, self.state, records, reward=self.reward_fns[0],
                                  max_new_tokens=c.rollout.max_new_tokens, temperature=c.rollout.temperature, k=k,
                                  key=self.state["rng"])
        out = {"eval_accuracy": run.metrics["pass@1"], "eval_reward": run.metrics["greedy_reward_mean"],
               "eval_problems": float(len(records))}
        if k > 1:
            out["eval_mean@k"] = run.metrics["mean@k"]
        return out

    # -- checkpoints ----------------------------------------------------------------------------------------

    def save(self, force: bool = True) -> bool:
        data_state, queued = self.prompts.get_state(), {}
        if self.stream is not None:  # at a barrier: the untrained batches and the stream's data position
            groups, data_state = self.stream.snapshot(self.step_count)
            queued = {"stream_groups": streaming.encode_groups(groups)}
        meta = {"step": self.step_count, "data_state": json.dumps(data_state), **queued,
                "config": self.config.to_json(), "bad_steps": self.bad_steps, "precision_backend": self.backend}
        return self.checkpointer.save(self.step_count, self.state, meta, force=force)

    def restore(self, step: int | None = None) -> None:
        # onto this mesh's shardings
        self.state, meta = self.checkpointer.restore(step, like=self.state, absent_ok=ADDED_STATE)
        self.state = place(self.state, self.state_sharding)  # (a no-op but for uncommitted scalars)
        self.prompts.set_state(json.loads(meta["data_state"]))
        # a streamed run's untrained batches, which the next run()'s stream starts from
        self._restored_groups = streaming.decode_groups(meta["stream_groups"]) if "stream_groups" in meta else None
        self.bad_steps = int(meta.get("bad_steps", 0))
        if meta.get("absent"):  # an earlier version's checkpoint: what it lacks starts fresh, scaled by calibration
            self._initial_calibration()
            parts = sorted({".".join(name.split(".")[:2]) for name in meta["absent"]})
            self.restore_note = (f"checkpoint of step {self.step_count} has no "
                                 f"{', '.join(parts)} (an earlier version's): made fresh, and the FP8 and KV scales "
                                 "calibrated again as at a first start")

    def close(self) -> None:
        """Waits for the pending checkpoint save (a failed one raises ``CheckpointSaveError``), closes the
        reporter and releases the workdir; idempotent. After a failed save, the reporter's own write failure at
        close (TensorBoard's last flush on the same full disk) is dropped: the save's failure is the error."""
        try:
            if self.stream is not None:
                self.stream.close()
            self.checkpointer.close()
        finally:
            try:
                self.reporter.close()
            except OSError:
                if self.checkpointer.failed_save() is None:
                    raise
            finally:
                self._release_workdir()

    def _release_workdir(self) -> None:
        if self._workdir_lock is not None:
            self._workdir_lock.release()
