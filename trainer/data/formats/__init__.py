"""Prompt formats: one dataset row -> text and the spans that are trained (alpaca and its styles, completion,
input_output, chat templates, Axolotl's preference types, mistral-common's own tokenizer)."""
