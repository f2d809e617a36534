"""Prepare once: load the datasets (files, directories, hub ids), tokenize them with their prompt format
(formats/), filter and split, cache under dataset_prepared_path (prepare.py); or stream them (streaming.py).
Each objective's own rows are built by its data hook in trainer/objectives/, through prepare.prepare."""
