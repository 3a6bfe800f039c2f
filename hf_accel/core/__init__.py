"""The bottom layer: errors, configs, the architecture registry, the change recorder, device and dispatch helpers,
metrics, paths, the per-model patch state and the ``generate`` call object.

Nothing here imports another hf_accel package; every other layer may import it (``docs/architecture.md``).
"""
