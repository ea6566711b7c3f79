"""The shared prompt: capture (run the prompt once without autograd, keep what responses
read in pages) and the exact prompt gradient (`prompt_backward`). Imports: every wing below."""
