"""Rows -> tensors: packing (multipack bins), the sampler (which rows go to which rank; no collectives),
the collator and the attention masks that keep packed sequences apart, the label convention (labels.IGNORE)."""
