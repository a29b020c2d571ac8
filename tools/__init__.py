"""Scripts that import dapo.py, each run on its own (python tools/NAME.py --help). dapo.py never imports
them; what it imports lives in lib/."""
