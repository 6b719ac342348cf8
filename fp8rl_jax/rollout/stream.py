"""A rollout stream: continuous generation across RL steps, with bounded staleness, in-flight weight updates and
dynamic sampling, deterministic given its schedule.

The synchronous step (``driver.generate``) samples one step's prompts with the step's weights and waits for its
longest completion while its decode slots empty. The stream keeps its slots full across steps: when a slot frees,
the next prompt's samples go in, whichever step they are for. The trainer takes step ``b``'s batch when it is
complete and sends the stream each new policy version (``publish``); the stream may run in a thread of its own on
the rollout devices (``start``), overlapping training, or inline in the trainer's thread (``take`` drives it), with
the same results.

The schedule, with P prompts a batch, n samples a prompt, staleness bound S (``rollout.max_staleness``), and
version v = the policy after v updates (step b trains version b into b + 1):

- Admission. The stream admits a prompt (takes it from the iterator, queues its n samples) for the lowest batch
  that still needs one. A prompt for batch b is admitted only under a loaded version >= b - S, so every token of
  batch b is sampled by a version in [b - S, b] and is at most S updates old when step b trains on it: nothing is
  ever too stale to train on, and nothing is dropped or re-scored for staleness.
- Weight loads. When the next admission needs version v, the stream loads v once batch v - 1 is complete (step
  v - 1, which makes v, trains on it) and, with ``load_delay`` D (``rollout.load_delay_chunks``), D more decode
  chunks have been dispatched since then (counted from the last barrier); until then it decodes on with its free
  slots idle. At the load it waits for the trainer's ``publish(v)`` (the only wait that depends on time), the live
  rows with it: D sized to the trainer's step lets them decode under v - 1 while v is trained instead of waiting
  at the load. The live sequences keep their slots, their KV cache and their tokens, and go on under v (an
  in-flight update): each token records the version that sampled it (``versions``) and its logprob under that
  version, which the trainer's IS correction and mismatch metrics read as the behaviour policy. A stream with
  nothing live loads at once (there is nothing to count).
- Without in-flight updates (``inflight_updates`` False) every load is drained as a barrier's is: the stream
  waits for a version only when nothing is live, and no sequence sees two versions (veRL's one-step-off). The
  tail of each batch is then not filled by the next one, but no live row ever waits for the trainer.
- Barriers. Before loading a barrier version c (a checkpoint step), the stream drains: it admits nothing more
  until every admitted prompt has finished, so at the barrier batches c .. c + S - 1 are complete and nothing is
  in flight. A checkpoint at step c stores those batches and the data iterator's position there
  (``snapshot``), and a stream started from them (``restored``) goes on exactly as the uninterrupted one.
- Dynamic sampling (``rl.dynamic_sampling``). A finished prompt whose n rewards are all equal (no advantage, no
  gradient) is dropped and the batch admits another prompt in its place, up to P x ``max_rounds`` prompts a batch.
  A batch that exhausts them is filled with dropped groups whose rows do not train (``RolloutBatch.masked``).

Every decision reads only what was sampled (which row finished at which chunk), never the clock, and sample s of
the j-th prompt admitted for batch b draws with ``fold_in(fold_in(rng, b), j * n + s)`` as ``driver.generate``
draws row j * n + s of step b: a run is reproducible from its seed. The decode chunks are pipelined as
``driver.generate``'s (one in flight).
"""

from __future__ import annotations

import collections
import dataclasses
import threading
import time
from collections.abc import Callable

import jax.numpy as jnp
import numpy as np

from fp8rl_jax.parallel.distributed import host_get
from fp8rl_jax.rollout.driver import RolloutBatch, chunk_steps, prefill_prompts, row_keys
from fp8rl_jax.rollout.engine import Engine


