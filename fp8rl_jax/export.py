"""Hugging Face export: ``python -m fp8rl_jax.export --config=configs/x.py [--checkpoint=DIR] [--step=N] --out=DIR``.

Writes a folder that ``transformers`` loads as it is (``AutoModelForCausalLM.from_pretrained(out)``,
``AutoTokenizer.from_pretrained(out)``), and that ``config.model.source=out`` loads back here:
- ``config.json`` and ``model.safetensors``: a ``LlamaForCausalLM`` (``Qwen2ForCausalLM`` for q/k/v biases), the
  weights in ``--dtype`` (float32 by default);
- ``tokenizer.json`` and ``tokenizer_config.json``: the run's tokenizer (special tokens, the chat template where
  the model has one), encoding as it does here. The synthetic tasks' char tokenizer exports too: transformers
  loads it as a plain fast tokenizer (one token per character, BOS first; an unknown character is the backend's
  "Missing [UNK] token" error there).

What it exports: with ``--checkpoint`` (a trainer's ``<workdir>/checkpoints``; ``--step``, default the latest) the
trained policy's params, else the model ``config.model`` loads (its initial weights). These are the master
weights; the FP8 state is not exported: transformers runs the model in ``--dtype``, so an FP8-trained policy's
exported logits are its master-weight logits, a little different from what its FP8 rollout sampled.
The output folder must not exist or be empty (an export never overwrites files). An ``--out`` inside a run's
workdir (``config.workdir``, or the one ``--checkpoint`` is in) is written only while no other process holds that
workdir (``fp8rl_jax.workdir_lock``); under a live trainer the export stops with exit status 3, naming it.

Exit status: 0 written; 2 bad input, said in one ``error:`` line (a flag, a config key or value, an ``--out`` that
holds files, a ``--checkpoint`` folder that does not exist (nothing is created) or holds no such step, a model or
tokenizer file that does not read: ``fp8rl_jax.cli.bad_input_errors``); 3 the workdir is in use; 1 the files do not
fit together (a checkpoint of another model, one line) or anything else (a traceback).
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

from fp8rl_jax.model import weights
from fp8rl_jax.model.config import LlamaConfig
from fp8rl_jax.model.tokenizer import Tokenizer


def export_hf(out: str | os.PathLike, params: dict, model: LlamaConfig, tokenizer: Tokenizer,
              dtype: str = "float32") -> Path:
    """Write ``params`` (our layout), ``model`` and ``tokenizer`` as a Hugging Face model folder ``out``.

    Written into ``<out>.tmp`` and renamed, so ``out`` is either complete or absent. Returns ``out``."""
    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise FileExistsError(f"{out} exists and is not an empty folder; export into a new one")
    if tokenizer.vocab_size > model.vocab_size:
        raise ValueError(f"the tokenizer has {tokenizer.vocab_size} tokens, more than the model's "
                         f"vocab_size={model.vocab_size}: its ids past the model's would have no logits")
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)  # a previous export that died half-way
    weights.save_hf(tmp, params, model, dtype)
    tokenizer.save(tmp)
    if out.exists():
        out.rmdir()  # empty (checked above)
    os.replace(tmp, out)
    return out


def export_run(config, out: str | os.PathLike, *, checkpoint: str | None = None, step: int | None = None,
               dtype: str = "float32") -> Path:
    """Export the policy of ``checkpoint`` (at ``step``, default the latest), or the model ``config`` loads. A
    ``checkpoint`` folder that does not exist is a ``FileNotFoundError`` naming it (nothing is created)."""
    if checkpoint is not None:
        from fp8rl_jax.checkpoint import existing_checkpoint_folder
        from fp8rl_jax.policy_io import load_policy

        model, params, _, _, tokenizer = load_policy(config, existing_checkpoint_folder(checkpoint), step)
    elif step is not None:
        raise ValueError("--step needs --checkpoint (the trainer's <workdir>/checkpoints)")
    else:
        from fp8rl_jax.model.loading import load_model
        from fp8rl_jax.plan import model_spec

        model, params, tokenizer = load_model(model_spec(config))
    return export_hf(out, params, model, tokenizer, dtype)


# ----------------------------------------------------------------------------------------------------------
# command line: the --config flag and friendly errors (fp8rl_jax.cli), and the export's own flags


def main(argv) -> int:

    from fp8rl_jax import cli
    from fp8rl_jax.workdir_lock import WorkdirLockedError, lock_for_output

    config, code = cli.tool_config(argv)
    if config is None:
        return code
    if _STEP.value is not None and not _CHECKPOINT.value:
        return cli.input_error(f"--step={_STEP.value} needs --checkpoint (the trainer's <workdir>/checkpoints)")
    if _CHECKPOINT.value:
        from fp8rl_jax.checkpoint import existing_checkpoint_folder

        try:  # before the lock below, which would create a workdir the --checkpoint names
            existing_checkpoint_folder(_CHECKPOINT.value)
        except OSError as e:
            return cli.input_error(e)
    try:  # an export into a run's workdir: not while another process (a trainer) owns it
        run_dirs = [Path(_CHECKPOINT.value).parent if _CHECKPOINT.value else None, config.workdir]
        lock = lock_for_output(_OUT.value, run_dirs, alternative="--out=<a folder outside it>")
    except WorkdirLockedError as e:
        print(f"error: {e}", file=sys.stderr)
        return 3
    try:
        out = export_run(config, _OUT.value, checkpoint=_CHECKPOINT.value, step=_STEP.value, dtype=_DTYPE.value)
    except cli.bad_input_errors() as e:  # an existing output folder, a missing checkpoint, a bad model file: exit 2
        return cli.input_error(e)
    except ValueError as e:  # what the files hold does not fit (a checkpoint of another model, say)
        print(f"error: {e}", file=sys.stderr)
        return 1
    finally:
        if lock is not None:
            lock.release()
    print(f"wrote {out} (config.json, model.safetensors, tokenizer.json, tokenizer_config.json)")
    return 0


def _parse_flags(argv: list[str]) -> list[str]:
    from absl import flags

    from fp8rl_jax import cli

    if any(a in ("-h", "--help", "--helpshort", "-?") for a in argv[1:]):
        sys.exit(print(__doc__, flags.FLAGS.main_module_help(), sep="\n"))
    return cli.parse_flags(argv)


if __name__ == "__main__":
    from absl import app, flags

    import fp8rl_jax.cli  # noqa: F401 - defines --config, --dry_run (and the trainer's --steps)

    _OUT = flags.DEFINE_string("out", None, "The Hugging Face folder to write (new or empty).", required=True)
    _CHECKPOINT = flags.DEFINE_string("checkpoint", None, "A trainer's checkpoint directory "
                                      "(<workdir>/checkpoints); default: the model config.model loads.")
    _STEP = flags.DEFINE_integer("step", None, "The checkpoint step (default: the latest complete one).", lower_bound=0)
    _DTYPE = flags.DEFINE_enum("dtype", "float32", list(weights.HF_SAVE_DTYPES), "The weights' dtype.")
    app.run(main, flags_parser=_parse_flags)
