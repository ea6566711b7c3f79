"""What a run saves and loads: the plugin's model format (`model_format`), Hugging Face <->
model-format conversion by tensor name (`hf`), the model a scoring or generating tool runs and its
weights (`model_source`), atomic training checkpoints (`checkpoint`), one writer per save folder (`save_lock`). Imports: every wing below."""
