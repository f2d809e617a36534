"""Compatibility matrices as TOML data; this package only marks where they live."""
