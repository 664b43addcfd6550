"""Hardware profiles: TOML files describing a box's devices (see `ctxq plan --profile`)."""
