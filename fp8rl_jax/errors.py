"""The errors an entry point says in one line: a bad config value (``ConfigError``, raised by ``fp8rl_jax.config``
and by the lower layers that check a config key), and input files that do not read as what their name says
(``InputFileError``, one line naming the file).

The data, model and tokenizer loaders (``fp8rl_jax.data.gsm8k``, ``fp8rl_jax.model.weights``,
``fp8rl_jax.model.tokenizer``, ``fp8rl_jax.model.gguf_tokenizer``) raise ``InputFileError`` for a file that is there
but cannot be used: a data line that is not JSON, a ``.gguf`` or ``.safetensors`` file of other bytes, a
``config.json`` that is not a Llama-family config, a tensor the weights lack. Every entry point (``fp8rl_jax.main``,
``.eval``, ``.export``, ``.serve``) says it as one ``error:`` line with exit status 2, as it does a bad config value
(``fp8rl_jax.cli.bad_input_errors``). A subclass of ``ValueError`` (``MissingTensorError`` also of ``KeyError``),
so code that caught those before still does; a missing file stays ``FileNotFoundError``.
"""

from __future__ import annotations


class ConfigError(ValueError):
    """A config value (or config file) that is not allowed; the message names the key, the value and what is
    allowed (``fp8rl_jax.config.validate``)."""


class InputFileError(ValueError):
    """A data, model or tokenizer file that cannot be read as one; the message names the file (and the line or the
    tensor, where one is at fault)."""


class MissingTensorError(InputFileError, KeyError):
    """A tensor the model needs is not in its weight files; the message names the files and the tensor."""

    def __str__(self) -> str:  # the message as given, not KeyError's repr of it
        return str(self.args[0]) if self.args else ""
