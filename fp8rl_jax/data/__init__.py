"""Prompt data: GSM8K (``gsm8k``), the synthetic tasks (``synthetic``), and the
checkpointable grain pipeline that turns problems into prompt token ids (``prompts``)."""
