"""The kernel layer: every native entry point as a torch custom op with a pure-torch reference (:mod:`.ops`,
:mod:`.reference`), the CPU extension built once per instruction set (:mod:`.build`, sources in ``cpu/``), and the one
place implementations are chosen (:func:`.ops.choose`). A CUDA implementation goes in ``cuda/`` and registers under
the op's CUDA dispatch key (docs/architecture.md)."""
