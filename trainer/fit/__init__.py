"""The memory estimate: will a config fit a GPU (memory.py), the model shapes it counts from config.json
(memory_model.py), and the micro-batch chosen from it at start (auto_batch.py). Config and facts only: `envtool fit`
runs it without torch."""
