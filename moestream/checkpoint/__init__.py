"""Checkpoints: the expert index over safetensors shards, the dense loader, and test-model writer."""
