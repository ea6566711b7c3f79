"""The GRPO loss (`loss`: advantages, the clipped member loss, KL) and the off-policy
correction between the engine and the trainer (`offpolicy`). Imports: every wing below."""
