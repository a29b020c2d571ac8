"""What dapo.py imports besides reward.py: the input checks and the built-in demo model. Nothing here
imports dapo.py or tools/; each also runs on its own (python lib/NAME.py --help)."""
