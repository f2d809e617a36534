"""The machine a run is on: the GPU (named, from the plan file, or probed), and what the config's attention and
precision become on it (the plan file's one rule: planfile.py)."""
