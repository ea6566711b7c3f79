"""The step and the loop: scoring and serial replay (`replay`), the GRPO step (`schedule`), the
launcher's training loop (`train`; its command line `command_line`, its groups `group_sources`, its
model `model_setup`), its flags (`arguments`), receipts, metrics, the learning-rate schedule, exit
conditions, held-out evaluation and scoring a file of groups outside a step (`scoring`,
tools/score.py). Imports: every wing below."""
