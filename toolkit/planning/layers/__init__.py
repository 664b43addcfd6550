"""Whole layers per card (`-sm layer`), leftover layers on the CPU: `search` (the split of the layer slots), `fast`
(layers moved to the cards where they run fastest)."""
