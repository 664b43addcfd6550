"""`ctxq serve`: the OpenAI-compatible server (`server.py` assembles it; a request passes `gate.py` to
llama-cpp-python's routes, or with --parallel to `parallel.py`'s) and ctxq's engine, many sequences in one
llama.cpp context (`Engine`: a document held once, the answers decoded together)."""