@dataclasses.dataclass(frozen=True)
class StreamPlan:
    """What a stream generates: batches ``first`` .. ``end - 1`` of ``prompts`` prompts x ``samples`` each."""

    prompts: int  # P: prompts a batch (rollout.prompts_per_step)
    samples: int  # n: samples a prompt (rollout.samples_per_prompt)
    max_staleness: int  # S (rollout.max_staleness)
    first: int  # the first batch (the step the stream starts at)
    end: int  # one past the last batch
    dynamic_sampling: bool = False  # rl.dynamic_sampling
    max_rounds: int = 1  # rl.dynamic_sampling_max_rounds: admissions a batch may make, in units of P
    barriers: frozenset[int] = frozenset()  # versions before whose load the stream drains (checkpoint steps)
    inflight_updates: bool = True  # rollout.inflight_updates: False = drain before every load (one-step-off)
    load_delay: int = 0  # rollout.load_delay_chunks: an in-flight load waits this many chunks after it is due
    steps_per_sync: int = 8  # decode steps a chunk

    def __post_init__(self):
        if (self.max_staleness < 0 or self.prompts < 1 or self.samples < 1 or self.max_rounds < 1
                or self.load_delay < 0):
            raise ValueError(f"StreamPlan: bad sizes {self}")


@dataclasses.dataclass(eq=False)  # a group is itself: compared by identity, never field by field (arrays)
class Group:
    """One prompt's ``n`` samples: the j-th prompt (``index``) admitted for batch ``batch``."""

    batch: int
    index: int
    record: object  # the data's PromptRecord (prompt_ids, answer, ...)
    tokens: np.ndarray  # [n, max_new] int32
    logprobs: np.ndarray  # [n, max_new] f32: each token's logprob under the version that sampled it
    versions: np.ndarray  # [n, max_new] int32: that version (-1 past the end)
    lengths: np.ndarray  # [n]
    reasons: list[str]
    rewards: np.ndarray | None = None  # [n], by ``judge`` when the group finishes
    per_fn: dict | None = None  # reward fn -> [n]
    admitted_version: int = 0
    limits: np.ndarray | None = None  # [n] lengths at which the samples stop (benchmarks: ``Stream(limits=)``)

    @property
    def finished(self) -> bool:
        return all(self.reasons)

    @property
    def uniform(self) -> bool:
        """All ``n`` rewards equal: every advantage 0, no gradient (dynamic sampling drops it)."""
        return bool(np.all(self.rewards == self.rewards[0]))


@dataclasses.dataclass
class _Batch:
    admitted: int = 0  # prompts admitted for it (j of the next one)
    live: int = 0  # admitted and not finished
    kept: list = dataclasses.field(default_factory=list)
    dropped: list = dataclasses.field(default_factory=list)
    done: bool = False  # complete: handed to (or waiting for) the trainer


class StreamError(RuntimeError):
    """The stream's thread failed; raised in the trainer's thread by ``take``."""


