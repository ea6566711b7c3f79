"""What a run saves and loads: the plugin's model format (`model_format`), Hugging Face <->
model-format conversion by tensor name (`hf`), atomic training checkpoints (`checkpoint`).
Imports: every wing below."""
