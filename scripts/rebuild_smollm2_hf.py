"""Rebuild SmolLM2-135M-Instruct as a Hugging Face checkpoint from the default GGUF.

    python scripts/rebuild_smollm2_hf.py [DEST]

DEST defaults to $CTXQ_HOME/hf/SmolLM2-135M-Instruct (reused when complete).
"""

import sys

from ctxq.testing.models import rebuild_smollm2_hf

if __name__ == "__main__":
    print(rebuild_smollm2_hf(sys.argv[1] if len(sys.argv) > 1 else None))
