"""The run's settings (`settings.LongStrawConfig`, the `--longstraw-*` flags or a YAML
`longstraw:` section) and the choices they validate against. Imports: every wing below."""
