"""``python -m fp8rl_jax.serve``: the --config flag and friendly errors (``fp8rl_jax.cli``), and the
server's own flags.

Exit status: 0 stopped (SIGINT, SIGTERM); 2 bad input, said in one ``error:`` line (a flag, a config key or value, a
port in use, a ``--checkpoint`` folder that does not exist (nothing is created) or holds no complete step, a model or
tokenizer file that does not read: ``fp8rl_jax.cli.bad_input_errors``); 1 anything else (a traceback)."""

from __future__ import annotations

import logging
import signal
import sys

from absl import app, flags

from fp8rl_jax import cli, serve  # cli defines --config, --dry_run (and the trainer's --steps)

_PORT = flags.DEFINE_integer("port", 9000, "gRPC port (0: any free one).", lower_bound=0, upper_bound=65535)
_HOST = flags.DEFINE_string("host", serve.DEFAULT_HOST, "Interface to bind; 0.0.0.0 or :: exposes it (no auth).")
_SLOTS = flags.DEFINE_integer("max_concurrent_decodes", None, "Decode slots (default: rollout.decode_slots; 0 "
                              "there: up to 64, as many as the device memory holds).",
                              lower_bound=1)
_MAX_NEW = flags.DEFINE_integer("max_new_tokens", None, "Tokens per request at most, whatever its max_tokens "
                                "(default: rollout.max_new_tokens).", lower_bound=1)
_GREEDY = flags.DEFINE_bool("greedy", False, "Argmax sampling (deterministic) instead of config.rollout's.")
_CHECKPOINT = flags.DEFINE_string("checkpoint", None, "A trainer's checkpoint directory (<workdir>/checkpoints): "
                                  "serve its params, FP8 state and KV scales (latest step).")


def main(argv) -> int:
    config, code = cli.tool_config(argv, training=False)  # serving may truncate (top-p / top-k)
    if config is None:
        return code
    # our own warnings (an uncalibrated FP8 state, engine failures); JetStream's loggers stay at WARNING
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        handle = serve.build_server(config, port=_PORT.value, host=_HOST.value, greedy=_GREEDY.value,
                                    max_concurrent_decodes=_SLOTS.value, max_new_tokens=_MAX_NEW.value,
                                    checkpoint=_CHECKPOINT.value)
    except cli.bad_input_errors() as e:  # the port in use, a missing checkpoint, a model file that does not read
        return cli.input_error(e)
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: handle.stop())
    print(f"serving {config.model.source} on {handle.host}:{handle.port} (JetStream gRPC); Ctrl-C stops", flush=True)
    handle.wait()
    return 0


def _parse_flags(argv: list[str]) -> list[str]:
    if any(a in ("-h", "--help", "--helpshort", "-?") for a in argv[1:]):
        sys.exit(print(serve.__doc__, flags.FLAGS.main_module_help(), sep="\n"))
    return cli.parse_flags(argv)


if __name__ == "__main__":
    app.run(main, flags_parser=_parse_flags)
