"""Weights in host memory, never the cache (`--offload weights`): `placement` (the FFN weights, after a mixture's
routed experts, that go to host memory while every layer's attention and KV cache stay on the cards)."""
