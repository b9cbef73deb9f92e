"""The memorization mitigations: goldfish loss, LoRA (peft) and DP-SGD (ghost clipping, Opacus)."""