class Stream:
    def __init__(self, engine: Engine, plan: StreamPlan, *, next_prompt: Callable[[], object],
                 prompt_state: Callable[[], dict], batch_key: Callable[[int], np.ndarray],
                 judge: Callable[[object, list[np.ndarray]], tuple[np.ndarray, dict]], weights: dict,
                 version: int, restored: list[Group] | None = None,
                 limits: Callable[[int, int], np.ndarray] | None = None):
        """``engine``: the rollout engine; ``next_prompt()`` the data iterator's next record (its ``prompt_ids``)
        and ``prompt_state()`` its position; ``batch_key(b)`` the raw key of batch b ([2] uint32, fold_in(rng, b));
        ``judge(record, completions)`` a finished group's rewards ([n]) and per-fn rewards; ``weights`` the
        engine's params of policy ``version`` (``Engine.load_params``), the version at ``plan.first``;
        ``restored``: a checkpoint's finished groups of the batches from ``plan.first`` on (``snapshot``);
        ``limits(b, j)`` (benchmarks): the j-th prompt of batch b's samples stop at these lengths, as with
        ``driver.generate(limits=...)``."""
        self.engine, self.plan = engine, plan
        self._next_prompt, self._prompt_state, self._batch_key, self._judge = (next_prompt, prompt_state,
                                                                               batch_key, judge)
        self.version, self._params = version, weights
        self._limits = limits
        self._batches: dict[int, _Batch] = collections.defaultdict(_Batch)
        self._complete: dict[int, RolloutBatch] = {}
        self._barrier_states: dict[int, tuple[list[Group], dict]] = {}
        self._barriers_passed: set[int] = set()
        self._forget: list[int] = []  # trained batches whose bookkeeping the stream drops (``forget``)
        self._done_below = plan.first  # every batch below it is complete
        self._chunks = 0  # decode chunks dispatched since the start or the last barrier
        self._completed_at: dict[int, int] = {}  # batch -> ``_chunks`` when it completed (0: before the count)
        self._prefill_version: dict[int, int] = {}  # id(group) -> the version its prompt was prefilled under
        self._mailbox: dict[int, dict] = {}
        self._lock = threading.Condition()
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._stopping = False
        self.idle_seconds = 0.0  # waiting for a version (the rollout group's idle time), since the last ``take``
        self._window_start = time.perf_counter()
        self._window_tokens = 0
        self._window_chunks = 0
        for g in restored or ():  # a checkpoint's finished groups, in their batches' order
            b = self._batches[g.batch]
            b.admitted = max(b.admitted, g.index + 1)
            (b.dropped if plan.dynamic_sampling and g.uniform else b.kept).append(g)
        for index in sorted(self._batches):
            self._maybe_complete(index)
        # the decode state and the host's view of it
        self._state = engine.init_decode_state()
        self._slot_row: list[tuple[Group, int] | None] = [None] * engine.max_concurrent_decodes
        self._queue: collections.deque[tuple[Group, int]] = collections.deque()
        self._prefixes: dict[int, tuple[object, int]] = {}  # id(group) -> (prefill batch, row)
        self._to_insert: collections.Counter = collections.Counter()  # id(group) -> samples not yet inserted
        self._pending = None

    # -- the trainer's side -------------------------------------------------------------------------------

    def start(self) -> Stream:
        """Run the stream in a thread of its own (the rollout devices then decode while the trainer trains)."""
        self._thread = threading.Thread(target=self._run_thread, name="rollout-stream", daemon=True)
        self._thread.start()
        return self

    def publish(self, version: int, weights: dict) -> None:
        """Policy ``version``'s rollout weights (``Engine.load_params`` of the state after step version - 1)."""
        with self._lock:
            self._mailbox[version] = weights
            self._lock.notify_all()

    def take(self, batch: int) -> RolloutBatch:
        """Batch ``batch``, once complete (driving the stream inline when it has no thread)."""
        return self._wait_for(self._complete, batch, f"batch {batch}")

    def forget(self, batch: int) -> None:
        """Drops the bookkeeping of ``batch`` once trained (a barrier after it no longer needs its groups)."""
        with self._lock:  # dropped by the stream's own thread, which reads the bookkeeping unlocked
            self._forget.append(batch)

    def snapshot(self, version: int) -> tuple[list[Group], dict]:
        """At barrier ``version`` (``plan.barriers``): the finished groups of batches >= version and the data
        iterator's position, what a checkpoint at step ``version`` keeps. Waits for the stream to get there."""
        if version not in self.plan.barriers:
            raise ValueError(f"step {version}: a streamed run saves at its checkpoint steps (checkpoint.every) and "
                             f"at the end of run(), where nothing is in flight")
        return self._wait_for(self._barrier_states, version, f"barrier {version}")

    def _wait_for(self, store: dict, key: int, what: str):
        """``store[key]``, popped once the stream has put it there: with no thread, driving the stream inline until
        then; else waiting for its thread, whose failure is raised here."""
        if self._thread is None:
            while key not in store:
                if not self._advance(block=False) and key not in store:
                    raise RuntimeError(f"rollout stream: {what} not reached (version {self.version} loaded; the "
                                       "next needs a version not yet published)")
            return store.pop(key)
        with self._lock:
            while key not in store and self._error is None:
                self._lock.wait()
            if key not in store:
                raise StreamError(f"rollout stream failed: {self._error!r}") from self._error
            return store.pop(key)

    def close(self) -> None:
        """Stops the thread (at its next chunk or wait); idempotent."""
        with self._lock:
            self._stopping = True
            self._lock.notify_all()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    # -- the stream ---------------------------------------------------------------------------------------

    def _run_thread(self) -> None:
        try:
            while not self._stopping and self._advance(block=True):
                pass
        except BaseException as e:  # handed to the trainer's thread by take / snapshot
            with self._lock:
                self._error = e
                self._lock.notify_all()

    def _next_batch(self) -> int | None:
        """The lowest batch that still needs a prompt admitted, or None."""
        p = self.plan
        for b in range(self._done_below, p.end):
            s = self._batches.get(b)
            if s is None:
                return b
            if not s.done and len(s.kept) + s.live < p.prompts and s.admitted < p.prompts * p.max_rounds:
                return b
        return None

    def _batch_complete(self, b: int) -> bool:
        return b < self._done_below or (b in self._batches and self._batches[b].done)

    def _live(self) -> int:
        return sum(s.live for s in self._batches.values())

    def _advance(self, block: bool) -> bool:
        """One round: admit and load weights where the schedule says, fill free slots, dispatch a chunk, read the
        one before. False once there is nothing left to do (or, with ``block`` False, when the next round needs
        a version not yet published)."""
        p = self.plan
        with self._lock:
            forget, self._forget = self._forget, []
        for b in forget:
            if b < self._done_below:
                self._batches.pop(b, None)
        while (b := self._next_batch()) is not None:
            free = sum(r is None for r in self._slot_row) - len(self._queue)
            if free <= 0:
                break
            if b - p.max_staleness > self.version:  # needs version + 1
                v = self.version + 1
                drained = self._live() == 0 and self._pending is None
                inflight = (p.inflight_updates and v not in p.barriers
                            and self._chunks - self._completed_at.get(v - 1, 0) >= p.load_delay)
                if not (self._batch_complete(v - 1) and (drained or inflight)):
                    break
                if v in p.barriers and v not in self._barriers_passed:
                    self._barriers_passed.add(v)
                    self._barrier(v)
                if not self._load(v, block):
                    return False
                continue
            self._admit(b)
        inserted = self._fill_slots()
        dispatched = None
        if any(r is not None for r in self._slot_row):
            first = tuple(jnp.copy(a) for a in (self._state.tokens, self._state.logprobs, self._state.done)) \
                if inserted else None
            self._state, tokens, logprobs, valid = self.engine.generate_steps(self._params, self._state,
                                                                              p.steps_per_sync)
            self._chunks += 1
            self._window_chunks += 1
            dispatched = (list(self._slot_row), inserted, first, (tokens, logprobs, valid, jnp.copy(self._state.done)),
                          self.version)
        if self._pending is not None:
            self._read(self._pending)
        self._pending = dispatched
        if dispatched is None and not self._queue and self._next_batch() is None:
            # all batches generated: the barriers the stream never loaded a version for are here (nothing in flight)
            for v in sorted(p.barriers - self._barriers_passed):
                self._barriers_passed.add(v)
                self._barrier(v)
            return False
        return True

    def _barrier(self, version: int) -> None:
        """Drained before loading ``version``: keep what a checkpoint at step ``version`` needs."""
        groups = sorted((g for b, s in self._batches.items() if b >= version for g in (*s.kept, *s.dropped)),
                        key=lambda g: (g.batch, g.index))
        # a stream restored here starts its counts at 0 with these batches complete: so does this one
        self._chunks, self._window_chunks, self._completed_at = 0, 0, {b: 0 for b in self._completed_at}
        with self._lock:
            self._barrier_states[version] = (groups, self._prompt_state())
            self._lock.notify_all()

    def _load(self, version: int, block: bool) -> bool:
        t = time.perf_counter()
        with self._lock:
            while version not in self._mailbox:
                if not block or self._stopping:
                    return False
                self._lock.wait()
            weights = self._mailbox.pop(version)
            for old in [v for v in self._mailbox if v < version]:
                del self._mailbox[old]
        self.idle_seconds += time.perf_counter() - t
        self._params, self.version = weights, version  # the live sequences go on under it
        for b in [b for b in self._completed_at if b < version - 1]:  # no later load reads them
            del self._completed_at[b]
        return True

    def _admit(self, b: int) -> None:
        s = self._batches[b]
        n, max_new = self.plan.samples, self.engine.config.max_new_tokens
        record = self._next_prompt()
        g = Group(b, s.admitted, record, np.zeros((n, max_new), np.int32), np.zeros((n, max_new), np.float32),
                  np.full((n, max_new), -1, np.int32), np.zeros(n, np.int64), [""] * n,
                  admitted_version=self.version)
        if self._limits is not None:
            g.limits = np.asarray(self._limits(b, g.index))
        s.admitted += 1
        s.live += 1
        self._queue.extend((g, i) for i in range(n))
        self._to_insert[id(g)] = n

    def _fill_slots(self) -> list[int]:
        """Queued samples into the free slots, prefilling their prompts first (in ``prefill_group`` groups)."""
        pairs = []
        for slot in range(len(self._slot_row)):
            if self._slot_row[slot] is None and self._queue:
                pairs.append((slot, self._queue.popleft()))
        if not pairs:
            return []
        groups = list({id(g): g for _, (g, _) in pairs if id(g) not in self._prefixes}.values())
        self._prefill(groups)
        by_group: dict[int, list] = {}
        for slot, (g, i) in pairs:
            by_group.setdefault(id(g), []).append((slot, g, i))
            self._slot_row[slot] = (g, i)
        n = self.plan.samples
        for key, items in by_group.items():
            g = items[0][1]
            batch, row = self._prefixes[key]
            keys = row_keys(self._batch_key(g.batch), [g.index * n + i for _, _, i in items], n)[: len(items)]
            self._state = self.engine.insert_samples(batch, self._state, [s for s, _, _ in items], keys, row=row,
                                                     size=n)
            self._to_insert[key] -= len(items)
        for _, (g, i) in pairs:  # the first token is drawn from the prefill's logits: its version
            g.versions[i, 0] = self._prefill_version[id(g)]
        for key in by_group:
            if self._to_insert[key] == 0:
                del self._prefixes[key], self._to_insert[key], self._prefill_version[key]
        return [slot for slot, _ in pairs]

    def _prefill(self, groups: list[Group]) -> None:
        """Prefill ``groups``' prompts, a fixed number per call per bucket (``driver.prefill_group``); prompt j of
        batch b draws its first token with fold_in(fold_in(rng, b), 2**30 + j), as ``driver.generate``."""
        def keys(indices: list[int], size: int) -> np.ndarray:  # each prompt's from its own batch's key
            out = np.zeros((size, 2), np.uint32)
            for row, i in enumerate(indices):
                g = groups[i]
                out[row] = np.asarray(row_keys(self._batch_key(g.batch), [2**30 + g.index], 1)[0])
            return out

        prefixes = prefill_prompts(self.engine, self._params, [g.record.prompt_ids for g in groups], keys)
        for i, prefix in prefixes.items():
            self._prefixes[id(groups[i])] = prefix
            self._prefill_version[id(groups[i])] = self.version

    def _read(self, dispatched) -> None:
        """A dispatched chunk on the host: its rows' tokens, logprobs and versions; the rows, groups and batches
        that finish in it."""
        rows, inserted, first, chunk, version = dispatched
        stop_ids = set(self.engine.config.stop_ids)

        def take(tokens, logprobs, valid, done, chunk_version):
            for slot, item in enumerate(rows):
                if item is None:
                    continue
                g, i = item
                if g.reasons[i]:
                    continue
                start = int(g.lengths[i])
                steps, cut = chunk_steps(valid[:, slot], start, None if g.limits is None else g.limits[i])
                end = start + len(steps)
                g.tokens[i, start:end] = tokens[steps, slot]
                g.logprobs[i, start:end] = logprobs[steps, slot]
                if chunk_version is not None:  # an insert's first token keeps its prefill's version
                    g.versions[i, start:end] = chunk_version
                g.lengths[i] = end
                self._window_tokens += len(steps)
                if done[slot] or cut:
                    g.reasons[i] = "stop" if cut or g.tokens[i, end - 1] in stop_ids else "length"
                    if self._slot_row[slot] is item:
                        self._slot_row[slot] = None
                    if g.finished:
                        self._group_finished(g)

        if first is not None:
            tokens, logprobs, done = host_get(first)
            mask = np.zeros((1, len(rows)), bool)
            mask[0, inserted] = True
            take(tokens[None], logprobs[None], mask, np.where(mask[0], done, False), None)
        take(*host_get(chunk), version)

    def _group_finished(self, g: Group) -> None:
        p, s = self.plan, self._batches[g.batch]
        g.rewards, g.per_fn = self._judge(g.record, [g.tokens[i, : g.lengths[i]] for i in range(p.samples)])
        s.live -= 1
        (s.dropped if p.dynamic_sampling and g.uniform else s.kept).append(g)
        self._maybe_complete(g.batch)

    def _maybe_complete(self, b: int) -> None:
        p, s = self.plan, self._batches[b]
        if s.done or s.live:
            return
        if len(s.kept) < p.prompts and s.admitted < p.prompts * p.max_rounds:
            return  # more prompts to admit
        s.done = True
        self._completed_at[b] = self._chunks
        while self._done_below in self._batches and self._batches[self._done_below].done:
            self._done_below += 1
        batch = assemble(s, p, b)
        now = time.perf_counter()
        window = now - self._window_start
        batch.stats.update({"rollout_seconds": window, "generated_tokens": float(self._window_tokens),
                            "tokens_per_second": self._window_tokens / max(window, 1e-9),
                            "rollout_idle_seconds": self.idle_seconds,
                            "async/rollout_chunks": float(self._window_chunks),
                            "async/rollout_busy_s": max(window - self.idle_seconds, 0.0)})
        self._window_start, self._window_tokens, self._window_chunks, self.idle_seconds = now, 0, 0, 0.0
        with self._lock:
            self._complete[b] = batch
            self._lock.notify_all()


