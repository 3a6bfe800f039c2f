"""The ``compile`` feature: pre-packed linears, compiled fused MLPs, and compiled decode steps (over hf_accel's paged
cache, or Transformers' static cache). It sits above the features whose modules and caches it compiles."""
