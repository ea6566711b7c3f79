"""The launcher: its training loop (`train`), command line (`command_line`; the flags in
`arguments`, generated from the settings' fields, plus the launcher's own), the groups it feeds the
step (`group_sources`), its model (`model_setup`), receipts, metrics, the learning-rate schedule,
guards and exit conditions. The step itself is the `step` wing. Imports: every wing below."""
