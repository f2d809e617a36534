"""Dockerfile templates (Jinja2); this package only marks where they live."""
