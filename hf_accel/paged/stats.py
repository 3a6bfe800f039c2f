"""Block and memory accounting of a paged cache."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .cache import PagedCache

__all__ = ["cache_stats"]


def cache_stats(cache: PagedCache) -> dict[str, float | int | str]:
    """Block and memory accounting.

    Returns:
        ``blocks_total``, ``blocks_used`` (held by live rows), ``blocks_cached`` (held only by the prefix
        table), ``blocks_free``, ``blocks_shared`` (by more than one row), ``bytes_reserved``, ``bytes_live``
        (K/V bytes of tokens live rows hold), ``utilisation`` (``bytes_live`` / bytes of the blocks in use),
        ``live_tokens``, ``prefix_hit_tokens`` / ``prompt_tokens`` (since construction),
        ``peak_blocks_used`` (since the last :meth:`start`, i.e. during the last ``generate`` call),
        ``prefix_drops`` (times the prefix table was dropped because the model's weights changed),
        ``blocks_limit`` / ``bytes_limit`` (what the pool may grow to), ``sizing`` (what is reserved, and why).
    """
    m = cache.manager
    live = [s for s in cache.row_sequences() if s is not None]
    live_tokens = sum(m.num_tokens(s) for s in live)
    in_use = len({b for s in live for b in m.block_table(s)}) * cache.block_bytes
    token_bytes = cache.block_bytes // cache.block_size
    return {
        "blocks_total": cache.num_blocks,
        "blocks_used": in_use // cache.block_bytes,
        "blocks_cached": m.num_evictable,
        "blocks_free": m.num_free,
        "blocks_shared": m.num_shared(),
        "bytes_reserved": cache.num_blocks * cache.block_bytes,
        "bytes_live": live_tokens * token_bytes,
        "utilisation": (live_tokens * token_bytes / in_use) if in_use else 1.0,
        "live_tokens": live_tokens,
        "prefix_hit_tokens": cache.prefix_hit_tokens,
        "prompt_tokens": cache.prompt_tokens,
        "peak_blocks_used": cache.peak_blocks_used,
        "prefix_drops": cache.prefix_drops,
        "blocks_limit": cache.limit_blocks,
        "bytes_limit": cache.limit_blocks * cache.block_bytes,
        "sizing": cache.sizing,
    }
