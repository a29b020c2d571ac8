"""What dapo.py imports besides reward.py: the input checks, the built-in demo model, the process group,
Ctrl-C and LoRA's adapters. Nothing here imports dapo.py or tools/; check_data and demo_model also run on
their own (python lib/NAME.py --help)."""
