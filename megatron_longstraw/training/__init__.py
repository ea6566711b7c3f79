"""The step and the loop: scoring and serial replay (`replay`), the GRPO step
(`schedule`), the launcher's training loop (`train`; its command line `command_line`, its groups
`group_sources`, its model `model_setup`), its flags (`arguments`), receipts, metrics, the
learning-rate schedule, exit conditions and held-out evaluation. Imports: every wing below."""
