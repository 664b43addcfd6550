"""How fast a placement runs: `model` (the estimate from each card's throughput and bandwidth), `shape` (a model's
work per layer, from its header), `store` (`ctxq bench`'s measurements, kept), `reading` (the time to read the
context that every plan prints)."""
