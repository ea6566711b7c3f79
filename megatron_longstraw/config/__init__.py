"""The run's settings, declared once (`settings.LongStrawConfig`: a section per phase, each
setting a field with its docstring, from which `fields` makes the `--longstraw-*` flag and the
YAML `longstraw:` key) and the choices they validate against (`choices`, `loss`, `sampling`).
The floor of the package. Imports: nothing from the package."""
