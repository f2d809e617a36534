"""What a run leaves behind: checkpoints (complete or absent), metrics and trackers, early stopping's best
checkpoint, the push to the Hub."""
