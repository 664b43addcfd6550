"""Tensor mode (`-sm tensor`): every offloaded layer cut across the cards. `mode` (the plan, proportions searched card
by card, and the comparison with layer mode), `split` + `hybrid` (llama.cpp's split state as data: each card's cut of
every tensor, KV head and recurrent state), `candidates` + `subset` (tensor mode over every card and over subsets)."""
