"""What a run saves and loads: the plugin's model format (`model_format`), atomic
training checkpoints (`checkpoint`). Imports: every wing below."""
