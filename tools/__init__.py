"""Tools beside dapo.py: each runs on its own (python tools/NAME.py --help)."""
