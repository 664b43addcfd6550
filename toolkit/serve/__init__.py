"""Many sequences in one llama.cpp context: `Engine` (the document held once, answers decoded together)."""
