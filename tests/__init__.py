"""dapo.py's tests by topic; the paper's own are ../test_dapo.py."""
