"""Pretraining on real text (masked LM, causal LM), checkpoints and resume, torchrun, length sweeps."""