def assemble(s: _Batch, plan: StreamPlan, b: int) -> RolloutBatch:
    """Batch ``b``'s ``RolloutBatch``: its first P kept groups by admission, then (dynamic sampling out of rounds)
    dropped ones as masked filler."""
    kept = sorted(s.kept, key=lambda g: g.index)[: plan.prompts]
    filler = sorted(s.dropped, key=lambda g: g.index)[: plan.prompts - len(kept)]
    groups = kept + filler
    n = plan.samples
    cat = lambda name: np.concatenate([getattr(g, name) for g in groups])
    batch = RolloutBatch(
        prompt_index=np.repeat(np.arange(len(groups)), n), tokens=cat("tokens"), logprobs=cat("logprobs"),
        lengths=cat("lengths"), finish_reasons=[r for g in groups for r in g.reasons], stats={},
        versions=cat("versions"), masked=np.repeat(np.arange(len(groups)) >= len(kept), n), groups=groups)
    admitted = s.admitted
    batch.stats.update({
        "dynamic/dropped_groups": float(len(s.dropped)),
        "dynamic/extra_prompts": float(admitted - plan.prompts),
        "dynamic/fill_rounds": float(-(-admitted // plan.prompts)),
        "dynamic/unfilled_groups": float(len(filler)),
        "async/tokens_dropped": float(sum(int(g.lengths.sum()) for g in s.dropped if g not in filler)),
    })
    return batch
