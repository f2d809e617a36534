"""How the weights step: optimizers by name (matrices/optimizers.toml), Muon, the learning-rate schedule,
LISA's layer sampling."""
